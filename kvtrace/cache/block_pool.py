"""Block pool of one KV cache group: null block, free queue (``blocks``), hash map.

After vLLM's ``BlockPool``:

* block 0 is the null block: a placeholder in block tables, never cached or freed;
* free blocks sit in an intrusive doubly linked queue. ``get_new_blocks`` pops the head
  and evicts whatever keys the popped block still carries (an ``lru`` eviction);
* ``free_blocks`` drops ``ref_cnt``; at 0 an unhashed block goes to the head (quick
  reuse), a hashed one to the tail (LRU order). Requests free in reverse order, so a
  request's tail blocks are evicted before its prefix;
* a hit on a block with ``ref_cnt == 0`` removes it from the queue (``touch``);
* the hash map may hold duplicates (one key -> several blocks); a block carries one
  primary key and optional aliases (partial keys at a hash boundary inside it);
* keys published in the current step are not hittable until ``new_step_starts``
  (content is written by the forward pass that follows the allocation).

Keys are per group (each group has its own pool and block id space), so a key here is
the hash alone; globally it is (hash, group id).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kvtrace.cache.blocks import FreeKVCacheBlockQueue, KVCacheBlock
from kvtrace.cache.events import EVICT_LRU, EVICT_REPLACED, EVICT_RESET, BlockEvicted, BlockPublished
from kvtrace.cache.hashing import BlockHash
from kvtrace.cache.sink import EventSink

if TYPE_CHECKING:
    from kvtrace.cache.external import ExternalTier


class BlockPool:
    """Blocks, free queue and hash map of one group. Emits events into ``sink``."""

    def __init__(self, num_blocks: int, group_id: int, sink: EventSink):
        self.group_id = group_id
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.null_block.ref_cnt = 1  # never reaches the free queue
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        self.cached: dict[BlockHash, KVCacheBlock | dict[int, KVCacheBlock]] = {}
        self.step = sink.step
        self.sink = sink
        self.external: ExternalTier | None = None  # write-through second tier

    # -- lookups ------------------------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """Any block carrying ``block_hash`` (ignores same-step deferral)."""
        v = self.cached.get(block_hash)
        if v is None or type(v) is KVCacheBlock:
            return v
        return next(iter(v.values()))

    def get_cached_blocks(self, block_hash: BlockHash) -> list[KVCacheBlock]:
        v = self.cached.get(block_hash)
        if v is None:
            return []
        return [v] if type(v) is KVCacheBlock else list(v.values())

    def lookup_for_hit(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """A block usable for a hit now: keys published this step must wait a step."""
        v = self.cached.get(block_hash)
        if v is None:
            return None
        step = self.step
        if type(v) is KVCacheBlock:
            return v if v.published_step != step else None
        for b in v.values():
            if b.published_step != step:
                return b
        return None

    # -- allocation ---------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_new_blocks(self, n: int, request_id: str | None = None) -> list[KVCacheBlock]:
        """Pop ``n`` blocks from the queue head; evict the keys they still carry."""
        out, evicted = self._pop_evicting(n, request_id)
        if evicted is not None:
            self.sink.events.append(evicted)
        return out

    def _pop_evicting(self, n: int, request_id: str | None) -> tuple[list[KVCacheBlock], BlockEvicted | None]:
        """Pop ``n`` blocks (ref_cnt 1), drop their keys and count those as LRU evictions.

        Returns the blocks and, when events are on, the eviction event, built before the
        caller re-keys the blocks (it reports their old publish and use steps).
        """
        q = self.free_block_queue
        if n > q.num_free_blocks:
            raise ValueError(f"group {self.group_id}: need {n} blocks, {q.num_free_blocks} free")
        cached = self.cached
        out = []
        append = out.append
        ev_blocks = []  # the holder of each evicted key (a block with aliases holds several)
        ev_hashes = []
        b = q.head
        for _ in range(n):
            b = b.next_free
            b.ref_cnt = 1
            append(b)
            h = b.block_hash
            if h is not None:
                v = cached.pop(h, None) if b.aliases is None else None
                if v is b:  # the common case: the block is the key's only holder
                    b.block_hash = None
                    ev_blocks.append(b)
                    ev_hashes.append(h)
                else:
                    if v is not None:
                        cached[h] = v  # a duplicates map: put it back, remove b from it below
                    for kh, _nt in b.keys():
                        ev_blocks.append(b)
                        ev_hashes.append(kh)
                    self._drop_keys(b)
        # unlink the popped run in one go (popped blocks keep stale links; unused)
        nxt = b.next_free
        q.head.next_free = nxt
        nxt.prev_free = q.head
        q.num_free_blocks -= n
        if not ev_blocks:
            return out, None
        sink = self.sink
        sink.evictions += len(ev_blocks)
        sink.evictions_by_reason[EVICT_LRU] += len(ev_blocks)
        if not sink.enabled:
            return out, None
        step = sink.step
        return out, BlockEvicted(
            step, self.group_id, EVICT_LRU, tuple([b.block_id for b in ev_blocks]), tuple(ev_hashes),
            tuple([step - b.published_step for b in ev_blocks]),
            tuple([step - b.last_used_step for b in ev_blocks]), request_id,
        )

    def get_new_blocks_and_cache(
        self, n: int, request_id: str, block_hashes: list[BlockHash], first_index: int, num_full: int, block_size: int
    ) -> list[KVCacheBlock]:
        """``get_new_blocks(n)`` for table slots first_index.. and key those below ``num_full``.

        One call instead of allocate-then-``cache_full_blocks`` for the common case of a
        request whose earlier blocks are all keyed (the full-attention fast path).
        """
        out, evicted = self._pop_evicting(n, request_id)
        sink = self.sink
        step = sink.step
        cached = self.cached
        # key the new blocks (the evictions above recorded their old steps first)
        num_pub = min(max(num_full - first_index, 0), n)
        if num_pub:
            pub_hashes = block_hashes[first_index:first_index + num_pub]
            num_tokens = first_index * block_size
            for b, h in zip(out, pub_hashes):
                num_tokens += block_size
                b.block_hash = h
                b.hash_num_tokens = num_tokens
                b.published_step = b.last_used_step = step
                if cached.setdefault(h, b) is not b:  # already keyed elsewhere: a duplicate
                    self._insert_key(h, b)
            external = self.external
            if external is not None:
                for b in out[:num_pub]:
                    external.store(self.group_id, b.block_hash, b.hash_num_tokens)
        if evicted is not None:
            sink.events.append(evicted)
        if num_pub:
            sink.publishes += num_pub
            if sink.enabled:
                sink.events.append(BlockPublished(
                    step, request_id, self.group_id, "full", tuple([b.block_id for b in out[:num_pub]]),
                    tuple(pub_hashes), num_tokens))
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on hit blocks (removing free ones from the queue)."""
        step = self.sink.step
        n_removed = 0
        for b in blocks:
            if b.ref_cnt == 0:  # free: unlink from the queue (like popped blocks, keeps stale links)
                p, n = b.prev_free, b.next_free
                p.next_free = n
                n.prev_free = p
                b.ref_cnt = 1
                n_removed += 1
            elif b.is_null:  # its ref_cnt stays 1, so it is never free
                continue
            else:
                b.ref_cnt += 1
            b.last_used_step = step
        self.free_block_queue.num_free_blocks -= n_removed

    def free_blocks(self, ordered: Sequence[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 rejoin the queue (see module doc)."""
        q = self.free_block_queue
        step = self.sink.step
        head = q.head
        last = q.tail.prev_free  # hashed blocks are chained after it, then linked to the tail once
        n_kept = 0  # blocks still in use (counted instead of the freed: the rarer case)
        for b in ordered:
            ref_cnt = b.ref_cnt - 1
            if ref_cnt or b.is_null:  # still in use (the null block's ref_cnt stays 1)
                if ref_cnt:
                    b.ref_cnt = ref_cnt
                n_kept += 1
                continue
            b.ref_cnt = 0
            b.last_used_step = step
            if b.block_hash is None:  # to the head: reused first
                first = head.next_free
                head.next_free = b
                b.prev_free = head
                b.next_free = first
                first.prev_free = b
                if last is head:
                    last = b
            else:  # to the tail: LRU order
                last.next_free = b
                b.prev_free = last
                last = b
        tail = q.tail
        last.next_free = tail
        tail.prev_free = last
        q.num_free_blocks += len(ordered) - n_kept

    # -- publishing ---------------------------------------------------------------
    def _insert_key(self, h: BlockHash, b: KVCacheBlock) -> None:
        v = self.cached.get(h)
        if v is None:
            self.cached[h] = b
        elif type(v) is KVCacheBlock:
            if v is not b:
                self.cached[h] = {v.block_id: v, b.block_id: b}
            else:
                return
        else:
            if b.block_id in v:
                return
            v[b.block_id] = b
        b.published_step = self.step

    def _remove_key(self, h: BlockHash, b: KVCacheBlock) -> None:
        v = self.cached.get(h)
        if v is None:
            return
        if type(v) is KVCacheBlock:
            if v is b:
                del self.cached[h]
        elif v.pop(b.block_id, None) is not None:
            if len(v) == 1:
                self.cached[h] = next(iter(v.values()))

    def _drop_keys(self, b: KVCacheBlock) -> None:
        if b.block_hash is not None:
            self._remove_key(b.block_hash, b)
            b.block_hash = None
            b.hash_num_tokens = 0
        if b.aliases:
            for h, _ in b.aliases:
                self._remove_key(h, b)
        b.aliases = None

    def evict_block_keys(self, b: KVCacheBlock, reason: str, request_id: str | None) -> list[tuple[BlockHash, int]]:
        """Remove every key of ``b`` (it stays allocated); emits one eviction event."""
        keys = b.keys()
        if not keys:
            return keys
        step = self.sink.step
        self._drop_keys(b)
        self.sink.evictions += len(keys)
        self.sink.evictions_by_reason[reason] += len(keys)
        if self.sink.enabled:
            n = len(keys)
            self.sink.events.append(
                BlockEvicted(step, self.group_id, reason, (b.block_id,) * n, tuple(h for h, _ in keys),
                             (step - b.published_step,) * n,
                             (step - b.last_used_step,) * n, request_id)
            )
        return keys

    def cache_full_blocks(
        self,
        request_id: str,
        blocks: list[KVCacheBlock],
        block_hashes: list[BlockHash],
        start: int,
        end: int,
        block_size: int,
        mask: list[bool] | None,
        kind: str,
        boundary_kinds: dict[int, str] | None = None,
    ) -> int:
        """Key blocks[start:end] with their full-block hashes (mask: which to keep).

        A block that already carries a key for a shorter prefix (a partial key) is
        promoted: the old key goes first. Returns the number of keys published.
        """
        step = self.sink.step
        cached = self.cached
        external = self.external
        pub: list[KVCacheBlock] = []
        append = pub.append
        for i in range(start, end):
            b = blocks[i]
            if b.block_hash is not None or b.is_null or (mask is not None and not mask[i - start]):
                # off the fast path: skip null and masked-out blocks and blocks already
                # keyed for this prefix (hits); promote a block keyed at a partial prefix
                if b.is_null or (mask is not None and not mask[i - start]) or b.hash_num_tokens >= (i + 1) * block_size:
                    continue
                self.evict_block_keys(b, EVICT_REPLACED, request_id)  # the old key goes first
            h = block_hashes[i]
            b.block_hash = h
            b.hash_num_tokens = (i + 1) * block_size
            b.published_step = b.last_used_step = step
            if h in cached:
                self._insert_key(h, b)
            else:
                cached[h] = b
            if external is not None:
                external.store(self.group_id, h, b.hash_num_tokens)
            append(b)
        if pub:
            sink = self.sink
            sink.publishes += len(pub)
            if sink.enabled:
                ids = [b.block_id for b in pub]
                hashes = [b.block_hash for b in pub]
                if boundary_kinds:
                    kinds = [boundary_kinds.get(b.hash_num_tokens // block_size - 1, kind) for b in pub]
                    self._emit_publish(request_id, ids, hashes, kinds)
                else:
                    sink.events.append(
                        BlockPublished(step, request_id, self.group_id, kind, tuple(ids), tuple(hashes),
                                       pub[-1].hash_num_tokens)
                    )
        return len(pub)

    def _emit_publish(self, request_id, ids, hashes, kinds) -> None:
        """One event per run of blocks published for the same reason, in order."""
        step = self.sink.step
        start = 0
        for i in range(1, len(kinds) + 1):
            if i == len(kinds) or kinds[i] != kinds[start]:
                nt = self.blocks[ids[i - 1]].hash_num_tokens
                self.sink.events.append(
                    BlockPublished(step, request_id, self.group_id, kinds[start], tuple(ids[start:i]),
                                   tuple(hashes[start:i]), nt)
                )
                start = i

    def cache_partial_block(
        self,
        request_id: str,
        b: KVCacheBlock,
        block_hash: BlockHash,
        num_tokens: int,
        kind: str,
        replace_existing_hashes: bool = False,
    ) -> BlockHash | None:
        """Key ``b`` at a hash boundary inside it (primary if unkeyed, else an alias)."""
        if b.is_null:
            return None
        if replace_existing_hashes:
            self.evict_block_keys(b, EVICT_REPLACED, request_id)
        step = self.sink.step
        if b.block_hash is None:
            b.block_hash = block_hash
            b.hash_num_tokens = num_tokens
            b.published_step = step
        elif b.block_hash == block_hash or (b.aliases and any(h == block_hash for h, _ in b.aliases)):
            return None
        else:
            if b.aliases is None:
                b.aliases = []
            b.aliases.append((block_hash, num_tokens))
        b.last_used_step = step
        self._insert_key(block_hash, b)
        if self.external is not None:
            self.external.store(self.group_id, block_hash, num_tokens)
        self.sink.publishes += 1
        if self.sink.enabled:
            self.sink.events.append(
                BlockPublished(step, request_id, self.group_id, kind, (b.block_id,), (block_hash,), num_tokens)
            )
        return block_hash

    def move_block_hashes(self, src: KVCacheBlock, dst: KVCacheBlock, request_id: str) -> list[tuple[BlockHash, int]]:
        """Re-point every key of ``src`` to ``dst`` (dst must be unkeyed)."""
        assert dst.block_hash is None and not dst.aliases, "move_block_hashes: destination already keyed"
        keys = src.keys()
        if not keys:
            return keys
        published, last_used = src.published_step, src.last_used_step
        step = self.sink.step
        self._drop_keys(src)
        (h0, n0), rest = keys[0], keys[1:]
        dst.block_hash, dst.hash_num_tokens = h0, n0
        dst.aliases = list(rest) if rest else None
        dst.last_used_step = last_used
        for h, _ in keys:
            self._insert_key(h, dst)  # fresh: the copy runs with this step
        if self.sink.enabled:
            n = len(keys)
            hashes = tuple(h for h, _ in keys)
            self.sink.events.append(
                BlockEvicted(step, self.group_id, EVICT_REPLACED, (src.block_id,) * n, hashes,
                             (step - published,) * n, (step - last_used,) * n, request_id)
            )
            self.sink.events.append(
                BlockPublished(step, request_id, self.group_id, "partial_tail", (dst.block_id,) * n, hashes,
                               max(nt for _, nt in keys))
            )
        return keys

    # -- maintenance ----------------------------------------------------------------
    def new_step_starts(self) -> None:
        self.step = self.sink.step

    def reset_prefix_cache(self) -> bool:
        """Drop every key; only allowed when no block is in use."""
        if self.free_block_queue.num_free_blocks != self.num_blocks - 1:
            return False
        for b in self.blocks[1:]:
            if b.block_hash is not None or b.aliases:
                self.evict_block_keys(b, EVICT_RESET, None)
        self.cached.clear()
        self.new_step_starts()
        return True

    def usage(self) -> float:
        return 1.0 - self.free_block_queue.num_free_blocks / (self.num_blocks - 1)
