"""The block pool: null block, one free queue (``blocks``), a hash map per KV cache group.

After vLLM's ``BlockPool``, which the coordinator builds once
(``BlockPool(num_gpu_blocks=kv_cache_config.num_blocks)``) and shares among every
KV cache group's manager:

* block ids are unique across groups; block 0 is the null block, a placeholder in
  block tables that is never cached or freed, so ``num_blocks - 1`` blocks are usable;
* free blocks of every group sit in one intrusive doubly linked queue, so attention
  blocks and Mamba states compete in one LRU. ``get_new_blocks`` pops the head and
  evicts whatever keys the popped block still carries (an ``lru`` eviction);
* ``free_blocks`` drops ``ref_cnt``; at 0 an unhashed block goes to the head (quick
  reuse; several keep their order, as vLLM's ``prepend_n``), a hashed one to the tail
  (LRU order). Requests free in reverse order, so a request's tail blocks are evicted
  before its prefix;
* a hit on a block with ``ref_cnt == 0`` removes it from the queue (``touch``);
* the cache key is (hash, group id). It is kept as one hash map per group
  (``cached[group_id]``, hash -> block), and each block remembers the group it serves
  (``KVCacheBlock.group_id``): all of a block's keys live in that group's map;
* a map may hold duplicates (one key -> several blocks, a dict by block id); a block
  carries one primary key and optional aliases (partial keys at a hash boundary inside
  it), as vLLM's ``cached_block_hashes_by_block``.

Keys are hittable as soon as they are published (vLLM publishes at schedule time; the
forward pass that follows writes the content). The one exception, a Mamba state
published in the current step, is the Mamba manager's rule (``cached_blocks_this_step``).

A pool may also serve a single group (``CacheConfig.num_gpu_blocks`` given per group:
separate pools, as SGLang keeps its Mamba states apart); the code is the same.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, cast

from kvtrace.cache.blocks import FreeKVCacheBlockQueue, KVCacheBlock
from kvtrace.cache.events import (
    EVICT_LRU,
    EVICT_MOVED,
    EVICT_REPLACED,
    EVICT_RESET,
    PUBLISH_MOVED,
    BlockEvicted,
    BlockPublished,
)
from kvtrace.cache.hashing import BlockHash
from kvtrace.cache.sink import EventSink

if TYPE_CHECKING:
    from kvtrace.cache.external import ExternalTier

HashMap = dict[BlockHash, "KVCacheBlock | dict[int, KVCacheBlock]"]


class BlockPool:
    """Blocks, the free queue and the per-group hash maps. Emits events into ``sink``.

    Args:
        num_blocks: blocks in the pool, the null block included (vLLM's ``num_gpu_blocks``).
        sink: the manager's event buffer and counters.
        num_groups: KV cache groups whose keys this pool can hold (one map each).
    """

    def __init__(self, num_blocks: int, sink: EventSink, num_groups: int = 1):
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.null_block.ref_cnt = 1  # never reaches the free queue
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        # one group: every block serves it for good (the hot paths skip the group bookkeeping)
        self._one_group = num_groups == 1
        if self._one_group:
            for b in self.blocks:
                b.group_id = 0
        # One hash map per group; the maps are never rebound (managers keep references).
        self.cached: list[HashMap] = [{} for _ in range(num_groups)]
        # Blocks each group holds (ref_cnt > 0): usage per group, summing to the pool's.
        self.num_used: list[int] = [0] * num_groups
        self.sink = sink
        self.external: ExternalTier | None = None  # write-through second tier

    # -- lookups ------------------------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash, group_id: int) -> KVCacheBlock | None:
        """Any block carrying (``block_hash``, ``group_id``); with duplicates, the first."""
        v = self.cached[group_id].get(block_hash)
        if v is None or type(v) is KVCacheBlock:
            return v
        return next(iter(v.values()))

    def get_cached_blocks(self, block_hash: BlockHash, group_id: int) -> list[KVCacheBlock]:
        """Every block carrying (``block_hash``, ``group_id``)."""
        v = self.cached[group_id].get(block_hash)
        if v is None:
            return []
        return [v] if type(v) is KVCacheBlock else list(v.values())

    def holds_key(self, block_hash: BlockHash, b: KVCacheBlock) -> bool:
        """Whether ``b`` is one of the blocks keyed by ``block_hash`` (in its group)."""
        v = self.cached[b.group_id].get(block_hash) if b.group_id >= 0 else None
        if v is None:
            return False
        return v is b if type(v) is KVCacheBlock else b.block_id in v

    # -- allocation ---------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_new_blocks(self, n: int, group_id: int, request_id: str | None = None) -> list[KVCacheBlock]:
        """Pop ``n`` blocks from the queue head for ``group_id``; evict the keys they still carry."""
        out, evicted = self._pop_evicting(n, group_id, request_id)
        if evicted:
            self.sink.events.extend(evicted)
        return out

    def _pop_evicting(
        self, n: int, group_id: int, request_id: str | None
    ) -> tuple[list[KVCacheBlock], list[BlockEvicted] | None]:
        """Pop ``n`` blocks (ref_cnt 1, now serving ``group_id``), drop their keys and
        count those as LRU evictions.

        Returns the blocks and, when events are on, the eviction events (one per group
        whose keys went), built before the caller re-keys the blocks (they report the
        old publish and use steps).
        """
        q = self.free_block_queue
        if n > q.num_free_blocks:
            raise ValueError(f"group {group_id}: need {n} blocks, {q.num_free_blocks} free")
        out: list[KVCacheBlock] = []
        append = out.append
        sink = self.sink
        step = sink.step
        record = sink.enabled
        # Per evicted key, in eviction order: the key (they count the evictions) and, with
        # events on, the event's other columns, collected here (cheaper than one pass per
        # column over the blocks afterwards); a block with aliases holds several keys.
        ev_hashes: list[BlockHash] = []
        ev_ids: list[int] = []
        ev_ages: list[int] = []  # steps since the key was published
        ev_idle: list[int] = []  # steps since its block was last used
        ev_groups: list[int] | None = None  # the group each key belonged to (several groups only)
        b = q.head
        if self._one_group:  # every block serves group 0 for good: no group bookkeeping
            cached = self.cached[0]
            for _ in range(n):
                b = b.next_free
                b.ref_cnt = 1
                append(b)
                h = b.block_hash
                if h is not None:
                    v = cached.pop(h, None)
                    if v is b and b.aliases is None:  # the common case: b is the key's only holder
                        b.block_hash = None
                        ev_hashes.append(h)
                        if record:
                            ev_ids.append(b.block_id)
                            ev_ages.append(step - b.published_step)
                            ev_idle.append(step - b.last_used_step)
                    else:
                        if v is not b and v is not None:
                            cached[h] = v  # a duplicates map: put it back, remove b from it below
                        for kh, _nt in b.keys():
                            ev_hashes.append(kh)
                            if record:
                                ev_ids.append(b.block_id)
                                ev_ages.append(step - b.published_step)
                                ev_idle.append(step - b.last_used_step)
                        self._drop_keys(b)  # (its primary key may be popped already: then a no-op for it)
        else:
            maps = self.cached
            ev_groups = []
            for _ in range(n):
                b = b.next_free
                b.ref_cnt = 1
                append(b)
                h = b.block_hash
                if h is not None:
                    g = b.group_id
                    cached = maps[g]
                    v = cached.pop(h, None)
                    if v is b and b.aliases is None:
                        b.block_hash = None
                        ev_hashes.append(h)
                        ev_groups.append(g)
                        if record:
                            ev_ids.append(b.block_id)
                            ev_ages.append(step - b.published_step)
                            ev_idle.append(step - b.last_used_step)
                    else:
                        if v is not b and v is not None:
                            cached[h] = v
                        for kh, _nt in b.keys():
                            ev_hashes.append(kh)
                            ev_groups.append(g)
                            if record:
                                ev_ids.append(b.block_id)
                                ev_ages.append(step - b.published_step)
                                ev_idle.append(step - b.last_used_step)
                        self._drop_keys(b)
                b.group_id = group_id
        # unlink the popped run in one go (popped blocks keep stale links; unused)
        nxt = b.next_free
        q.head.next_free = nxt
        nxt.prev_free = q.head
        q.num_free_blocks -= n
        self.num_used[group_id] += n
        if not ev_hashes:
            return out, None
        sink.evictions += len(ev_hashes)
        sink.evictions_by_reason[EVICT_LRU] += len(ev_hashes)
        if not record:
            return out, None
        return out, self._eviction_events((ev_ids, ev_hashes, ev_ages, ev_idle), ev_groups, request_id)

    def _eviction_events(self, columns: tuple[list[int], list[BlockHash], list[int], list[int]],
                         groups: list[int] | None, request_id: str | None) -> list[BlockEvicted]:
        """One LRU eviction event per group whose keys were evicted (in order of first
        eviction), from the columns ``_pop_evicting`` collected (block ids, hashes, ages,
        idle); ``groups[i]`` is the group of key i (None: all 0)."""
        step = self.sink.step
        ids, hashes, ages, idle = columns
        if groups is None or groups.count(groups[0]) == len(groups):
            return [BlockEvicted(step, groups[0] if groups else 0, EVICT_LRU, tuple(ids), tuple(hashes), tuple(ages),
                                 tuple(idle), request_id)]
        by_group: dict[int, list[int]] = {}  # group -> the indices of its keys
        for i, g in enumerate(groups):
            by_group.setdefault(g, []).append(i)
        return [
            BlockEvicted(step, g, EVICT_LRU, tuple([ids[i] for i in idx]), tuple([hashes[i] for i in idx]),
                         tuple([ages[i] for i in idx]), tuple([idle[i] for i in idx]), request_id)
            for g, idx in by_group.items()
        ]

    def get_new_blocks_and_cache(
        self, n: int, group_id: int, request_id: str, block_hashes: Sequence[BlockHash], first_index: int,
        num_full: int, block_size: int,
    ) -> list[KVCacheBlock]:
        """``get_new_blocks(n)`` for table slots first_index.. and key those below ``num_full``.

        One call instead of allocate-then-``cache_full_blocks`` for the common case of a
        request whose earlier blocks are all keyed (the full-attention fast path).
        """
        out, evicted = self._pop_evicting(n, group_id, request_id)
        sink = self.sink
        step = sink.step
        cached = self.cached[group_id]
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
        if evicted:
            sink.events.extend(evicted)
        if num_pub:
            sink.publishes += num_pub
            if sink.enabled:
                sink.events.append(BlockPublished(
                    step, request_id, group_id, "full", tuple([b.block_id for b in out[:num_pub]]),
                    tuple(pub_hashes), num_tokens))
            external = self.external
            if external is not None:  # (after the publish: what the tier drops for room follows it)
                external.store_all(group_id, [(h, b.hash_num_tokens) for b, h in zip(out, pub_hashes)])
        return out

    def touch(self, blocks: Iterable[KVCacheBlock], group_id: int) -> None:
        """Take a reference on ``group_id``'s hit blocks (removing free ones from the queue)."""
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
        self.num_used[group_id] += n_removed

    def free_blocks(self, ordered: Sequence[KVCacheBlock], group_id: int | None = None) -> None:
        """Drop one reference each; blocks reaching 0 rejoin the queue (see module doc).

        ``group_id``: the group every block serves, when the caller knows it (a
        manager's own blocks); None reads it from each block (copy endpoints).
        """
        q = self.free_block_queue
        step = self.sink.step
        hp = q.head  # unhashed blocks go after it, in the order freed (vLLM's prepend_n)
        last = q.tail.prev_free  # hashed blocks are chained after it, then linked to the tail once
        per_block = group_id is None and not self._one_group
        num_used = self.num_used
        n_kept = 0  # blocks still in use (counted instead of the freed: the rarer case)
        for b in ordered:
            if b.ref_cnt != 1 or b.is_null:  # still in use (the null block's ref_cnt stays 1)
                if not b.is_null:
                    b.ref_cnt -= 1
                n_kept += 1
                continue
            b.ref_cnt = 0
            b.last_used_step = step
            if per_block:  # (False on the hot paths: a manager frees its own group's blocks)
                num_used[b.group_id] -= 1
            if b.block_hash is None:  # to the head: reused first
                nxt = hp.next_free
                hp.next_free = b
                b.prev_free = hp
                b.next_free = nxt
                nxt.prev_free = b
                if last is hp:
                    last = b
                hp = b
            else:  # to the tail: LRU order
                last.next_free = b
                b.prev_free = last
                last = b
        tail = q.tail
        last.next_free = tail
        tail.prev_free = last
        n_freed = len(ordered) - n_kept
        q.num_free_blocks += n_freed
        if not per_block:
            num_used[0 if group_id is None else group_id] -= n_freed

    # -- publishing ---------------------------------------------------------------
    def _insert_key(self, h: BlockHash, b: KVCacheBlock) -> None:
        cached = self.cached[b.group_id]
        v = cached.get(h)
        if v is None:
            cached[h] = b
        elif type(v) is KVCacheBlock:
            if v is not b:
                cached[h] = {v.block_id: v, b.block_id: b}
            else:
                return
        else:
            if b.block_id in v:
                return
            v[b.block_id] = b
        b.published_step = self.sink.step

    def _remove_key(self, h: BlockHash, b: KVCacheBlock) -> None:
        cached = self.cached[b.group_id]
        v = cached.get(h)
        if v is None:
            return
        if type(v) is KVCacheBlock:
            if v is b:
                del cached[h]
        elif v.pop(b.block_id, None) is not None and len(v) == 1:
            cached[h] = next(iter(v.values()))

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
                BlockEvicted(step, b.group_id, reason, (b.block_id,) * n, tuple(h for h, _ in keys),
                             (step - b.published_step,) * n,
                             (step - b.last_used_step,) * n, request_id)
            )
        return keys

    def cache_full_blocks(
        self,
        group_id: int,
        request_id: str,
        blocks: list[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        start: int,
        end: int,
        block_size: int,
        mask: list[bool] | None,
        kind: str,
        boundary_kinds: dict[int, str] | None = None,
    ) -> int:
        """Key blocks[start:end] of ``group_id``'s table with their full-block hashes
        (mask: which to keep; null blocks are skipped).

        A block that already carries a key for a shorter prefix (a partial key) is
        promoted: its old keys go first (``replaced``). Returns the number of keys
        published.
        """
        step = self.sink.step
        cached = self.cached[group_id]
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
            append(b)
        if pub:
            sink = self.sink
            sink.publishes += len(pub)
            if sink.enabled:
                ids = [b.block_id for b in pub]
                hashes = cast("list[BlockHash]", [b.block_hash for b in pub])  # all just keyed
                if boundary_kinds:
                    kinds = [boundary_kinds.get(b.hash_num_tokens // block_size - 1, kind) for b in pub]
                    self._emit_publish(group_id, request_id, ids, hashes, kinds)
                else:
                    sink.events.append(
                        BlockPublished(step, request_id, group_id, kind, tuple(ids), tuple(hashes),
                                       pub[-1].hash_num_tokens)
                    )
            if external is not None:  # (after the publish: what the tier drops for room follows it)
                external.store_all(group_id, [(cast("BlockHash", b.block_hash), b.hash_num_tokens) for b in pub])
        return len(pub)

    def _emit_publish(self, group_id, request_id, ids, hashes, kinds) -> None:
        """One event per run of blocks published for the same reason, in order."""
        step = self.sink.step
        start = 0
        for i in range(1, len(kinds) + 1):
            if i == len(kinds) or kinds[i] != kinds[start]:
                nt = self.blocks[ids[i - 1]].hash_num_tokens
                self.sink.events.append(
                    BlockPublished(step, request_id, group_id, kinds[start], tuple(ids[start:i]),
                                   tuple(hashes[start:i]), nt)
                )
                start = i

    def cache_partial_block(
        self,
        group_id: int,
        request_id: str,
        b: KVCacheBlock,
        block_hash: BlockHash,
        num_tokens: int,
        kind: str,
        replace_existing_hashes: bool = False,
    ) -> BlockHash | None:
        """Key ``b`` at the hash boundary ``num_tokens`` inside it (vLLM's ``cache_partial_block``).

        The key becomes the block's primary key if it has none, else an alias. Its
        existing keys go first (``replaced``) when ``replace_existing_hashes`` (its
        content was replaced) or when its primary key stands for a shorter prefix (a
        promotion). Publishes nothing when the block already carries the key.

        Returns the key, or None for the null block.
        """
        if b.is_null:
            return None
        already = b.block_hash == block_hash or (b.aliases is not None and self.holds_key(block_hash, b))
        if replace_existing_hashes:
            self.evict_block_keys(b, EVICT_REPLACED, request_id)
            already = False
        elif not already and b.block_hash is not None and b.hash_num_tokens < num_tokens:
            self.evict_block_keys(b, EVICT_REPLACED, request_id)
        if already:
            return block_hash
        step = self.sink.step
        if b.block_hash is None:
            b.block_hash = block_hash
            b.hash_num_tokens = num_tokens
        else:
            if b.aliases is None:
                b.aliases = []
            b.aliases.append((block_hash, num_tokens))
        b.last_used_step = step
        self._insert_key(block_hash, b)
        b.published_step = step
        self.sink.publishes += 1
        if self.sink.enabled:
            self.sink.events.append(
                BlockPublished(step, request_id, group_id, kind, (b.block_id,), (block_hash,), num_tokens)
            )
        if self.external is not None:  # (after the publish: what the tier drops for room follows it)
            self.external.store(group_id, block_hash, num_tokens)
        return block_hash

    def move_block_hashes(self, src: KVCacheBlock, dst: KVCacheBlock, request_id: str) -> list[tuple[BlockHash, int]]:
        """Re-point every key of ``src`` to ``dst`` (dst must be unkeyed, of the same group).

        vLLM emits no KV event for a move (the entries stay live); kvtrace records it as
        a ``moved`` eviction of ``src`` and a ``moved`` publish on ``dst``, so that a span
        shows where the entry went. Neither counts as a publish or an eviction.
        """
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
            self._insert_key(h, dst)
        if self.sink.enabled:
            n = len(keys)
            hashes = tuple(h for h, _ in keys)
            self.sink.events.append(
                BlockEvicted(step, src.group_id, EVICT_MOVED, (src.block_id,) * n, hashes,
                             (step - published,) * n, (step - last_used,) * n, request_id)
            )
            self.sink.events.append(
                BlockPublished(step, request_id, dst.group_id, PUBLISH_MOVED, (dst.block_id,) * n, hashes,
                               max(nt for _, nt in keys))
            )
        return keys

    # -- maintenance ----------------------------------------------------------------
    def is_idle(self) -> bool:
        """Whether no block is in use (the null block aside)."""
        return self.free_block_queue.num_free_blocks == self.num_blocks - 1

    def reset_prefix_cache(self) -> bool:
        """Drop every key; only allowed when no block is in use."""
        if not self.is_idle():
            return False
        for b in self.blocks[1:]:
            if b.block_hash is not None or b.aliases:
                self.evict_block_keys(b, EVICT_RESET, None)
        for cached in self.cached:
            cached.clear()
        return True

    def usage(self) -> float:
        """Blocks in use / usable blocks (vLLM's ``get_usage``), 0..1."""
        return 1.0 - self.free_block_queue.num_free_blocks / (self.num_blocks - 1)

    def group_usage(self, group_id: int) -> float:
        """The share of the pool's usable blocks that ``group_id`` holds; the groups'
        shares sum to ``usage()``."""
        return self.num_used[group_id] / (self.num_blocks - 1)
