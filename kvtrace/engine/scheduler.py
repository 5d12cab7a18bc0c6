"""The scheduler, after vLLM v1's ``Scheduler.schedule``.

One step: the RUNNING requests first (in order), each getting up to its remaining
tokens within the token budget; then, if nobody was preempted, WAITING requests in
arrival order (preempted ones at the front), each after a prefix-cache lookup and an
external-tier lookup (vLLM's connector rule: the tier asked from the local hit cut to a
scheduler block, its load replacing a local sub-block tail only when longer), and
admitted only if the free blocks hold its whole sequence (``scheduler_reserve_full_isl``,
vLLM's default gate). A chunk is cut by
``long_prefill_token_threshold`` (unless one request is alone in the system), the
budget, and for Mamba-align models by the block-aligned split. When ``allocate_slots``
returns None, the last running request is preempted (recompute) and the allocation
retried. Finished requests are freed in the schedule's order, as vLLM's
``update_from_output`` frees them.

It calls the cache manager where vLLM does: ``get_computed_blocks`` and
``get_connector_hit`` for a new request, ``allocate_slots`` for everyone
scheduled, ``free`` on preemption and finish, ``take_block_copies`` and
``take_state_writes`` when the step's output is built. ``new_step_starts`` is called by
the engine between steps (vLLM calls it at the top of ``schedule``; nothing happens in
between, so it is the same point).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvtrace.cache import BlockCopy, CacheConfig, KVCacheManager, MambaSpec, StateWrite
from kvtrace.cache.managers.mamba import is_checkpoint_exportable, mamba_checkpoint_position
from kvtrace.engine.config import SchedulerConfig
from kvtrace.engine.request import FINISHED, PREEMPTED, RUNNING, WAITING, EngineRequest


@dataclass(slots=True)
class NewRequestData:
    """A request entering the batch (first time or resumed): the worker sets its table."""

    request_id: str
    request: EngineRequest  # the worker reads prompt (+ replayed output) tokens from it
    block_ids: tuple[list[int], ...]  # the full table per group
    num_computed_tokens: int  # before this step: local hit + external hit
    num_external_tokens: int  # [num_computed - external, num_computed) came from the external tier


@dataclass(slots=True)
class CachedRequestData:
    """A request already in the batch: the worker appends ``new_block_ids``."""

    request_id: str
    new_block_ids: tuple[list[int], ...]
    num_computed_tokens: int  # before this step


@dataclass(slots=True)
class DecodeRun:
    """Running requests that each decode one token this step and get no new block (a run the
    cache manager allocated in one call): for each, what ``CachedRequestData(request_id, no
    new block ids, start)`` says, in one entry instead of one object per request."""

    requests: list[EngineRequest]
    starts: list[int]  # each request's num_computed_tokens before this step


@dataclass(slots=True)
class SchedulerOutput:
    step: int
    scheduled_new_reqs: list[NewRequestData]
    # the running requests scheduled, in the running order (a DecodeRun stands for several)
    scheduled_cached_reqs: list[CachedRequestData | DecodeRun]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    block_copies: list[BlockCopy]
    state_writes: list[StateWrite]
    finished_req_ids: list[str]  # finished since the previous output: drop their tables
    preempted_req_ids: list[str] = field(default_factory=list)


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, kv_cache_manager: KVCacheManager):
        self.config = scheduler_config
        self.cache_config = cache_config
        self.kv_cache_manager = kv_cache_manager
        self.running: list[EngineRequest] = []
        self.waiting: deque[EngineRequest] = deque()
        self.step = 0
        self._finished_since_last: list[str] = []
        mamba = [s for s in cache_config.groups if isinstance(s, MambaSpec)]
        self.need_mamba_block_aligned_split = bool(mamba)
        # The Mamba block: vLLM splits at its cache_config.block_size, the smallest group
        # block, which its align mode makes the Mamba block too; kvtrace also allows
        # attention blocks finer than the Mamba block and then splits at the Mamba block,
        # where a state must be materialised (a documented difference).
        self.block_size = max(s.block_size for s in mamba) if mamba else cache_config.groups[0].block_size
        self.scheduler_block_size = kv_cache_manager.scheduler_block_size
        self.hash_block_size = cache_config.hash_block_size
        self.mamba_partial_cache_hit = (bool(mamba) and cache_config.partial_hits
                                        and self.hash_block_size < self.scheduler_block_size)
        self.mamba_has_prefill_checkpoint_blocks = bool(mamba) and cache_config.num_prefill_checkpoint_blocks > 0
        self.mamba_prefill_checkpoint_alignment = cache_config.prefill_checkpoint_alignment
        self.use_external = cache_config.external is not None
        self.num_preemptions = 0
        # (request id, tokens it had computed) of a request that preempted itself this step with
        # nothing else running: the engine refuses one that does so twice at the same point, which
        # the pool can never hold (caching off, it was admitted and preempted again for ever)
        self.lone_preemption: tuple[str, int] | None = None
        # tokens the waiting head must prefill in one step when chunked prefill is off and
        # they exceed the step's budget (0: it waited for blocks, or not at all): the engine
        # names this, not the pool, when nothing can run
        self.unchunked_wait = 0
        self._no_new_ids: tuple[list[int], ...] = tuple([] for _ in cache_config.groups)  # shared: read only
        # kvtrace's manager allocates a run of decode steps in one call; another backend
        # (vLLM's manager) is called once per request
        self._decode_run = getattr(kv_cache_manager, "allocate_decode_slots", None)
        # vLLM's Scheduler builds its manager with these limits (the admission gate's); here the
        # manager comes built. One step's budget is in flight at most: the schedule is synchronous
        # (vLLM's max_in_flight_tokens without async scheduling or pipeline parallelism).
        set_limits = getattr(kv_cache_manager, "set_admission_limits", None)
        if set_limits is not None:
            set_limits(scheduler_config.max_model_len, scheduler_config.max_num_batched_tokens)

    # -- queue -----------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        request.status = WAITING
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    # -- the block-aligned split -------------------------------------------------------------
    def _mamba_block_aligned_split(
        self,
        request: EngineRequest,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        """Cut a prefill chunk so it ends where a Mamba state must be materialised
        (vLLM 0.33's ``Scheduler._mamba_block_aligned_split``, which the conformance
        check compares this with).

        ``bs`` is the Mamba block size. The chunk may export the prompt's
        checkpoint itself (an internal checkpoint block, and the chunk reaching the end
        of prefill from a position the backend can export from): then only the
        alignment rules below apply. Otherwise it may not run past the last position
        a state can be kept at, ``(num_tokens - 1) // bs * bs``. A chunk that does not
        reach the end of prefill is rounded down to a block boundary (unless a block is
        wider than any chunk can be and the chunk would not move). It then stops at the
        earliest of these strictly inside it: the next block boundary when it starts
        mid-block, that last position, the prompt's tail hash boundary
        ``(num_prompt_tokens - 1) // hash * hash`` (fine-grained hits, no internal
        checkpoint), and the shared-prefix junction (block-floored from the chunk start).
        """
        start = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
        prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        if start >= prefill_end:
            return num_new_tokens
        bs = self.block_size
        hbs = self.hash_block_size
        last_cache_position = mamba_checkpoint_position(request.num_tokens, bs)
        end = start + num_new_tokens
        unit = hbs if self.mamba_partial_cache_hit else self.scheduler_block_size
        use_internal_checkpoint = (
            self.mamba_has_prefill_checkpoint_blocks
            and end >= prefill_end
            and is_checkpoint_exportable(start, end, mamba_checkpoint_position(prefill_end, unit), hbs, bs,
                                         self.mamba_prefill_checkpoint_alignment)
        )
        if use_internal_checkpoint:
            last_cache_position = 0
        if end < prefill_end:
            max_prefill = self.config.max_num_batched_tokens
            thr = self.config.long_prefill_token_threshold
            if thr > 0:
                max_prefill = min(max_prefill, thr)
            aligned_end = end // bs * bs
            if aligned_end > start or bs <= max_prefill:
                end = aligned_end
        tail_boundary = (mamba_checkpoint_position(request.num_prompt_tokens, hbs)
                         if self.mamba_partial_cache_hit and not use_internal_checkpoint else 0)
        spb = request.shared_prefix_boundary
        stops = (
            (start // bs + 1) * bs if start % bs and not use_internal_checkpoint else 0,
            last_cache_position,
            tail_boundary if last_cache_position < tail_boundary < request.num_prompt_tokens else 0,
            start + (spb - start) // bs * bs if start < spb < end else 0,
        )
        end = min((s for s in stops if start < s < end), default=end)
        return max(end - start, 0)

    def _cap(self, request: EngineRequest, num_new_tokens: int, token_budget: int, thr: int) -> int:
        if 0 < thr < num_new_tokens:
            num_new_tokens = thr
        num_new_tokens = min(num_new_tokens, token_budget)
        return min(num_new_tokens, self.config.max_model_len - request.num_computed_tokens)

    # -- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.step += 1
        kv = self.kv_cache_manager
        token_budget = self.config.max_num_batched_tokens
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData | DecodeRun] = []
        num_scheduled: dict[str, int] = {}
        preempted: list[EngineRequest] = []
        self.unchunked_wait = 0
        self.lone_preemption = None
        # vLLM 0.33 cuts long prefills only when someone else could be starved: a lone request
        # (running + waiting) gets the whole budget. (The Mamba split reads the configured value.)
        long_prefill = self.config.long_prefill_token_threshold if len(self.running) + len(self.waiting) > 1 else 0

        no_new_ids = self._no_new_ids
        max_model_len = self.config.max_model_len
        # RUNNING first.
        running = self.running
        decode_run = self._decode_run
        i = 0
        while i < len(running) and token_budget > 0:
            if decode_run is not None:  # a run of decode steps in one call (the manager's fast path)
                k = decode_run(running, i, token_budget, max_model_len)
                if k:
                    run = running[i:i + k]
                    cached_reqs.append(DecodeRun(run, [r.num_computed_tokens for r in run]))
                    num_scheduled.update(dict.fromkeys([r.request_id for r in run], 1))
                    token_budget -= k
                    i += k
                    continue
            request = running[i]
            computed = request.num_computed_tokens
            n = request.num_prompt_tokens + len(request.output_token_ids) - computed
            if n > 1 or computed >= max_model_len:
                # (one token is the decode step: no cap or split can change it)
                n = self._cap(request, n, token_budget, long_prefill)
                if self.need_mamba_block_aligned_split and n > 0:
                    n = self._mamba_block_aligned_split(request, n)
            if n <= 0:
                i += 1
                continue
            while True:
                new_blocks = kv.allocate_slots(request, n)
                if new_blocks is not None:
                    break
                victim = running.pop()  # FCFS: the latest admitted goes first
                if victim is request and not running:
                    self.lone_preemption = (request.request_id, request.num_computed_tokens)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if new_blocks is None:
                break
            ids = no_new_ids if new_blocks is kv.empty_kv_cache_blocks else new_blocks.get_block_ids()
            rid = request.request_id
            cached_reqs.append(CachedRequestData(rid, ids, computed))
            num_scheduled[rid] = n
            token_budget -= n
            i += 1

        # Then WAITING, in arrival order, unless this step had to preempt.
        if not preempted:
            waiting = self.waiting
            reserve_full_isl = self.config.scheduler_reserve_full_isl
            while waiting and token_budget > 0 and len(running) < self.config.max_num_seqs:
                request = waiting[0]
                blocks, num_local, request.shared_prefix_boundary = kv.get_computed_blocks(request)
                num_external = 0
                if self.use_external:
                    blocks, num_local, num_external = kv.get_connector_hit(request, blocks, num_local)
                num_computed = num_local + num_external
                n = request.num_tokens - num_computed
                if 0 < long_prefill < n:
                    n = long_prefill
                if not self.config.enable_chunked_prefill and n > token_budget:
                    self.unchunked_wait = n
                    break
                n = min(n, token_budget)
                if self.need_mamba_block_aligned_split:
                    n = self._mamba_block_aligned_split(request, n, num_local, num_external)
                if n <= 0:
                    break
                new_blocks = kv.allocate_slots(
                    request,
                    n,
                    num_new_computed_tokens=num_local,
                    new_computed_blocks=blocks,
                    num_external_computed_tokens=num_external,
                    full_sequence_must_fit=reserve_full_isl,
                )
                if new_blocks is None:
                    break
                waiting.popleft()
                running.append(request)
                request.status = RUNNING
                request.num_computed_tokens = num_computed
                # vLLM records the lookup at admission (record_prefix_cache_stats): the first
                # one is the request's hit; a preempted request's re-lookups count apart.
                if request.num_local_hit_tokens < 0:
                    request.num_local_hit_tokens = num_local
                    request.num_external_hit_tokens = num_external
                    if self.use_external:
                        request.num_external_query_tokens = request.num_tokens - num_local
                else:
                    request.num_preempted_query_tokens += request.num_tokens
                    request.num_preempted_hit_tokens += num_local
                new_reqs.append(
                    NewRequestData(
                        request.request_id, request, kv.get_block_ids(request.request_id), num_computed, num_external
                    )
                )
                num_scheduled[request.request_id] = n
                token_budget -= n

        # vLLM's _update_after_schedule: the scheduled tokens count as computed from now on.
        for request in running:
            scheduled = num_scheduled.get(request.request_id)
            if scheduled:
                request.num_computed_tokens += scheduled
        out = SchedulerOutput(
            step=self.step,
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            block_copies=list(kv.take_block_copies()),
            state_writes=list(kv.take_state_writes()),
            finished_req_ids=self._finished_since_last,
            preempted_req_ids=[r.request_id for r in preempted],
        )
        self._finished_since_last = []
        self.num_preemptions += len(preempted)
        return out

    def _preempt(self, request: EngineRequest) -> None:
        self.kv_cache_manager.free(request)
        request.status = PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    # -- after the step ------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int], end_ns: int,
                           start_ns: int | None = None) -> list[EngineRequest]:
        """Append sampled tokens; finish requests that reached their output length.

        A request with a recorded ``expected_output`` appends those tokens instead (the
        worker still checks what it sampled against the no-cache reference).
        """
        finished: list[EngineRequest] = []
        index = {r.request_id: r for r in self.running} if sampled else {}
        for rid, token in sampled.items():
            request = index[rid]
            out_ids = request.output_token_ids
            expected = request.expected_output
            if expected is not None and len(out_ids) < len(expected):
                token = expected[len(out_ids)]  # teacher-forced replay of a recorded output
            out_ids.append(int(token))  # (Request.append_output_token_ids, for one token)
            request.token_times_ns.append(end_ns)
            if request.first_token_ns < 0:
                request.first_token_ns = end_ns
                if out.num_scheduled_tokens[rid] == 1:
                    # the prompt's last token alone: the worker ran it as a decode (one query
                    # token, as vLLM's kernels do), yet it is a prompt token prefilled
                    request.num_computed_prompt_tokens += 1
                    request.prefill_chunks.append((end_ns if start_ns is None else start_ns, end_ns, 1))
            if len(out_ids) >= request.max_tokens:
                finished.append(request)
        if finished:
            if len(finished) > 1 and out.scheduled_new_reqs:
                # vLLM frees in the schedule's order (running, then admitted), the worker samples
                # in the batch's (admitted first); the free order is the LRU order of their blocks
                new = {nr.request_id for nr in out.scheduled_new_reqs}
                finished.sort(key=lambda r: r.request_id in new)
            done = {r.request_id for r in finished}
            self.running = [r for r in self.running if r.request_id not in done]
            for request in finished:
                request.status = FINISHED
                self.kv_cache_manager.free(request)
                self._finished_since_last.append(request.request_id)
        return finished
