"""The hybrid coordinator (vLLM's ``KVCacheCoordinator``): runs every KV cache group's
manager on one request, as one.

* Lookup: the groups' hits are taken to a fixed point. Each group's hit is capped by the
  current length, full attention first (its hits are downward closed, so it bounds the
  others cheaply), and the loop repeats until no group shrinks the length. The result is
  (blocks per group, hit length L, uncached common prefix): the longest prefix that the
  attention groups hold minus L, the part a sparse group lacks. ``L + uncached`` is the
  shared-prefix boundary (the Marconi junction).
* Allocation: the groups are asked in order whether the request fits, then take its hit
  blocks, apply copy-on-write, load external blocks, grow their tables and key their
  full blocks. Either every group allocates or none does.
* External tier: the longest extension of the local hit that the external tier holds for
  every group.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtrace.cache.block_pool import BlockPool
from kvtrace.cache.blocks import KVCacheBlock
from kvtrace.cache.config import CacheConfig, FullAttentionSpec, MambaSpec
from kvtrace.cache.context import CacheContext
from kvtrace.cache.external import ExternalTier
from kvtrace.cache.hashing import BlockHash
from kvtrace.cache.managers import (
    MANAGER_FOR_SPEC,
    FullAttentionManager,
    MambaManager,
    SingleTypeManager,
    SlidingWindowManager,
)
from kvtrace.cache.request import Request
from kvtrace.numeric import cdiv

BlocksPerGroup = list[list[KVCacheBlock]]


class KVCacheCoordinator:
    def __init__(self, config: CacheConfig, pools: list[BlockPool], ctx: CacheContext,
                 external: ExternalTier | None):
        self.config = config
        self.ctx = ctx
        self.external = external
        self.managers: list[SingleTypeManager] = [
            MANAGER_FOR_SPEC[type(spec)](g, spec, pools[g], ctx) for g, spec in enumerate(config.groups)
        ]
        self.num_groups = len(self.managers)
        self.lookup_order = sorted(
            range(self.num_groups), key=lambda g: 0 if isinstance(config.groups[g], FullAttentionSpec) else 1
        )
        self.attention_groups = [g for g, s in enumerate(config.groups) if isinstance(s, FullAttentionSpec)]
        self.mamba = [m for m in self.managers if isinstance(m, MambaManager)]
        self.skipping = [m for m in self.managers if not isinstance(m, FullAttentionManager)]
        # Hits land on hash units with partial hits on, else on the scheduler block size.
        self.hit_alignment = config.hash_block_size if config.enable_partial_hits else ctx.scheduler_block_size

    # -- lookup -------------------------------------------------------------------
    def find_longest_cache_hit(
        self, fine: list[BlockHash], max_length: int
    ) -> tuple[BlocksPerGroup, int, int, tuple[int, ...]]:
        """The fixed point over the groups for a request hashed as ``fine``.

        Returns (hit blocks per group, hit length L, uncached common prefix, each
        group's first, uncapped hit). Hits are at most ``max_length`` tokens and a
        multiple of ``hit_alignment``.
        """
        align = self.hit_alignment
        mgrs = self.managers
        if self.num_groups == 1:
            blocks, hit = mgrs[0].find_longest_cache_hit(fine, max_length, align)
            return [blocks], hit, 0, (hit,)
        length = max_length
        results: BlocksPerGroup = [[] for _ in mgrs]
        first: list[int | None] = [None] * self.num_groups
        while True:
            reduced = False
            for g in self.lookup_order:
                blocks, hit = mgrs[g].find_longest_cache_hit(fine, length, align)
                results[g] = blocks
                if first[g] is None:
                    first[g] = hit
                if hit < length:
                    length = hit
                    reduced = True
            if not reduced or length == 0:
                break
        if length == 0:
            results = [[] for _ in mgrs]
        else:
            for g in self.attention_groups:
                del results[g][cdiv(length, mgrs[g].block_size):]
        firsts = tuple(h or 0 for h in first)
        longest = max((firsts[g] for g in self.attention_groups), default=length)
        sbs = self.ctx.scheduler_block_size
        longest = longest // sbs * sbs
        return results, length, max(longest - length, 0), firsts

    # -- allocation ---------------------------------------------------------------
    def can_allocate(self, request_id: str, num_tokens_main: int, num_tokens_slots: int,
                     hits: Sequence[Sequence[KVCacheBlock]],
                     num_local: int, total_computed: int, has_external: bool) -> bool:
        """Whether every group's pool has the blocks this allocation needs (Mamba groups
        ignore lookahead; an external load takes one more state block)."""
        for g, m in enumerate(self.managers):
            is_mamba = m.is_mamba
            need = m.get_num_blocks_to_allocate(
                request_id, num_tokens_main if is_mamba else num_tokens_slots, hits[g], num_local, total_computed
            )
            if has_external and is_mamba:
                need += 1
            if need > m.pool.free_block_queue.num_free_blocks:
                return False
        return True

    def allocate(self, request: Request, hits: tuple[list[KVCacheBlock], ...] | None, num_local: int,
                 num_external: int, num_tokens_main: int, num_tokens_slots: int, num_new_tokens: int,
                 enable_caching: bool) -> BlocksPerGroup:
        """Take ``hits`` (a new request's), apply copy-on-write, load ``num_external``
        tokens' blocks, grow every table to ``num_tokens_slots`` and key the full blocks.
        Returns the blocks appended to each table this step, in table order. The caller
        has checked ``can_allocate``."""
        rid = request.request_id
        mgrs = self.managers
        total_computed = num_local + num_external
        if hits is not None:
            for g, m in enumerate(mgrs):
                m.add_computed_blocks(rid, hits[g], num_local)
        new_out: BlocksPerGroup = [[] for _ in mgrs]
        for g, m in enumerate(mgrs):
            if m.partial_hit_reqs:
                m.apply_cow(request, new_out[g])
        if num_external:
            for g, m in enumerate(mgrs):
                m.allocate_external_blocks(request, num_local, num_external, new_out[g])
            self._touch_external(request, num_local, total_computed)
        for g, m in enumerate(mgrs):
            m.allocate_new_blocks(request, num_tokens_slots, num_tokens_main, total_computed, new_out[g])
        if enable_caching:
            num_to_cache = min(num_tokens_main, request.num_tokens)
            for m in mgrs:
                m.cache_blocks(request, num_to_cache)
        for mm in self.mamba:
            if num_new_tokens > 0:
                mm.queue_running_state(request, num_tokens_main)
            mm.mark_handed_out(rid)
        return new_out

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for m in self.skipping:
            m.remove_skipped_blocks(request_id, num_computed_tokens)

    # -- external tier ------------------------------------------------------------
    def external_hit_tokens(self, fine: list[BlockHash], num_local_hit_tokens: int, max_length: int) -> int:
        """Tokens beyond the local hit that the external tier holds for every group."""
        ext = self.external
        assert ext is not None
        unit = self.hit_alignment
        # contiguous full blocks present for attention groups, from the local hit on
        runs = {}
        for g in self.attention_groups:
            m = self.managers[g]
            coarse = m.coarse(fine)
            i = num_local_hit_tokens // m.block_size
            while i < len(coarse) and (g, coarse[i]) in ext:
                i += 1
            runs[g] = i
        length = max_length // unit * unit
        while length > num_local_hit_tokens:
            if all(self._external_has(g, fine, length, runs) for g in range(self.num_groups)):
                return length - num_local_hit_tokens
            length -= unit
        return 0

    def _external_has(self, g: int, fine: list[BlockHash], length: int, runs: dict[int, int]) -> bool:
        m = self.managers[g]
        bs, hbs, ext = m.block_size, self.config.hash_block_size, self.external
        assert ext is not None
        spec = self.config.groups[g]
        if isinstance(spec, FullAttentionSpec):
            if length // bs > runs[g]:
                return False
            return length % bs == 0 or (g, fine[length // hbs - 1]) in ext
        if isinstance(spec, MambaSpec):
            if length % bs and not self.config.enable_partial_hits:
                return False
            return (g, fine[length // hbs - 1]) in ext
        if length % bs:
            return False
        assert isinstance(m, SlidingWindowManager)
        coarse = m.coarse(fine)
        end = length // bs
        return all((g, coarse[i]) in ext for i in range(max(0, end - m.need), end))

    def _touch_external(self, request: Request, start: int, end: int) -> None:
        ext = self.external
        if ext is None:
            return
        fine = request.block_hashes
        hbs = self.config.hash_block_size
        for g, m in enumerate(self.managers):
            coarse = m.coarse(fine)
            for i in range(start // m.block_size, min(end // m.block_size, len(coarse))):
                ext.touch(g, coarse[i])
            if end % m.block_size and end // hbs:
                ext.touch(g, fine[end // hbs - 1])

    # -- release ------------------------------------------------------------------
    def free(self, request_id: str) -> list[list[KVCacheBlock]]:
        """Free the request in every group; the blocks freed per group, tail first."""
        return [m.free(request_id) for m in self.managers]
