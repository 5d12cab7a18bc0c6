"""The hybrid coordinator (vLLM's ``KVCacheCoordinator``): runs every KV cache group's
manager on one request, as one.

* Lookup: the groups' hits are taken to a fixed point. Full attention goes first: its
  hits are downward closed, so it is looked up once and bounds the others; each other
  group is asked for a hit capped by the current length, and the loop repeats until
  no group shrinks it (one pass for full attention plus one other group). The result
  is (blocks per group, hit length L, uncached common prefix): the longest hit any
  group found minus L, the part a sparse group lacks. ``L + uncached`` is the
  shared-prefix boundary (the Marconi junction).
* Allocation: the groups' needs are summed against the free blocks of the pool they
  share (each pool's, when the groups have pools of their own). Then every group takes
  its hit blocks, then every group allocates its external blocks, then each group in
  turn applies its copy-on-write and grows its table, and the full blocks are keyed.
  Either every group allocates or none does. The admission gate sums the groups' needs
  for the whole sequence instead (``apply_admission_cap``: sliding windows capped at
  ``max_admission_blocks``), changing nothing.
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
    def __init__(self, config: CacheConfig, pools: Sequence[BlockPool], ctx: CacheContext,
                 external: ExternalTier | None):
        """``pools[g]``: the pool group g allocates from (one object for every group when
        the pool is shared)."""
        self.config = config
        self.ctx = ctx
        self.external = external
        self.managers: list[SingleTypeManager] = [
            MANAGER_FOR_SPEC[type(spec)](g, spec, pools[g], ctx) for g, spec in enumerate(config.groups)
        ]
        self.num_groups = len(self.managers)
        self.pools = list(dict.fromkeys(pools))  # distinct pools, in group order
        self.lookup_order = sorted(
            range(self.num_groups), key=lambda g: 0 if isinstance(config.groups[g], FullAttentionSpec) else 1
        )
        self.attention_groups = [g for g, s in enumerate(config.groups) if isinstance(s, FullAttentionSpec)]
        # full attention plus one other group: one pass of the fixed point suffices
        self.simple_hybrid = self.num_groups == 2 and isinstance(config.groups[self.lookup_order[0]], FullAttentionSpec)
        self.mamba = [m for m in self.managers if isinstance(m, MambaManager)]
        if not self.mamba:  # (see SingleTypeManager.copy_waits_for_writes)
            for m in self.managers:
                m.copy_waits_for_writes = True
        self.skipping = [m for m in self.managers if not isinstance(m, FullAttentionManager)]
        self.hit_alignment = ctx.cache_hit_alignment

    # -- lookup -------------------------------------------------------------------
    def find_longest_cache_hit(
        self, fine: Sequence[BlockHash], max_length: int
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
        if max_length < 0:  # an empty request (num_tokens - 1): no hit, not a hit of -1 tokens
            max_length = 0
        hit_length = max_length
        longest = 0
        results: list[list[KVCacheBlock] | None] = [None] * self.num_groups
        hit_by_group = [0] * self.num_groups
        first: list[int | None] = [None] * self.num_groups
        first_cap = [0] * self.num_groups  # the cap each group's first lookup had
        while True:
            curr = hit_length
            for g in self.lookup_order:
                m = mgrs[g]
                if results[g] is not None and isinstance(m, FullAttentionManager):
                    curr = min(curr, hit_by_group[g])  # downward closed: trim, don't look again
                    continue
                cap = curr
                blocks, curr = m.find_longest_cache_hit(fine, curr, align)
                results[g] = blocks
                hit_by_group[g] = curr
                if first[g] is None:
                    first[g] = curr
                    first_cap[g] = cap
                longest = max(longest, curr)
            if curr >= hit_length:
                break
            hit_length = curr
            if self.simple_hybrid:
                break
        out: BlocksPerGroup = [r if r is not None else [] for r in results]
        for g in self.attention_groups:
            del out[g][cdiv(hit_length, mgrs[g].block_size):]
        if self.ctx.sink.enabled:
            # Each group's hit alone (the PrefixLookup's hit_tokens_per_group, the group hit
            # rate): a group looked up after another was capped by that one's hit; it is asked
            # again without the cap (lookups change nothing). Only the events read it.
            # (full attention is downward closed in full blocks: a capped hit whose next block
            # lies wholly under the cap missed that block, and is its hit alone; a partial hit
            # probes inside the block at the cap only up to the cap, and is asked again)
            for g in self.lookup_order[1:]:
                hit_g = first[g]
                if hit_g is None or first_cap[g] >= max_length:
                    continue
                m = mgrs[g]
                if isinstance(m, FullAttentionManager) and hit_g // m.block_size * m.block_size + m.block_size <= \
                        first_cap[g]:
                    continue
                first[g] = m.find_longest_cache_hit(fine, max_length, align)[1]
        firsts = tuple(h or 0 for h in first)
        return out, hit_length, longest - hit_length, firsts

    # -- allocation ---------------------------------------------------------------
    def set_admission_limits(self, max_model_len: int, max_in_flight_tokens: int) -> None:
        """Give the groups that recycle blocks their per-request admission cap (vLLM's
        ``get_manager_for_kv_cache_spec``, from the scheduler's limits)."""
        for m in self.managers:
            m.max_admission_blocks = m.admission_cap(max_model_len, max_in_flight_tokens)

    def can_allocate(self, request_id: str, num_tokens_main: int, num_tokens_slots: int,
                     hits: Sequence[Sequence[KVCacheBlock]], num_local: int, total_computed: int,
                     prefill_end: int, apply_admission_cap: bool = False) -> bool:
        """Whether the pool has the blocks this allocation needs, every group's need
        summed (vLLM's ``get_num_blocks_to_allocate``; Mamba groups ignore lookahead).
        Also fixes the Mamba groups' checkpoint for this allocation, unless
        ``apply_admission_cap``: then it is the full-sequence admission gate's count
        (each group's need capped by its ``max_admission_blocks``), and changes nothing."""
        if self.ctx.retention_interval != 0:
            prefill_end = 0  # dense or periodic retention: every chunk may checkpoint
        if len(self.pools) == 1:
            need = 0
            for g, m in enumerate(self.managers):
                need += m.get_num_blocks_to_allocate(
                    request_id, num_tokens_slots, hits[g], total_computed, num_local, num_tokens_main, prefill_end,
                    apply_admission_cap,
                )
            return need <= self.pools[0].free_block_queue.num_free_blocks
        needs: dict[BlockPool, int] = {}
        for g, m in enumerate(self.managers):
            needs[m.pool] = needs.get(m.pool, 0) + m.get_num_blocks_to_allocate(
                request_id, num_tokens_slots, hits[g], total_computed, num_local, num_tokens_main, prefill_end,
                apply_admission_cap,
            )
        return all(n <= p.free_block_queue.num_free_blocks for p, n in needs.items())

    def allocate(self, request: Request, hits: Sequence[Sequence[KVCacheBlock]] | None, num_local: int,
                 num_external: int, num_tokens_main: int, num_tokens_slots: int, num_new_tokens: int,
                 enable_caching: bool) -> BlocksPerGroup:
        """Take ``hits`` (a new request's), load ``num_external`` tokens' blocks, apply
        copy-on-write, grow every table to ``num_tokens_slots`` and key the full blocks.
        Returns the blocks handed out to each group this step, in table order. The
        caller has checked ``can_allocate``."""
        rid = request.request_id
        mgrs = self.managers
        total_computed = num_local + num_external
        if (hits is not None and any(hits)) or num_external:  # noqa: SIM102  (vLLM's two tests, apart)
            # vLLM's allocate_new_computed_blocks: a running request takes nothing new
            if not any(rid in m.num_cached_block for m in mgrs):
                no_hits: Sequence[KVCacheBlock] = ()
                for g, m in enumerate(mgrs):
                    m.add_computed_blocks(rid, hits[g] if hits is not None else no_hits, num_local, num_external)
                if num_external:
                    for m in mgrs:
                        m.allocate_external_blocks(request, num_local, num_external)
        out: BlocksPerGroup = [
            m.allocate_new_blocks(request, num_tokens_slots, num_tokens_main, total_computed) for m in mgrs
        ]
        if num_external:
            for m in mgrs:
                m.queue_external_tail_write(request, num_local, num_external)
            self._touch_external(request, num_local, total_computed)
        if enable_caching:
            num_to_cache = min(num_tokens_main, request.num_tokens)
            if self.num_groups > 1 and not self.ctx.enable_partial_hits:
                sbs = self.ctx.scheduler_block_size
                num_to_cache = num_to_cache // sbs * sbs  # vLLM's _align_cacheable
            for m in mgrs:
                m.cache_blocks(request, num_to_cache)
        for mm in self.mamba:
            if num_new_tokens > 0:
                mm.queue_running_state(request, num_tokens_main)
            mm.mark_handed_out(rid)
        return out

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for m in self.skipping:
            m.remove_skipped_blocks(request_id, num_computed_tokens)

    def new_step_starts(self) -> None:
        for mm in self.mamba:
            mm.new_step_starts()

    # -- external tier ------------------------------------------------------------
    def external_hit_tokens(self, fine: Sequence[BlockHash], num_local_hit_tokens: int, max_length: int) -> int:
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
        # sliding-window groups: per block index, the blocks held in a row ending there (built
        # once per call: a window's blocks were looked up again at every candidate length)
        held: dict[int, list[int]] = {}
        length = max_length // unit * unit
        while length > num_local_hit_tokens:
            if all(self._external_has(g, fine, length, runs, held) for g in range(self.num_groups)):
                return length - num_local_hit_tokens
            length -= unit
        return 0

    def _external_has(self, g: int, fine: Sequence[BlockHash], length: int, runs: dict[int, int],
                      held: dict[int, list[int]]) -> bool:
        m = self.managers[g]
        bs, hbs, ext = m.block_size, self.config.hash_block_size, self.external
        assert ext is not None
        spec = self.config.groups[g]
        if isinstance(spec, FullAttentionSpec):
            if length // bs > runs[g]:
                return False
            return length % bs == 0 or (g, fine[length // hbs - 1]) in ext
        if isinstance(spec, MambaSpec):
            if length % bs and not self.config.partial_hits:
                return False
            return (g, fine[length // hbs - 1]) in ext
        if length % bs:
            return False
        assert isinstance(m, SlidingWindowManager)
        in_a_row = held.get(g)
        if in_a_row is None:
            in_a_row = []
            n = 0
            for h in m.coarse(fine):
                n = n + 1 if (g, h) in ext else 0
                in_a_row.append(n)
            held[g] = in_a_row
        end = length // bs
        # the window's blocks ending at the hit, at least one (as the local lookup: a one-token
        # window needs no earlier block, yet a hit ends on a block the tier holds)
        need = max(m.need, 1)
        return in_a_row[end - 1] >= min(need, end)

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
        """Free the request in every group (in group order); the blocks freed per group,
        tail first."""
        return [m.free(request_id) for m in self.managers]
