"""KVCacheManager: the scheduler-facing facade (vLLM's ``KVCacheManager`` + coordinator).

Call order per scheduler step (mirrors vLLM's ``Scheduler.schedule``):

1. Running requests first. For each: ``allocate_slots(req, num_new_tokens,
   num_lookahead_tokens=...)``. ``None`` means no room: preempt a request
   (``free(victim)``; reset its ``num_computed_tokens`` to 0) and retry, or skip.
2. Waiting requests (``num_computed_tokens == 0``):
   ``blocks, num_hit, boundary = get_computed_blocks(req)``; set
   ``req.shared_prefix_boundary = boundary``; optionally
   ``blocks, num_hit, num_ext = get_connector_hit(req, blocks, num_hit)`` (vLLM's
   connector rule over ``get_num_external_hit_tokens``); choose the chunk
   (block-aligned split for Mamba, stopping at ``boundary``), then
   ``allocate_slots(req, num_new_tokens, num_new_computed_tokens=num_hit,
   new_computed_blocks=blocks, num_external_computed_tokens=num_ext,
   full_sequence_must_fit=True)`` (vLLM's default admission gate: None unless the
   whole sequence fits; ``set_admission_limits`` gives its caps).
   A new request's full table is ``get_block_ids(req_id)``; a running request's
   worker table gets the returned ids appended (Mamba lists include null padding).
3. After scheduling: ``take_block_copies()`` and ``take_state_writes()`` go into the
   step's output. The worker runs the copies first, then loads external content,
   computes, writes the state writes. (Copy endpoints stay referenced until
   ``take_block_copies`` hands them out.)
4. After the step's results: the engine advances ``req.num_computed_tokens`` and
   appends output tokens (``req.append_output_token_ids``); finished requests are
   ``free``-d; then ``new_step_starts()`` flushes the step's events to listeners,
   clears the Mamba groups' same-step set and advances the step counter.

Hashes are registered during ``allocate_slots``, before the forward pass writes the
content, as vLLM does. Attention keys are hittable at once (the same forward pass
writes a block's kv before any request attends to it); a Mamba state published in the
step is not: a request whose hit ends on one gets None from ``allocate_slots`` and is
retried next step.

All groups allocate from one block pool (``block_pool``, vLLM's), unless
``CacheConfig.num_gpu_blocks`` gives one pool per group.

Mamba (align mode) tables: slot p holds the state after (p+1)*bs tokens; skipped
slots are the null block (id 0). A step's state is written to slot
cdiv(end, bs) - 1 (``StateWrite(kind="running")``) and read from the slot holding the
state at the step's start. As in vLLM, a kept slot takes its block-end key trusting the
chunk to have ended there, so chunks must follow vLLM's block-aligned split
(``kvtrace.engine.scheduler``'s port: stop at the next block boundary when starting
mid-block, at the last position a state can be kept, at the prompt's tail hash boundary
and at the shared-prefix junction); other splits leave stale keys.
``num_lookahead_tokens`` is ignored for Mamba groups (align mode). With
``num_prefill_checkpoint_blocks`` a prefill chunk may also get a checkpoint slot at
cdiv(end, bs) - 2 (``kind="checkpoint"``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final, cast

from kvtrace.cache.block_pool import BlockPool
from kvtrace.cache.blocks import KVCacheBlock
from kvtrace.cache.config import SHARED_PREFIX_PINNING, CacheConfig, FullAttentionSpec
from kvtrace.cache.context import CacheContext, CacheStats
from kvtrace.cache.coordinator import KVCacheCoordinator
from kvtrace.cache.events import (
    PUBLISH_FULL,
    BlocksFreed,
    CacheListener,
    PrefixLookup,
    first_miss,
    note_external_hits,
)
from kvtrace.cache.external import ExternalTier, connector_hit
from kvtrace.cache.hashing import BlockHash, BlockHasher
from kvtrace.cache.managers import FullAttentionManager, MambaManager, SlidingWindowManager
from kvtrace.cache.managers.base import SingleTypeManager
from kvtrace.cache.managers.mamba import mamba_checkpoint_position
from kvtrace.cache.plans import STATE_RUNNING, BlockCopy, KVCacheBlocks, StateWrite
from kvtrace.cache.request import Request
from kvtrace.cache.sink import EventSink
from kvtrace.numeric import cdiv

__all__ = ["CacheStats", "KVCacheManager"]

# the decode fast path's manager kinds (full attention keying a prompt tail: _FULL_TAIL)
# (Final: compiled, each is a constant, not a lookup in the module's globals)
_FULL: Final = 0
_FULL_TAIL: Final = 1
_SLIDING: Final = 2
_MAMBA: Final = 3
# False: every allocate_slots takes the general path (tests compare both). A module global,
# read when a manager is built: the class is compiled (kvtrace/compiled.py), so it cannot be patched.
DECODE_FAST_PATH = True


class KVCacheManager:
    """Hybrid prefix-cache manager over one block pool shared by every KV cache group.

    Block ids are unique across groups (0..num_gpu_blocks-1, 0 = the null block), as in
    vLLM. With ``num_gpu_blocks`` given per group, each group has a pool of its own and
    block ids are per group (``pools[g]``).
    """

    def __init__(self, config: CacheConfig, max_model_len: int | None = None, max_in_flight_tokens: int | None = None):
        """``max_model_len``, ``max_in_flight_tokens``: see ``set_admission_limits`` (the
        scheduler sets them; None: the full-sequence gate caps nothing)."""
        self.config = config
        self.decode_fast_path = DECODE_FAST_PATH
        self.num_fast_decode_slots = 0  # allocate_slots calls the fast path took (tests check it is used)
        self.enable_caching = config.enable_caching
        self.hash_block_size = config.hash_block_size
        self.sink = EventSink(enabled=False)
        self.stats = CacheStats(sink=self.sink)
        self.ctx = CacheContext(config, self.sink, self.stats)
        self.scheduler_block_size = self.ctx.scheduler_block_size
        self.hasher = BlockHasher(config.hash_fn, config.hash_block_size)
        ng = config.num_groups
        if config.shared_pool:
            pool = BlockPool(config.total_blocks, self.sink, ng)
            self.block_pool: BlockPool | None = pool
            self.pools: tuple[BlockPool, ...] = (pool,) * ng  # the pool each group allocates from
        else:
            self.block_pool = None
            self.pools = tuple(BlockPool(n, self.sink, ng) for n in config.pool_sizes)
        self._distinct_pools = list(dict.fromkeys(self.pools))
        self.external: ExternalTier | None = None
        if config.external is not None:
            self.external = ExternalTier(config.external.capacity_blocks, self.sink)
            for p in self._distinct_pools:
                p.external = self.external
        self.coordinator = KVCacheCoordinator(config, self.pools, self.ctx, self.external)
        self.managers = self.coordinator.managers
        self.num_groups = len(self.managers)
        self.hit_alignment = self.coordinator.hit_alignment
        self._no_hits: tuple = ((),) * self.num_groups
        # what allocate_slots returns when no group gets a block (shared, as vLLM's: never mutate it)
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple([] for _ in range(self.num_groups)))
        # one full-attention group keyed per hash unit: the vLLM "unitary" fast path
        self._unitary = (
            self.num_groups == 1 and isinstance(config.groups[0], FullAttentionSpec)
            and config.groups[0].block_size == config.hash_block_size
        )
        self._listeners: list[CacheListener] = []
        self._lookup_at = -1  # sink.events index of the last PrefixLookup (its external hit filled in later)
        # The decode fast path (``_allocate_decode_slot``) knows these managers' rules only.
        kinds = {FullAttentionManager: _FULL, SlidingWindowManager: _SLIDING, MambaManager: _MAMBA}
        # Typed lists, not a tuple of fields: compiled, every access below is native.
        self._fast_ok = all(type(m) in kinds for m in self.managers)
        self._fast_managers: list[SingleTypeManager] = list(self.managers) if self._fast_ok else []
        self._fast_kinds: list[int] = [
            _FULL_TAIL if kinds[type(m)] == _FULL and config.enable_caching and m.scale > 1 else kinds[type(m)]
            for m in self._fast_managers]
        self._fast_mamba: list[MambaManager] = list(self.coordinator.mamba)
        # the coordinator keys up to a multiple of the scheduler block (vLLM's _align_cacheable)
        self._align_cacheable = self.num_groups > 1 and not config.partial_hits
        self.max_model_len: int | None = None  # the full-sequence gate's cap on a sequence (None: none)
        self.num_full_sequence_refusals = 0  # admissions the full-sequence gate refused
        if max_model_len is not None:
            self.set_admission_limits(max_model_len, max_in_flight_tokens)

    def set_admission_limits(self, max_model_len: int, max_in_flight_tokens: int | None = None) -> None:
        """The scheduler's limits that the full-sequence admission gate reads (vLLM's
        ``KVCacheManager`` takes them at construction): a sequence counts at most
        ``max_model_len`` tokens, and a sliding-window group reserves at most its window
        plus ``max_in_flight_tokens`` (the tokens scheduled but not yet computed: one
        step's budget, kvtrace's schedule being synchronous). None: ``max_model_len``, as
        vLLM defaults it (no window cap in effect)."""
        self.max_model_len = max_model_len
        self.coordinator.set_admission_limits(
            max_model_len, max_model_len if max_in_flight_tokens is None else max_in_flight_tokens)

    # -- events -------------------------------------------------------------------
    def subscribe(self, listener: CacheListener) -> None:
        """``listener(events)`` receives each step's events once, at ``new_step_starts``."""
        self._listeners.append(listener)
        self.sink.enabled = True

    def unsubscribe(self, listener: CacheListener) -> None:
        self._listeners.remove(listener)
        self.sink.enabled = bool(self._listeners)

    @property
    def step(self) -> int:
        return self.sink.step

    def new_step_starts(self) -> None:
        """End the step: flush its events, make its published keys hittable, step += 1."""
        batch = self.sink.events
        self.sink.events = []
        for listener in self._listeners:
            listener(batch)
        self.sink.step += 1
        if self.coordinator.mamba:  # the coordinator's step work is its Mamba groups'
            self.coordinator.new_step_starts()

    # -- lookup -------------------------------------------------------------------
    def attach(self, request: Request) -> None:
        """Give ``request`` this manager's block hasher and hash its tokens so far.

        Lookups and allocations bind the hasher themselves; the engine may call this at
        request creation to hash eagerly (as vLLM hashes in ``Request.__init__``).
        """
        request.bind_hasher(self.hasher)
        request.update_block_hashes()

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int, int]:
        """Longest local prefix hit of a waiting request.

        Returns:
            (hit blocks per group, num hit tokens, shared_prefix_boundary). The hit is
            at most ``num_tokens - 1`` tokens (the last token is always recomputed) and
            a multiple of ``hit_alignment``. It may end on a Mamba state published in
            this step; ``allocate_slots`` then refuses the request until the next step.
            The boundary is the Marconi junction (hit + uncached common prefix) when
            ``shared-prefix-pinning`` is on and a sparse group lags, else 0; the
            scheduler stores it in ``request.shared_prefix_boundary``.

        Changes nothing but the stats and the step's ``PrefixLookup`` event: the hit
        blocks are taken only by the ``allocate_slots`` that follows.
        """
        request.bind_hasher(self.hasher)
        num_tokens = request.num_tokens
        st = self.stats
        st.queries += 1
        st.query_tokens += num_tokens
        if not self.enable_caching:
            return KVCacheBlocks.empty(self.num_groups), 0, 0
        fine = request.block_hashes
        m0 = self.managers[0]
        blocks: tuple[list[KVCacheBlock], ...]  # one entry per group
        first: tuple[int, ...]
        if self._unitary:
            hit_blocks, hit = m0.find_longest_cache_hit(fine, num_tokens - 1, self.hit_alignment)
            blocks, boundary, first = (hit_blocks,), 0, (hit,)
        else:
            per_group, hit, uncached, first = self.coordinator.find_longest_cache_hit(fine, num_tokens - 1)
            blocks = tuple(per_group)
            boundary = hit + uncached if uncached else 0
            if boundary and not self.ctx.pinning:
                self.ctx.old_behaviour(SHARED_PREFIX_PINNING, request.request_id)
                boundary = 0
        st.hit_tokens += hit
        if hit:
            st.hit_requests += 1
        sink = self.sink
        if sink.enabled:
            coarse0 = fine if self._unitary else m0.coarse(fine)
            # group 0's first miss is past its own hit (first[0]), not the request's: a block
            # group 0 holds, past a hit another group cut short, did not miss (and the miss
            # attribution blamed an old eviction of it). Its own hit before the hit alignment's
            # cut: where the alignment is coarser than group 0's blocks (groups of different block
            # sizes, no partial hits), the blocks group 0 holds past the cut did not miss either.
            hit0 = first[0]
            if self.hit_alignment > m0.block_size:
                hit0 = m0.find_longest_cache_hit(fine, max(num_tokens - 1, 0), m0.block_size)[1]
            miss, miss_idx = first_miss(coarse0, hit0, m0.block_size, num_tokens)
            self._lookup_at = len(sink.events)
            sink.events.append(
                PrefixLookup(
                    sink.step, request.request_id, num_tokens, hit, first, boundary, 0,
                    coarse0[0] if coarse0 else None, miss, miss_idx,
                )
            )
        return KVCacheBlocks(blocks), hit, boundary

    def get_num_external_hit_tokens(self, request: Request, num_local_hit_tokens: int) -> int:
        """Tokens beyond the local hit that the external tier can supply for every group
        (0 without a tier). Changes nothing: the load happens in ``allocate_slots``."""
        if self.external is None or not self.enable_caching:
            return 0
        request.bind_hasher(self.hasher)
        n = self.coordinator.external_hit_tokens(request.block_hashes, num_local_hit_tokens, request.num_tokens - 1)
        note_external_hits(self.sink.events, self._lookup_at, request.request_id, n)  # (its lookup, just made)
        return n

    def get_connector_hit(
        self, request: Request, blocks: KVCacheBlocks, num_local_hit_tokens: int
    ) -> tuple[KVCacheBlocks, int, int]:
        """The hit a new request is admitted with beside the external tier: vLLM 0.33's
        connector rule (``external.connector_hit``) over this manager's tier, from the local
        hit ``get_computed_blocks`` gave. Returns (local blocks, local hit tokens, external
        hit tokens): the blocks cut with the hit where an external load replaces its sub-block
        tail. The lookup's event and the stats say the same. Changes nothing else."""
        if self.external is None or not self.enable_caching:
            return blocks, num_local_hit_tokens, 0
        request.bind_hasher(self.hasher)
        hashes = request.block_hashes
        last = request.num_tokens - 1
        coordinator = self.coordinator
        local, external = connector_hit(num_local_hit_tokens, self.scheduler_block_size,
                                        lambda start: coordinator.external_hit_tokens(hashes, start, last))
        if local < num_local_hit_tokens:
            blocks = self.truncate_computed_blocks(blocks, local)
            self.stats.hit_tokens -= num_local_hit_tokens - local
            if not local:
                self.stats.hit_requests -= 1
        note_external_hits(self.sink.events, self._lookup_at, request.request_id, external, local)
        return blocks, local, external

    def truncate_computed_blocks(self, blocks: KVCacheBlocks, num_computed_tokens: int) -> KVCacheBlocks:
        """vLLM's: a lookup's ``blocks`` cut at ``num_computed_tokens`` (a multiple of every
        group's block size; a Mamba group's list may end before it). Pure slicing: no
        reference count changes and ``blocks`` is not mutated."""
        return KVCacheBlocks(tuple(
            group[:num_computed_tokens // m.block_size] for group, m in zip(blocks.blocks, self.managers)
        ))

    # -- allocation ---------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_external_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
    ) -> KVCacheBlocks | None:
        """Give ``request`` slots for ``num_new_tokens`` more tokens this step.

        Args:
            num_new_computed_tokens, new_computed_blocks: the local hit of a new request
                (from ``get_computed_blocks``).
            num_external_computed_tokens: tokens loaded from the external tier this step
                (before local compute).
            num_lookahead_tokens: extra slots (speculative tokens) for attention groups.
            full_sequence_must_fit: the admission gate (vLLM's, which its scheduler asks for
                with ``scheduler_reserve_full_isl``): first refuse unless the free blocks
                hold the whole sequence (``min(num_tokens, max_model_len)``), hits counted,
                sliding windows capped by ``max_admission_blocks``, Mamba's checkpoint
                counted; no lookahead. A chunked prefill is otherwise checked a chunk at a time.

        Returns:
            Per group, the blocks appended to the request's table this step, in table
            order (Mamba lists include null padding, so a worker that appends keeps its
            indices aligned), plus any copy-on-write block swapped into the table of a
            request on its first allocation. None when a group lacks free blocks:
            nothing has changed then, and the caller preempts or waits.

        The request's full blocks (up to ``num_computed_tokens + new tokens``) are keyed
        here, before the worker writes them (as vLLM does at schedule time). Mamba
        groups also queue ``StateWrite``s: ``running`` (state after the step's last
        token, into its slot), ``checkpoint`` (internal prefill checkpoint at slot
        cdiv(query_end, bs) - 2, the state at the chunk's last reachable hash boundary)
        and ``external`` (loaded state).
        """
        request.bind_hasher(self.hasher)
        if full_sequence_must_fit and not self._full_sequence_fits(
            request, num_new_computed_tokens, new_computed_blocks, num_external_computed_tokens
        ):
            self.stats.failed_allocations += 1
            self.num_full_sequence_refusals += 1
            return None
        if (
            num_new_tokens == 1 and self.decode_fast_path and new_computed_blocks is None
            and not num_external_computed_tokens and not num_lookahead_tokens
            and self._allocate_decode_slot(request)
        ):
            self.num_fast_decode_slots += 1
            return self.empty_kv_cache_blocks
        if self._unitary and not num_external_computed_tokens:
            return self._allocate_slots_unitary(request, num_new_tokens, num_new_computed_tokens,
                                                new_computed_blocks, num_lookahead_tokens)
        rid = request.request_id
        num_local = request.num_computed_tokens + num_new_computed_tokens
        total_computed = num_local + num_external_computed_tokens
        num_tokens_main = total_computed + num_new_tokens
        num_tokens_slots = num_tokens_main + num_lookahead_tokens
        hits = new_computed_blocks.blocks if new_computed_blocks is not None else self._no_hits
        coordinator = self.coordinator
        coordinator.remove_skipped_blocks(rid, total_computed)
        prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        if not coordinator.can_allocate(rid, num_tokens_main, num_tokens_slots, hits, num_local, total_computed,
                                        prefill_end):
            self.stats.failed_allocations += 1
            return None
        if num_external_computed_tokens:
            self.stats.external_hit_tokens += num_external_computed_tokens
        new_out = coordinator.allocate(
            request, new_computed_blocks.blocks if new_computed_blocks is not None else None, num_local,
            num_external_computed_tokens, num_tokens_main, num_tokens_slots, num_new_tokens, self.enable_caching,
        )
        return KVCacheBlocks(tuple(new_out))

    def _full_sequence_fits(self, request: Request, num_new_computed_tokens: int,
                            new_computed_blocks: KVCacheBlocks | None, num_external_computed_tokens: int) -> bool:
        """vLLM 0.33's ``full_sequence_must_fit`` check, before anything changes (and before
        the skipped blocks are freed, as there): the coordinator's count for the whole
        sequence with the admission cap, against the free blocks. Changes nothing."""
        num_local = request.num_computed_tokens + num_new_computed_tokens
        total_computed = num_local + num_external_computed_tokens
        num_tokens = request.num_tokens
        mml = self.max_model_len
        if mml is not None:
            total_computed = min(total_computed, mml)
            num_tokens = min(num_tokens, mml)
        hits = new_computed_blocks.blocks if new_computed_blocks is not None else self._no_hits
        prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        return self.coordinator.can_allocate(request.request_id, num_tokens, num_tokens, hits, num_local,
                                             total_computed, prefill_end, True)

    def allocate_decode_slots(self, running: list[Request], start: int, limit: int, max_model_len: int) -> int:
        """``allocate_slots(r, 1)`` for ``running[start:]`` in order, while each request is
        a decode step (one token, its last known one, below ``max_model_len``) that the
        decode fast path takes; at most ``limit``. Returns how many it allocated: each
        exactly as ``allocate_slots`` would (no new blocks). The scheduler's loop over its
        running requests then costs one call per run of decodes, not one per request."""
        if not self.decode_fast_path:
            return 0
        end = min(len(running), start + limit)
        i = start
        while i < end:
            request = running[i]
            computed = request.num_computed_tokens
            if request.num_prompt_tokens + len(request.output_token_ids) - computed != 1 or computed >= max_model_len:
                break
            request.bind_hasher(self.hasher)
            if not self._allocate_decode_slot(request):
                break
            self.num_fast_decode_slots += 1
            i += 1
        return i - start

    def _allocate_decode_slot(self, request: Request) -> bool:
        """``allocate_slots(request, 1)`` for a decode token that needs no new block and
        keys nothing: do what the general path does then, or return False (nothing done).

        The decode step of a running request is most calls. The general path then
        changes nothing in full attention and sliding window groups, and in a Mamba
        group only the request's state: its checkpoint is cleared (a one-token chunk
        exports none), it is marked allocated (``external-hit-running-cow``; switched
        off, an unallocated one is marked ``unmarked``), the state after the token is
        queued as a ``running`` write into its slot and it is marked handed out. Each
        early return of the general path that this relies on is checked first, against
        the state the general path would see there; tests/engine/test_decode_fast_path.py
        runs workloads both ways and compares every event and output.
        """
        p = request.num_computed_tokens
        if not self._fast_ok or p < request.num_prompt_tokens:
            return False  # a prompt token: checkpoints or a partial tail may be due
        rid = request.request_id
        t = p + 1
        num_to_cache = 0  # as KVCacheCoordinator.allocate keys (0: caching off, nothing keyed)
        if self.enable_caching:
            num_to_cache = request.num_prompt_tokens + len(request.output_token_ids)  # num_tokens
            if t < num_to_cache:
                num_to_cache = t
            if self._align_cacheable:
                num_to_cache = num_to_cache // self.scheduler_block_size * self.scheduler_block_size
        hbs = self.hash_block_size
        kinds = self._fast_kinds
        managers = self._fast_managers
        for k in range(len(managers)):
            m = managers[k]
            kind = kinds[k]
            bs = m.block_size
            table = m.req_to_blocks.get(rid)
            if table is None or rid in m.partial_hit_reqs or m.num_cached_block.get(rid, 0) < num_to_cache // bs:
                return False  # a copy-on-write is pending, or a block fills: key it
            n = len(table)
            null = m.null_block
            if kind == _MAMBA:
                mm = cast(MambaManager, m)
                st = mm.reqs.get(rid)
                if st is None or (t + bs - 1) // bs + mm.num_speculative_blocks > n:
                    return False  # a new state block
                if p > 1 and st.num_retired < min((p - 1) // bs, n):
                    return False  # remove_skipped_blocks retires slots
                last = st.last_state_block_idx
                if last is not None and last < (p + bs - 1) // bs - 1 and table[last] is not null:
                    return False  # the previous state block is consumed: freed
                # _cache_partial_tail_block (no checkpoint: a one-token chunk exports none)
                if (num_to_cache and not num_to_cache % hbs
                        and num_to_cache == mamba_checkpoint_position(request.num_prompt_tokens, hbs)):
                    slot = (num_to_cache + bs - 1) // bs - 1
                    if slot < n and table[slot] is not null:
                        b = table[slot]
                        if b.block_hash is None or b.hash_num_tokens != num_to_cache:
                            return False
            elif (t + bs - 1) // bs > n:
                return False
            elif kind == _SLIDING:
                skipped = min(cast(SlidingWindowManager, m).get_num_skipped_tokens(p) // bs, n)
                if skipped and table[skipped - 1] is not null:  # remove_skipped_blocks frees nothing
                    return False
            elif kind == _FULL_TAIL:  # FullAttentionManager._cache_partial_tail_block publishes nothing
                # only the prompt's units are read, hashed since admission (get_computed_blocks):
                # the list as it stands, without the property's catch-up on output tokens
                hashes = request._block_hashes
                boundary = (request.num_prompt_tokens - 1) // hbs
                if boundary > len(hashes):
                    boundary = len(hashes)
                boundary *= hbs
                if boundary and boundary <= num_to_cache and boundary % bs and boundary // bs < n:
                    b, key = table[boundary // bs], hashes[boundary // hbs - 1]
                    if b.block_hash != key and (b.aliases is None or not m.pool.holds_key(key, b)):
                        return False
        if self._fast_mamba:
            ctx = self.ctx
            running_cow = ctx.external_hit_running_cow
            writes = ctx.state_writes
            # what get_num_blocks_to_allocate, allocate_new_blocks, queue_running_state and
            # mark_handed_out change, in the coordinator's order
            for mm in self._fast_mamba:
                st = mm.reqs[rid]
                st.checkpoint = None
                if running_cow:
                    st.allocated = True
                elif not st.allocated:
                    st.unmarked = True
                bs = mm.block_size
                b = mm.req_to_blocks[rid][(t + bs - 1) // bs - 1]
                if b is not mm.null_block:
                    writes.append(StateWrite(rid, mm.group_id, b.block_id, t, STATE_RUNNING))
                st.handed_out = True
        return True

    def _allocate_slots_unitary(self, request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                                num_lookahead_tokens):
        """``allocate_slots`` for one full-attention group whose blocks are hash units.

        The general path, specialised: this runs once per request and step, so it reads
        each field once (its per-call overhead is most of a short request's cost).
        """
        m = self.managers[0]
        pool = m.pool
        rid = request.request_id
        num_tokens_main = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        bs = m.block_size
        table = m.req_to_blocks.get(rid)
        num_table = len(table) if table is not None else 0
        hits = new_computed_blocks.blocks[0] if new_computed_blocks is not None else ()
        num_hits = len(hits)
        num_slots = cdiv(num_tokens_main + num_lookahead_tokens, bs)
        need = num_slots - num_table - num_hits
        num_free = pool.free_block_queue.num_free_blocks
        if num_hits and need + num_hits > num_free:  # free hit blocks leave the queue too: count them
            need += sum([b.ref_cnt == 0 for b in hits])
        if need > num_free:
            self.stats.failed_allocations += 1
            return None
        cached_counts = m.num_cached_block
        if table is None:
            table = m.req_to_blocks[rid] = []
            num_cached = cached_counts[rid] = 0
        else:
            num_cached = cached_counts[rid]
        if num_hits:
            pool.touch(hits, 0)
            table.extend(hits)
            num_table += num_hits
            num_cached = cached_counts[rid] = num_hits
        n = num_slots - num_table
        if n > 0 and self.enable_caching and num_cached == num_table:
            # every earlier block is keyed: allocate and key the new ones in one pass
            num_prompt = request.num_prompt_tokens + len(request.output_token_ids)
            num_full = (num_tokens_main if num_tokens_main < num_prompt else num_prompt) // bs
            new = pool.get_new_blocks_and_cache(n, 0, rid, request.block_hashes, num_table, num_full, bs)
            table.extend(new)
            num_table += n
            if num_full > num_cached:
                cached_counts[rid] = num_full if num_full < num_table else num_table
            return KVCacheBlocks((new,))
        new = pool.get_new_blocks(n, 0, rid) if n > 0 else []
        if new:
            table.extend(new)
        if self.enable_caching:
            num_full = min(num_tokens_main, request.num_tokens) // bs
            num_cached = cached_counts[rid]
            if num_full > num_cached:
                pool.cache_full_blocks(0, rid, table, request.block_hashes, num_cached, num_full, bs, None,
                                       PUBLISH_FULL)
                cached_counts[rid] = num_full
        return KVCacheBlocks((new,))

    def free(self, request: Request | str) -> None:
        """Release a finished or preempted request's blocks in every group, tail first
        (so its tail is evicted before its prefix). Its keys stay cached."""
        rid = request if isinstance(request, str) else request.request_id
        self.stats.freed_requests += 1
        sink = self.sink
        if self._unitary:  # one group: skip the coordinator's per-group loop
            freed = self.managers[0].free(rid)
            if freed and sink.enabled:
                sink.events.append(BlocksFreed(sink.step, rid, 0, tuple([b.block_id for b in freed])))
            return
        for g, freed in enumerate(self.coordinator.free(rid)):
            if freed and sink.enabled:
                sink.events.append(BlocksFreed(sink.step, rid, g, tuple([b.block_id for b in freed])))

    def take_block_copies(self) -> list[BlockCopy]:
        """Device copies (src -> dst, per group) the worker must run before this step's compute.

        Hands out the copies queued since the last call and releases the references
        that kept both endpoints alive until now (vLLM's ``take_kv_cache_block_copies``
        followed by the scheduler's immediate free of the retained blocks: source and
        copy of each pair, in copy order, in one ``free_blocks`` per pool).
        """
        copies = self.ctx.copies
        if not copies:
            return copies
        self.ctx.copies = []
        retained = self.ctx.retained  # two endpoints per copy, in copy order
        self.ctx.retained = []
        order = sorted(range(len(copies)), key=lambda i: copies[i].group_id)  # vLLM drains group by group
        by_pool: dict[BlockPool, list[KVCacheBlock]] = {}
        for i in order:
            for pool, block in retained[2 * i:2 * i + 2]:
                by_pool.setdefault(pool, []).append(block)
        for pool, blocks in by_pool.items():
            pool.free_blocks(blocks)
        return [copies[i] for i in order]

    def take_state_writes(self) -> list[StateWrite]:
        """States/contents the worker must materialise this step (see ``StateWrite``)."""
        out = self.ctx.state_writes
        self.ctx.state_writes = []
        return out

    def reset_prefix_cache(self) -> bool:
        """Drop every cached key; refused (False) while any request holds blocks."""
        if not all(p.is_idle() for p in self._distinct_pools) or self.ctx.retained:
            return False
        for p in self._distinct_pools:
            p.reset_prefix_cache()
        return True

    # -- introspection ------------------------------------------------------------
    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's whole table per group (null slots as block 0)."""
        return tuple([b.block_id for b in m.req_to_blocks.get(request_id, ())] for m in self.managers)

    def cached_entries(self) -> Iterator[tuple[int, BlockHash, int, int]]:
        """(group_id, block_hash, block_id, num_tokens) for every cached key."""
        for g, p in enumerate(self.pools):
            for h, v in list(p.cached[g].items()):
                for b in ([v] if not isinstance(v, dict) else list(v.values())):
                    if b.block_hash == h:
                        yield g, h, b.block_id, b.hash_num_tokens
                    else:
                        for ah, nt in b.aliases or ():
                            if ah == h:
                                yield g, h, b.block_id, nt
                                break

    @property
    def usage(self) -> tuple[float, ...]:
        """Per group, the share of its pool's usable blocks that the group holds, 0..1.

        With the shared pool the shares sum to the pool's usage (vLLM's single
        ``KVCacheManager.usage``, see ``pool_usage``); with one pool per group each is
        that pool's usage."""
        return tuple(p.group_usage(g) for g, p in enumerate(self.pools))

    @property
    def pool_usage(self) -> float:
        """Usage of the shared pool (vLLM's ``usage``), or of all pools together."""
        pools = self._distinct_pools
        if len(pools) == 1:
            return pools[0].usage()
        used = sum(p.num_blocks - 1 - p.num_free_blocks for p in pools)
        return used / sum(p.num_blocks - 1 for p in pools)

    @property
    def num_free_blocks(self) -> int:
        """Free blocks of the shared pool (of every pool together, when per group)."""
        return sum(p.num_free_blocks for p in self._distinct_pools)
