"""The bookkeeping every per-group manager shares (vLLM's ``SingleTypeKVCacheManager``).

A manager owns its group's block tables (``req_to_blocks``: request id -> table, one
block per ``block_size`` tokens, null blocks where a slot holds nothing) and applies the
group's hit rule, allocation rule, skipped-block rule and retention mask. Hashes come
in ``hash_block_size`` units ("fine"); a group block i is keyed by the fine hash at
``(i + 1) * scale - 1`` (``coarse``).

Invariants kept here:

* ``num_cached_block[r]`` is the number of leading table slots of request r that have
  been considered for keying; slots below it are never keyed again (a slot may still
  take a partial key, see the subclasses);
* tables only grow, except that skipped slots become the null block (their blocks go
  back to the pool, keys kept) and a copy-on-write swaps one slot before the worker
  has seen the table (``partial_hit_reqs``);
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
        self.null_block = pool.null_block
        self.ctx = ctx
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        # req -> (table index, source block): a hit or producer tail that ends inside a
        # block and must be copied before this request writes into that block.
        self.partial_hit_reqs: dict[str, tuple[int, KVCacheBlock]] = {}

    # -- hashes -------------------------------------------------------------------
    def coarse(self, fine: list[BlockHash]) -> list[BlockHash]:
        """This group's block hashes (one per ``block_size`` tokens) from the fine ones."""
        s = self.scale
        return fine if s == 1 else fine[s - 1::s]

    # -- lookup -------------------------------------------------------------------
    def find_longest_cache_hit(
        self, fine: list[BlockHash], max_length: int, alignment: int
    ) -> tuple[list[KVCacheBlock], int]:
        """The longest hit of at most ``max_length`` tokens whose length is a multiple of
        ``alignment``. Returns (the table's blocks for it, null where the group keeps
        nothing; the hit length in tokens). Keys published this step are not hittable."""
        raise NotImplementedError

    # -- allocation ---------------------------------------------------------------
    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens whose blocks this group no longer needs (0: all kept)."""
        return 0

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed: Sequence[KVCacheBlock],
        num_local_computed: int, total_computed: int,
    ) -> int:
        """Free blocks an ``allocate_slots`` of ``num_tokens`` total would take from the
        pool, counting hit blocks that leave the free queue and copy-on-write blocks.
        Changes nothing."""
        num_required = cdiv(num_tokens, self.block_size)
        existing = len(self.req_to_blocks.get(request_id, ())) + len(new_computed)
        skipped = self.get_num_skipped_tokens(total_computed) // self.block_size
        n = max(num_required - max(skipped, existing), 0)
        if new_computed:
            n += sum([b.ref_cnt == 0 and not b.is_null for b in new_computed])
        if new_computed and num_local_computed % self.block_size:
            n += 1  # copy-on-write block for a hit ending mid-block
        if request_id in self.partial_hit_reqs:
            n += 1
        return n

    def add_computed_blocks(self, request_id: str, blocks: list[KVCacheBlock], num_local_computed: int) -> None:
        """Take the hit blocks of a new request (touch) and note a mid-block hit for CoW."""
        table = self.req_to_blocks.setdefault(request_id, [])
        if not blocks:
            self.num_cached_block.setdefault(request_id, len(table))
            return
        assert not table, f"{request_id}: hit blocks for a request that already has blocks"
        self.pool.touch(blocks)
        table.extend(blocks)
        self.num_cached_block[request_id] = len(blocks)
        if num_local_computed % self.block_size:
            idx = self._partial_hit_index(blocks, num_local_computed)
            self.partial_hit_reqs[request_id] = (idx, blocks[idx])
            self.num_cached_block[request_id] = idx  # re-cache from the copy when it fills

    def _partial_hit_index(self, blocks: list[KVCacheBlock], num_local_computed: int) -> int:
        """Table index of the block a mid-block hit ends in."""
        return num_local_computed // self.block_size

    def apply_cow(self, request: Request, new_out: list[KVCacheBlock]) -> None:
        """Redirect a mid-block hit to a private copy (first-prefill branch)."""
        pending = self.partial_hit_reqs.pop(request.request_id, None)
        if pending is None:
            return
        idx, src = pending
        table = self.req_to_blocks[request.request_id]
        if idx >= len(table) or table[idx] is not src:
            return
        self._swap_in_copy(request, idx, src, new_out)

    def _swap_in_copy(self, request: Request, idx: int, src: KVCacheBlock, new_out: list[KVCacheBlock]) -> None:
        rid = request.request_id
        (dst,) = self.pool.get_new_blocks(1, rid)
        self.req_to_blocks[rid][idx] = dst
        # src keeps the table's reference until the copy ran; dst takes one extra.
        dst.ref_cnt += 1
        self.ctx.retained.append((self.pool, src))
        self.ctx.retained.append((self.pool, dst))
        self.ctx.queue_copy(BlockCopy(self.group_id, src.block_id, dst.block_id, rid, COPY_PARTIAL_HIT))
        new_out.append(dst)

    def allocate_external_blocks(
        self, request: Request, num_local: int, num_external: int, new_out: list[KVCacheBlock]
    ) -> None:
        """Blocks for tokens loaded from the external tier (before any local compute)."""
        rid = request.request_id
        table = self.req_to_blocks.setdefault(rid, [])
        total = num_local + num_external
        skipped = self.get_num_skipped_tokens(total) // self.block_size
        while len(table) < min(skipped, cdiv(total, self.block_size)):
            table.append(self.null_block)
            new_out.append(self.null_block)
        bs = self.block_size
        if num_local % bs and len(table) > num_local // bs:
            # the local hit ends inside this block: the load fills the rest of it
            b = table[num_local // bs]
            self.ctx.state_writes.append(
                StateWrite(rid, self.group_id, b.block_id, min((num_local // bs + 1) * bs, total), STATE_EXTERNAL)
            )
        n = cdiv(total, bs) - len(table)
        if n <= 0:
            return
        first = len(table)
        blocks = self.pool.get_new_blocks(n, rid)
        table.extend(blocks)
        new_out.extend(blocks)
        for i, b in enumerate(blocks, start=first):
            self.ctx.state_writes.append(
                StateWrite(rid, self.group_id, b.block_id, min((i + 1) * self.block_size, total), STATE_EXTERNAL)
            )
            self.ctx.note_external_load(rid, self.group_id, b)

    def allocate_new_blocks(
        self, request: Request, num_tokens: int, num_tokens_main: int, step_start: int, new_out: list[KVCacheBlock]
    ) -> None:
        """Grow the table to cover ``num_tokens`` (lookahead included); the new blocks
        are appended to ``new_out`` in table order."""
        rid = request.request_id
        table = self.req_to_blocks.setdefault(rid, [])
        n = cdiv(num_tokens, self.block_size) - len(table)
        if n > 0:
            blocks = self.pool.get_new_blocks(n, rid)
            table.extend(blocks)
            new_out.extend(blocks)

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
            rid, self.req_to_blocks[rid], self.coarse(fine), num_cached, num_full, self.block_size,
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
            self.pool.free_blocks(freed)

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
        self.pool.free_blocks(ordered)
        return ordered
