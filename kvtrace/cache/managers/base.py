"""The bookkeeping every per-group manager shares (vLLM's ``SingleTypeKVCacheManager``).

A manager owns its group's block tables (``req_to_blocks``: request id -> table, one
block per ``block_size`` tokens, null blocks where a slot holds nothing) and applies the
group's hit rule, allocation rule, skipped-block rule and retention mask. Its blocks
come from the block pool it shares with the other groups (``pool``); its keys live in
that pool's map for its group (``cached``). Hashes come in ``hash_block_size`` units
("fine"); a group block i is keyed by the fine hash at ``(i + 1) * scale - 1``
(``coarse``).

Invariants kept here:

* ``num_cached_block[r]`` is the number of leading table slots of request r that have
  been considered for keying; slots below it are never keyed again (a slot may still
  take a partial key, see the subclasses). A request is in it from its first
  allocation with hit blocks or its first keyed block on: vLLM's "running" test;
* tables only grow, except that skipped slots become the null block (their blocks go
  back to the pool, keys kept) and a copy-on-write swaps one slot before the worker
  has seen the table (``partial_hit_reqs``);
* hit blocks in slots the request already skips are neither taken nor touched: their
  slots are null (vLLM pads them);
* ``free`` returns a request's blocks tail first, so its tail is evicted before its
  prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtrace.cache.blocks import KVCacheBlock
from kvtrace.cache.config import KVCacheSpec
from kvtrace.cache.events import COPY_PARTIAL_HIT, PUBLISH_BOUNDARY, PUBLISH_FULL
from kvtrace.cache.hashing import BlockHash
from kvtrace.cache.plans import STATE_EXTERNAL, BlockCopy, StateWrite
from kvtrace.numeric import cdiv

if TYPE_CHECKING:
    from kvtrace.cache.block_pool import BlockPool
    from kvtrace.cache.context import CacheContext
    from kvtrace.cache.request import Request


class SingleTypeManager:
    """Common bookkeeping; subclasses define the hit, skip and retention rules."""

    is_mamba = False

    def __init__(self, group_id: int, spec: KVCacheSpec, pool: BlockPool, ctx: CacheContext):
        self.group_id = group_id
        self.spec = spec
        self.block_size = spec.block_size
        self.scale = spec.block_size // ctx.hash_block_size
        self.pool = pool
        self.cached = pool.cached[group_id]  # this group's hash map in the pool
        self.null_block = pool.null_block
        self.ctx = ctx
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        # req -> (table index, source block): a hit or producer tail that ends inside a
        # block and must be copied before this request writes into that block.
        self.partial_hit_reqs: dict[str, tuple[int, KVCacheBlock]] = {}
        # vLLM's max_admission_blocks_per_request: the most blocks the full-sequence admission
        # gate reserves per request. None (no cap) unless the group recycles blocks and the
        # coordinator was given the scheduler's limits (set_admission_limits).
        self.max_admission_blocks: int | None = None
        # A mid-block hit on a block keyed this step waits a step. The coordinator sets it
        # where no Mamba group is (a kvtrace-only layout): with one, vLLM 0.33 allocates such a
        # hit (conformance), its Mamba groups keeping their own same-step rule.
        self.copy_waits_for_writes = False

    # -- hashes -------------------------------------------------------------------
    def coarse(self, fine: Sequence[BlockHash]) -> Sequence[BlockHash]:
        """This group's block hashes (one per ``block_size`` tokens) from the fine ones."""
        s = self.scale
        return fine if s == 1 else fine[s - 1::s]

    # -- lookup -------------------------------------------------------------------
    def find_longest_cache_hit(
        self, fine: Sequence[BlockHash], max_length: int, alignment: int
    ) -> tuple[list[KVCacheBlock], int]:
        """The longest hit of at most ``max_length`` tokens whose length is a multiple of
        ``alignment``. Returns (the table's blocks for it, null where the group keeps
        nothing; the hit length in tokens)."""
        raise NotImplementedError

    # -- allocation ---------------------------------------------------------------
    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens whose blocks this group no longer needs (0: all kept)."""
        return 0

    def admission_cap(self, max_model_len: int, max_in_flight_tokens: int) -> int | None:
        """vLLM's ``KVCacheSpec.max_admission_blocks_per_request`` for groups that recycle
        blocks (None: the group holds every block to the end, as full attention does)."""
        return None

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed: Sequence[KVCacheBlock],
        total_computed: int, num_local_computed: int, num_tokens_main: int, prefill_end: int,
        apply_admission_cap: bool = False,
    ) -> int:
        """Free blocks an ``allocate_slots`` growing the table to ``num_tokens`` would take
        from the pool, counting hit blocks that leave the free queue and a copy-on-write
        block (vLLM's rule; it may be negative where a table is over-allocated).
        Changes nothing. ``apply_admission_cap``: the full-sequence admission gate's count
        (vLLM's), the requirement clamped by ``max_admission_blocks``."""
        bs = self.block_size
        num_required = cdiv(num_tokens, bs)
        if apply_admission_cap and self.max_admission_blocks is not None:
            num_required = min(num_required, self.max_admission_blocks)
        table = self.req_to_blocks.get(request_id, ())
        if request_id in self.num_cached_block:  # running: no new hits
            return max(num_required - len(table), 0)
        num_skipped = self.get_num_skipped_tokens(total_computed) // bs
        n = max(num_required - max(num_skipped, len(new_computed) + len(table)), 0)
        if new_computed:
            skipped_hits = max(0, num_skipped - len(table))  # hit blocks in skipped slots are not taken
            n += sum([b.ref_cnt == 0 and not b.is_null for b in new_computed[skipped_hits:]])
            if num_local_computed % bs:
                if self.copy_waits_for_writes and new_computed[-1].published_step == self.pool.sink.step:
                    # The same-step rule (Mamba's): the copy would run before this step writes
                    # the block it copies (a GPU runs a step's copies before its forward pass),
                    # so the hit waits a step, refused as a pool too small would be.
                    return self.pool.num_blocks + 1
                n += 1  # copy-on-write block for a hit ending mid-block
        return n

    def add_computed_blocks(self, request_id: str, blocks: Sequence[KVCacheBlock], num_local_computed: int,
                            num_external: int) -> None:
        """Take the hit blocks of a new request (touch) and note a mid-block hit for CoW.

        Hit blocks in slots the request already skips (after ``num_local_computed +
        num_external`` tokens) are not taken: their slots are null.
        """
        table = self.req_to_blocks.setdefault(request_id, [])
        assert not table, f"{request_id}: hit blocks for a request that already has blocks"
        num_skipped = self.get_num_skipped_tokens(num_local_computed + num_external) // self.block_size
        if num_skipped > 0:
            blocks = blocks[num_skipped:]
            table.extend([self.null_block] * num_skipped)
        if blocks:
            self.pool.touch(blocks, self.group_id)
            table.extend(blocks)
        self.num_cached_block[request_id] = len(table)
        if blocks and num_local_computed % self.block_size:
            idx = num_local_computed // self.block_size
            self.partial_hit_reqs[request_id] = (idx, blocks[-1])
            self.num_cached_block[request_id] = idx  # re-cache from the copy when it fills

    def _swap_in_copy(self, request_id: str, idx: int, src: KVCacheBlock, dst: KVCacheBlock) -> None:
        """Redirect a mid-block hit to the private copy ``dst`` (vLLM's ``_apply_cow``)."""
        table = self.req_to_blocks[request_id]
        assert table[idx] is src and not src.is_null
        table[idx] = dst
        # src keeps its hit reference until the copy ran; dst takes one extra.
        dst.ref_cnt += 1
        self.ctx.retained.append((self.pool, src))
        self.ctx.retained.append((self.pool, dst))
        self.ctx.queue_copy(BlockCopy(self.group_id, src.block_id, dst.block_id, request_id, COPY_PARTIAL_HIT))

    def allocate_external_blocks(self, request: Request, num_local: int, num_external: int) -> None:
        """Blocks for tokens loaded from the external tier (before any local compute),
        after every group has taken its hit blocks. Queues their ``external`` writes."""
        rid = request.request_id
        table = self.req_to_blocks.setdefault(rid, [])
        total = num_local + num_external
        skipped = self.get_num_skipped_tokens(total)
        if skipped > 0:
            num_external = min(total - skipped, num_external)
        if num_external <= 0:
            return
        bs = self.block_size
        n = cdiv(total, bs) - len(table)
        if n <= 0:
            return
        first = len(table)
        blocks = self.pool.get_new_blocks(n, self.group_id, rid)
        table.extend(blocks)
        for i, b in enumerate(blocks, start=first):
            self.ctx.state_writes.append(
                StateWrite(rid, self.group_id, b.block_id, min((i + 1) * bs, total), STATE_EXTERNAL)
            )
            self.ctx.note_external_load(rid, self.group_id, b)

    def queue_external_tail_write(self, request: Request, num_local: int, num_external: int) -> None:
        """When the local hit ends inside a block that the external load continues, the
        load fills the rest of that block (the copy-on-write block by now, if any)."""
        bs = self.block_size
        total = num_local + num_external
        table = self.req_to_blocks.get(request.request_id, ())
        if num_local % bs and total > num_local and len(table) > num_local // bs:
            b = table[num_local // bs]
            if not b.is_null:
                self.ctx.state_writes.append(StateWrite(
                    request.request_id, self.group_id, b.block_id, min((num_local // bs + 1) * bs, total),
                    STATE_EXTERNAL))

    def allocate_new_blocks(self, request: Request, num_tokens: int, num_tokens_main: int,
                            step_start: int) -> list[KVCacheBlock]:
        """Grow the table to cover ``num_tokens`` (lookahead included), after a pending
        copy-on-write. Returns the blocks handed out this call in table order: the copy
        block first (it replaced a slot of a new request), then the appended ones."""
        rid = request.request_id
        table = self.req_to_blocks.setdefault(rid, [])
        out: list[KVCacheBlock] = []
        pending = self.partial_hit_reqs.pop(rid, None) if self.partial_hit_reqs else None
        if pending is not None:
            idx, src = pending
            (dst,) = self.pool.get_new_blocks(1, self.group_id, rid)
            self._swap_in_copy(rid, idx, src, dst)
            out.append(dst)
        n = cdiv(num_tokens, self.block_size) - len(table)
        if n > 0:
            blocks = self.pool.get_new_blocks(n, self.group_id, rid)
            table.extend(blocks)
            out.extend(blocks)
        return out

    # -- caching ------------------------------------------------------------------
    def reachable_mask(self, request: Request, start: int, end: int) -> tuple[list[bool] | None, set[int]]:
        """Which of table slots [start, end) to key (None: all), and the kept slots owed
        to a reachable boundary (published as ``boundary``)."""
        return None, set()

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Key the request's full blocks up to ``num_tokens`` (prompt and output tokens
        already scheduled), under the group's retention mask."""
        rid = request.request_id
        num_cached = self.num_cached_block.get(rid, 0)
        num_full = num_tokens // self.block_size
        if num_cached >= num_full:
            return
        mask, owed = self.reachable_mask(request, num_cached, num_full)
        fine = request.block_hashes
        self.pool.cache_full_blocks(
            self.group_id, rid, self.req_to_blocks[rid], self.coarse(fine), num_cached, num_full, self.block_size,
            mask, PUBLISH_FULL, dict.fromkeys(owed, PUBLISH_BOUNDARY) if owed else None,
        )
        self.num_cached_block[rid] = num_full

    def reachable_boundaries(self, request: Request) -> list[int]:
        """Token positions a later request can resume from: the prompt's replay boundary
        (``num_prompt_tokens - 1``) and, when pinned, the shared-prefix junction."""
        out = [request.num_prompt_tokens - 1]
        if self.ctx.pinning and request.shared_prefix_boundary:
            out.append(request.shared_prefix_boundary)
        return out

    # -- release ------------------------------------------------------------------
    def _remove_blocks_in_range(self, request_id: str, first: int, last: int) -> None:
        """Free table slots [first, last) back to front, stopping at a null slot (slots
        below it were freed before), and null them."""
        table = self.req_to_blocks.get(request_id)
        if not table or first >= last:
            return
        last = min(last, len(table))
        freed = []
        null = self.null_block
        for i in range(last - 1, first - 1, -1):
            b = table[i]
            if b is null:
                break
            freed.append(b)
            table[i] = null
        if freed:
            self.pool.free_blocks(freed, self.group_id)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks of skipped slots (they keep their keys) and null the slots."""
        skipped = self.get_num_skipped_tokens(num_computed_tokens)
        if skipped <= 0:
            return
        self._remove_blocks_in_range(request_id, 0, skipped // self.block_size)

    def free(self, request_id: str) -> list[KVCacheBlock]:
        """Return the request's blocks to the pool, tail first; returns them in that order."""
        table = self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        self.partial_hit_reqs.pop(request_id, None)
        if not table:
            return []
        null = self.null_block
        ordered = [b for b in reversed(table) if b is not null]
        self.pool.free_blocks(ordered, self.group_id)
        return ordered

    def new_step_starts(self) -> None:
        """A new scheduler step begins (Mamba forgets the states it published)."""
