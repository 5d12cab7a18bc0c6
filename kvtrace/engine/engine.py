"""The engine loop: arrivals -> schedule -> worker -> clock -> update -> events.

``Engine(preset).run(workload, listeners)`` streams a workload (TraceRequests in arrival
order), runs it to completion on virtual time and returns summary metrics plus one
``RequestFinished`` per request. Each step, listeners receive one ``StepBatch``:
the ``StepExecuted``, that step's cache events, and the engine events (finished
requests, divergent outputs, stale hashes found by the audit).

Virtual time (integer ns, from ``Clock``; never the wall clock): a request is admitted
at the first step boundary at or after its arrival; a step starts when the previous one
ends (or, when idle, at the next arrival) and lasts what the cost model says; a token's
time is the end of the step that sampled it. TTFT = first token - arrival, ITL = every
gap between consecutive tokens, E2E = last token - arrival, queueing = start of the
first step that scheduled it - arrival. Throughput = output tokens / (end of the last
step - first arrival).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import islice
from operator import sub
from typing import Any

import numpy as np

from kvtrace.cache import CacheConfig, FullAttentionSpec, KVCacheManager, MambaSpec
from kvtrace.cache.events import COPY_EXTERNAL, BlockCopied, BlockEvicted, BlockPublished
from kvtrace.engine.arrays import TORCH_CPU
from kvtrace.engine.backends import BACKENDS, DEFAULT_BACKEND, VLLM
from kvtrace.engine.clock import Clock, CostModel, free_step_problem
from kvtrace.engine.config import SchedulerConfig
from kvtrace.engine.events import (
    DivergentOutput,
    FinishedRequests,
    RequestFinished,
    StepBatch,
    StepExecuted,
    StepListener,
)
from kvtrace.engine.presets import EnginePreset, get_preset
from kvtrace.engine.request import EngineRequest
from kvtrace.engine.scheduler import Scheduler
from kvtrace.engine.step import NoContentWorker
from kvtrace.errors import ConfigError, KVTraceError
from kvtrace.metrics import (
    DEFAULT_PERCENTILES,
    block_hits,
    hit_summary,
    latency_summary,
    parse_percentiles,
    request_latency_samples,
)
from kvtrace.names import shown_count, shown_value
from kvtrace.numeric import cdiv
from kvtrace.process import collector_paused, raise_stop, stop_pending
from kvtrace.workload import TraceRequest
from kvtrace.workload.lines import MAX_TIME_NS as MAX_TRACE_NS
from kvtrace.workload.lines import MAX_TOKENS, VOCAB_SIZE

# What a pool too small for a request says to do; a caller whose own flag sets the pool
# (curve's --capacities) says it in its words instead (replay.sweep)
POOL_ADVICE = "raise --capacity-blocks or --capacity-tokens (or cache.num_gpu_blocks in --config, wherever it was set)"


@dataclass
class EngineResult:
    summary: dict
    # (kept compactly: a finished request's gaps one array's 8 bytes each, not a tuple's ints)
    requests: FinishedRequests


_END = object()  # (the end of a workload: a None in it is no request, and no end either)


def _never_fits(cc: CacheConfig, num_tokens: int) -> bool:
    """Whether a request of ``num_tokens`` tokens needs more blocks than its pool holds however
    its prefill is chunked: each full-attention group keeps a block per ``block_size`` tokens to
    its end (a lower bound: sliding-window, Mamba and speculative blocks are left out). No
    later arrival lets such a request fit, so none is waited for (caching off, it was preempted
    and admitted again until the next arrival, a simulated day later for ever, then refused)."""
    need = [cdiv(num_tokens, s.block_size) if isinstance(s, FullAttentionSpec) else 0 for s in cc.groups]
    if cc.shared_pool:
        return sum(need) > cc.total_blocks
    return any(n > size for n, size in zip(need, cc.pool_sizes))


def _next_request(it) -> Any:
    """The workload's next request (None at its end), held to what the readers guarantee of
    one before the engine reads it: an API caller's NaN arrival hung the loop (no time is
    before or after it), a hash_ids list shorter than its prompt broke the worker, and a value
    of another type than the readers' (a numpy int, a list) was a traceback inside it."""
    r = next(it, _END)
    if r is _END:
        return None
    if not isinstance(r, TraceRequest):  # (a None ended the run there, unsaid; another object was an AttributeError)
        raise KVTraceError(f"workload: an item {shown_value(r)} of type {type(r).__name__}; expected a TraceRequest")
    name = r.request_id
    if not isinstance(name, str):
        raise KVTraceError(f"workload: a request id {shown_value(name)}; expected a string")
    a: Any = r.arrival_ns  # (an API caller's, of any type)
    if isinstance(a, bool) or (not isinstance(a, numbers.Integral) and not (
            isinstance(a, float) and math.isfinite(a) and a.is_integer())):
        raise _refused(r, f"arrives at {shown_value(a)} ns; expected a whole number of ns")
    if a >= MAX_TRACE_NS:  # (the readers' bound: later, the clock's overflow blamed the cost model)
        raise _refused(r, f"arrives at {shown_count(a)} ns; expected a time below 2^62 ns "
                       "(about 146 years)")
    for field in ("input_length", "output_length", "namespace"):  # (the readers' ints: others broke the worker)
        value = getattr(r, field)
        if type(value) is not int:
            raise _refused(r, f"has {field} {shown_value(value)}; expected an int")
        if value > MAX_TOKENS and field != "namespace":  # (as a trace file's: past it, beyond any context)
            raise _refused(r, f"has {field} {shown_count(value)}; expected at most {MAX_TOKENS:,} tokens")
    if r.cache_salt is not None and type(r.cache_salt) is not str:
        raise _refused(r, f"has cache_salt {shown_value(r.cache_salt)}; expected a string")
    if (r.token_ids is None) == (r.hash_ids is None):
        raise _refused(r, f"gives {'neither' if r.token_ids is None else 'both'} of "
                       "token_ids and hash_ids; expected exactly one")
    # token ids as the readers give them: whole numbers in [0, VOCAB_SIZE) (a uint64 id past it
    # made content mode report divergent outputs of a correct cache; an id of VOCAB_SIZE is
    # --no-content's sampled token; 1.5 was cut to 1; a string was a ValueError traceback)
    for field, ids in (("token_ids", r.token_ids), ("expected_output", r.expected_output)):
        if ids is not None and not _token_ids_ok(ids):
            raise _refused(r, f"has {field} that are not token ids; expected whole "
                           f"numbers in [0, {VOCAB_SIZE:,}), one list of them")
    if r.expected_output is not None and len(r.expected_output) != r.output_length:
        raise _refused(r, f"has {len(r.expected_output):,} expected_output tokens for "
                       f"output_length {r.output_length:,}; expected as many")
    if r.hash_ids is not None:
        size = r.hash_block_size
        if type(size) is not int or not 1 <= size <= MAX_TOKENS:
            raise _refused(r, f"has hash_block_size {shown_value(size)}; expected tokens per "
                           f"hash id, an int from 1 to {MAX_TOKENS:,}")
        if type(r.hash_ids) is not tuple or not all(type(h) is int for h in r.hash_ids):
            raise _refused(r, f"has hash_ids of {type(r.hash_ids).__name__}; expected "
                           "a tuple of int ids")
        # (one id a block, the last one partial too, as the readers give them)
        if len(r.hash_ids) != -(-r.input_length // size):
            raise _refused(r, f"has {len(r.hash_ids):,} hash_ids for input_length "
                           f"{r.input_length:,} at {size} tokens each; expected {-(-r.input_length // size):,}")
    return r


def _refused(r: TraceRequest, what: str) -> KVTraceError:
    """A request refused, its id quoted as ``shown_value`` quotes it (a str subclass's repr may
    raise): formatted only when refused, never for a request that passes."""
    return KVTraceError(f"workload: request {shown_value(r.request_id)} {what}")


def _token_ids_ok(ids: Any) -> bool:
    """Whether ``ids`` is one sequence of whole numbers in [0, VOCAB_SIZE)."""
    if isinstance(ids, (str, bytes)):
        return False
    if isinstance(ids, (list, tuple)) and any(isinstance(x, (bool, np.bool_)) for x in ids):
        return False  # (numpy makes [1, True, 3] ints: True ran as token 1, where a reader refuses true)
    try:
        a = np.asarray(ids)
    except (TypeError, ValueError, OverflowError):
        return False
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        return False
    return not a.size or (int(a.min()) >= 0 and int(a.max()) < VOCAB_SIZE)


class Engine:
    def __init__(
        self,
        preset: str | EnginePreset = "kimi-hybrid",
        *,
        cache_config: CacheConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        cost_model: CostModel | None = None,
        device=None,
        verify: bool = True,
        audit_interval: int = 1000,
        cpu_threads: int | None = 1,
        content: bool = True,
        percentiles: Sequence[float] = DEFAULT_PERCENTILES,
        backend: str = DEFAULT_BACKEND,
    ):
        if not isinstance(backend, str) or backend not in BACKENDS:
            raise KVTraceError(f"engine: unknown backend {shown_value(backend)}; expected one of {', '.join(BACKENDS)}")
        self.backend = backend
        if not isinstance(preset, (str, EnginePreset)):  # (an AttributeError at .name)
            raise KVTraceError(f"engine: preset {shown_value(preset)}; expected a preset's name or an EnginePreset")
        if not isinstance(content, bool):  # (content="no" ran with content)
            raise KVTraceError(f"engine: content {shown_value(content)}; expected True or False")
        if not isinstance(verify, bool):  # (verify="no" verified, and the summary counted what it found)
            raise KVTraceError(f"engine: verify {shown_value(verify)}; expected True or False")
        # (a string was a TypeError traceback at the first step; 1.5 audited at steps 3, 6, ...,
        # -1 at every step)
        if type(audit_interval) is not int or audit_interval < 0:
            raise KVTraceError(f"engine: audit_interval {shown_value(audit_interval)}; expected a number of steps, "
                               "an int >= 0 "
                               "(0: once, at the end)")
        if cpu_threads is not None and (type(cpu_threads) is not int or cpu_threads < 1):
            raise KVTraceError(f"engine: cpu_threads {shown_value(cpu_threads)}; expected an int >= 1, or None for "
                               "torch's own")
        p = get_preset(preset) if isinstance(preset, str) else preset
        self.preset_name = p.name
        # (None alone is the preset's: `or` gave {}, 0 or "" the preset's too, unsaid)
        self.cache_config = p.cache_config if cache_config is None else cache_config
        self.scheduler_config = p.scheduler_config if scheduler_config is None else scheduler_config
        self.cost_model = p.cost_model if cost_model is None else cost_model
        # (a dict was taken, and the run failed at its first step with an AttributeError)
        for name, given, kind in (("cache_config", self.cache_config, CacheConfig),
                                  ("scheduler_config", self.scheduler_config, SchedulerConfig)):
            if not isinstance(given, kind):
                raise KVTraceError(f"engine: {name} {shown_value(given)}; expected a {kind.__name__} (or None for "
                                   "the preset's)")
        if not isinstance(self.cost_model, CostModel):
            raise KVTraceError(f"engine: cost_model {shown_value(self.cost_model)}; expected a CostModel")
        problem = free_step_problem(self.cost_model)  # (what --config refuses: 0-ns steps)
        if problem is not None:
            raise ConfigError("engine", "cost_model", problem)
        self.device = device
        self.verify = verify
        # content=False: no device storage, content model or checks (hits and timings only;
        # see kvtrace.engine.step.NoContentWorker)
        self.content = content
        self.audit_interval = audit_interval
        # For the torch path on the CPU (torch:cpu): per-step tensors are small, and torch's
        # intra-op threads only add spin-waits (measured 5x slower on the shared 2-core box).
        # None leaves torch's setting alone. (numpy, the CPU's default path, runs one thread.)
        self.cpu_threads = cpu_threads
        # of every latency in the summary (vllm bench serve's), held to what --percentiles takes
        # before the run: 101 or a string was numpy's ValueError or TypeError after the whole run
        try:  # (None, 50: tuple()'s TypeError)
            self.percentiles = () if isinstance(percentiles, (str, bytes)) else tuple(percentiles)
        except TypeError:
            self.percentiles = ()
        odd = next((q for q in self.percentiles if isinstance(q, bool) or not isinstance(q, numbers.Real)), None)
        if not self.percentiles or odd is not None:
            raise ConfigError("engine", "percentiles",
                              f"{shown_value(percentiles)}: expected a sequence of numbers from 0 to 100")
        # (a Fraction or a Decimal: numpy's TypeError after the run) as floats, ints and floats kept
        self.percentiles = tuple(q if isinstance(q, (int, float)) else float(q) for q in self.percentiles)
        try:
            parse_percentiles(self.percentiles)
        except ValueError as err:
            raise ConfigError("engine", "percentiles", str(err)) from None

    def run(self, workload: Iterable[TraceRequest], listeners: Sequence[StepListener] = ()) -> EngineResult:
        # No cyclic collection during the run (0.92x its wall): the engine and its backends make
        # no garbage cycles per request (tests/engine/test_presets_and_clock.py counts them),
        # so the collector's passes would only walk live objects; what cycles a listener makes
        # are collected after the run.
        # (an API caller's workload that is no iterable, or listeners that are not callables, were
        # a TypeError traceback, the latter after the first step; a numpy array of them, a ValueError)
        if isinstance(workload, (str, bytes)) or not isinstance(workload, Iterable):
            raise KVTraceError(f"engine: workload {shown_value(workload)}; expected an iterable of TraceRequests")
        if isinstance(listeners, (str, bytes)) or not isinstance(listeners, Iterable):
            raise KVTraceError(f"engine: listeners {shown_value(listeners)}; expected a sequence of callables taking "
                               "a StepBatch")
        try:
            listeners = tuple(listeners)
        except Exception:  # (whatever a caller's __iter__ raises: said in one line)
            raise KVTraceError(f"engine: listeners {shown_value(listeners)} cannot be iterated; expected a sequence "
                               "of callables taking a StepBatch") from None
        odd = [x for x in listeners if not callable(x)]
        if odd:
            raise KVTraceError(f"engine: listener {shown_value(odd[0])} is not callable; expected callables taking a "
                               "StepBatch")
        with collector_paused():
            if not self.content:
                return self._run(workload, listeners, None)
            return self._run_with_content(workload, listeners)

    def _run_with_content(self, workload: Iterable[TraceRequest], listeners: Sequence[StepListener]) -> EngineResult:
        from kvtrace.engine.memory import check_device
        from kvtrace.engine.storage import default_device

        # (a device torch cannot use was its RuntimeError or CUDA assertion at the first allocation)
        device = check_device(str(self.device), "engine device") if self.device is not None else default_device()
        if device == "cpu":  # numpy arrays (kvtrace.engine.arrays): no torch at all
            return self._run(workload, listeners, device)
        import torch

        saved = torch.get_num_threads()
        if self.cpu_threads and device == TORCH_CPU:
            torch.set_num_threads(self.cpu_threads)
        try:
            # no autograd bookkeeping: about a fifth of each small op's cost, and nothing here
            # needs gradients (every tensor of the run is made and used inside)
            with torch.inference_mode():
                return self._run(workload, listeners, device)
        finally:
            torch.set_num_threads(saved)

    def _run(self, workload, listeners, device) -> EngineResult:
        cc = self.cache_config
        manager = self._manager()
        cache_events: list = []
        manager.subscribe(cache_events.extend)
        worker, auditor = self._worker(device)
        scheduler = Scheduler(self.scheduler_config, cc, manager)
        clock = Clock(self.cost_model)
        # a request loading from the external tier loads each state group's recurrent state
        state_groups = sum(isinstance(g, MambaSpec) for g in cc.groups)
        live: dict[str, EngineRequest] = {}
        records = FinishedRequests()
        stats: dict[str, Any] = {"publishes": 0, "evictions": 0, "cow_copies": 0, "divergent_outputs": 0,
                                 "stale_hashes": 0, "table_disagreements": 0, "steps": 0}
        by_reason: dict[str, int] = {}
        max_model_len = self.scheduler_config.max_model_len
        it = iter(workload)
        pending = _next_request(it)
        last_arrival = -1
        # The number of the step last executed. Steps are numbered from 0, as the cache's own
        # step index (``manager.step``, the events' ``step``) counts them: numbered from 1, every
        # cache span of step k lay in the time window of the step span numbered k + 1.
        step = -1
        stopped = stop_pending  # (a local: the loop's one check a step)

        def admit() -> None:
            nonlocal pending, last_arrival
            while pending is not None and pending.arrival_ns <= clock.now_ns:
                if pending.arrival_ns < 0:  # (the first request: there is no previous one to blame)
                    raise KVTraceError(f"workload: request {shown_value(pending.request_id)} arrives at "
                                       f"{pending.arrival_ns} ns; expected a time >= 0")
                if pending.arrival_ns < last_arrival:
                    raise KVTraceError(f"workload: request {shown_value(pending.request_id)} arrives before the "
                                       "previous one")
                if pending.request_id in live:
                    # (the scheduler, the worker and the records key requests by id: the second one
                    # replaced the first, which was never finished (no content), or the worker's
                    # table of it broke (a ValueError))
                    raise KVTraceError(f"workload: request {shown_value(pending.request_id)} arrives while an earlier "
                                       "request of that id is still in flight; expected unique request ids")
                if pending.input_length < 1:
                    raise KVTraceError(f"workload: request {shown_value(pending.request_id)} has a prompt of "
                                       f"{pending.input_length} tokens; expected at least 1")
                last_arrival = pending.arrival_ns
                req = EngineRequest(pending)
                if req.num_prompt_tokens != pending.input_length:  # (the limits below read input_length)
                    raise KVTraceError(f"workload: request {shown_value(pending.request_id)} has input_length "
                                       f"{pending.input_length:,} and {req.num_prompt_tokens:,} prompt token ids; "
                                       "expected as many")
                # at least one token is generated (EngineRequest.max_tokens): vLLM refuses a prompt
                # of max_model_len tokens, which has no room for it
                if pending.input_length + max(pending.output_length, 1) > max_model_len:
                    asked = f"{pending.output_length:,} output tokens" + (
                        " (1 is generated)" if pending.output_length < 1 else "")
                    raise KVTraceError(
                        f"request {pending.request_id}: {pending.input_length:,} prompt + {asked} exceed "
                        f"max_model_len {max_model_len:,} (raise [scheduler] max_model_len in --config, or drop "
                        "the request)"
                    )
                live[req.request_id] = req
                scheduler.add_request(req)
                pending = _next_request(it)

        lone_preempted: dict[str, int] = {}  # request id -> tokens it had when it last preempted itself alone
        while True:
            if stopped():  # Ctrl-C or SIGTERM whose KeyboardInterrupt a finalizer swallowed: stop here
                raise_stop()
            admit()
            if not scheduler.has_unfinished_requests():
                if pending is None:
                    break
                clock.advance_to(pending.arrival_ns)
                continue
            out = scheduler.schedule()
            if out.total_num_scheduled_tokens == 0:
                sc = self.scheduler_config
                # A request alone takes the whole budget a step: vLLM cuts a long prefill at
                # long_prefill_token_threshold only while another request waits, so the next arrival
                # may let it fit (a sliding window's blocks, an unchunked prompt). Until then it is
                # replayed as vLLM does, preempted and admitted again, or it waits idle (it was refused
                # as a request the pool cannot hold, which it finished once a request arrived first)
                lone = scheduler.lone_preemption
                may_fit_later = False
                if pending is not None and len(scheduler.waiting) == 1 and not scheduler.running:
                    head = scheduler.waiting[0]
                    thr = sc.long_prefill_token_threshold
                    # (what it must still compute, from where it preempted itself: a decode, or a rest
                    # the threshold would not cut, fits no better beside another request)
                    rest = head.num_tokens - (lone[1] if lone is not None and lone[0] == head.request_id else 0)
                    may_fit_later = (0 < thr < rest and thr <= sc.max_num_batched_tokens
                                     and not _never_fits(cc, head.num_tokens))
                if out.preempted_req_ids and (lone is None or may_fit_later
                                              or lone_preempted.get(lone[0], -1) < lone[1]):
                    # every running request preempted: the next schedule, at this time, takes the
                    # waiting ones (a step with a preemption admits none). One that preempted itself
                    # alone where it did before cannot fit: refused below, not replayed for ever
                    # (each replay of it takes a step at least: the clock reaches the next arrival)
                    if lone is not None:
                        lone_preempted[lone[0]] = lone[1]
                    continue
                if may_fit_later and pending is not None:
                    clock.advance_to(pending.arrival_ns)
                    continue
                # Nothing can run, and nothing a later arrival brings changes that: it queues behind
                # the waiting head (FCFS) and the cache is idle. The run is refused now: it waited,
                # idle, for the rest of the trace first, holding every request (a generated workload
                # without end never finished)
                stuck = scheduler.waiting[0] if scheduler.waiting else None
                what = (f"request {stuck.request_id} ({stuck.num_prompt_tokens:,} prompt tokens)" if stuck
                        else "no request")
                if stuck and scheduler.unchunked_wait > sc.max_num_batched_tokens:
                    # a whole prefill per step (vLLM refuses such a config up front). What it must
                    # prefill, not its prompt: a preempted request recomputes its output too
                    if scheduler.unchunked_wait > stuck.num_prompt_tokens:
                        what = (f"request {stuck.request_id} ({stuck.num_prompt_tokens:,} prompt tokens, "
                                f"{scheduler.unchunked_wait:,} to prefill again after a preemption)")
                    raise KVTraceError(
                        f"engine: {what} cannot be scheduled: without chunked prefill a prompt must fit one step's "
                        f"max_num_batched_tokens {sc.max_num_batched_tokens:,} (raise [scheduler] "
                        "max_num_batched_tokens in --config, or set enable_chunked_prefill = true)"
                    )
                if stuck and stuck.num_tokens > stuck.num_prompt_tokens:
                    # preempted after its first tokens: it must hold them too, so its prompt alone
                    # (which fits) would not explain the refusal
                    what = (f"request {stuck.request_id} ({stuck.num_prompt_tokens:,} prompt tokens and "
                            f"{stuck.num_tokens - stuck.num_prompt_tokens:,} generated before a preemption, "
                            f"{stuck.num_tokens:,} to hold again)")
                pools = (cc.total_blocks,) if cc.shared_pool else cc.pool_sizes
                raise KVTraceError(
                    f"engine: {what} cannot be scheduled: it needs more KV blocks than the pool holds "
                    f"(num_gpu_blocks {', '.join(map(str, pools))}); {POOL_ADVICE}"
                )
            step += 1
            res = worker.execute(out)
            loads = [nr.num_external_tokens for nr in out.scheduled_new_reqs if nr.num_external_tokens]
            start_ns, end_ns = clock.run_step(
                num_tokens=out.total_num_scheduled_tokens,
                prefill_pairs=res.prefill_pairs,
                decode_context_tokens=res.decode_context_tokens,
                num_decode_seqs=res.num_decode_seqs,
                num_kv_copies=res.num_kv_copies,
                num_state_copies=res.num_state_copies,
                num_kv_loads=sum(loads),
                num_state_loads=len(loads) * state_groups,
            )
            for nr in out.scheduled_new_reqs:
                if nr.request.first_scheduled_ns < 0:
                    nr.request.first_scheduled_ns = start_ns
            for rid, st, n in res.prefill_spans:
                req = live[rid]
                req.prefill_chunks.append((start_ns, end_ns, n))
                if st < req.num_prompt_tokens:
                    req.num_computed_prompt_tokens += min(st + n, req.num_prompt_tokens) - st
            engine_events: list = []
            for d in res.divergences:
                live[d.request_id].num_divergent_tokens += 1
                engine_events.append(DivergentOutput(step, end_ns, d.request_id, d.position, d.expected, d.actual))
            stats["divergent_outputs"] += len(res.divergences)
            stats["table_disagreements"] += res.table_disagreements
            finished = scheduler.update_from_output(out, res.sampled, end_ns, start_ns)
            manager.new_step_starts()
            batch_events = list(cache_events)
            cache_events.clear()
            for ev in batch_events:
                if isinstance(ev, BlockPublished):
                    stats["publishes"] += len(ev.block_ids)
                elif isinstance(ev, BlockEvicted):
                    stats["evictions"] += len(ev.block_ids)
                    by_reason[ev.reason] = by_reason.get(ev.reason, 0) + len(ev.block_ids)
                elif isinstance(ev, BlockCopied) and ev.why != COPY_EXTERNAL:
                    stats["cow_copies"] += 1  # (an external-tier load is a copy event, not a CoW: 852 of 975)
            if auditor is not None:
                auditor.on_published(batch_events, live)
                if self.audit_interval and (step + 1) % self.audit_interval == 0:
                    found = auditor.audit(manager.cached_entries(), step, end_ns)
                    engine_events.extend(found)
            for req in finished:
                record = self._record(req)
                records.append(record)  # (kept without its tuple: the event alone carries it)
                engine_events.append(record)
                del live[req.request_id]
                worker.forget(req.request_id)
                if auditor is not None:
                    auditor.forget_request(req.request_id)
                req.release_tokens()
            if listeners:
                usage = manager.usage  # each group's share of the pool (they sum to its usage)
                se = StepExecuted(step, start_ns, end_ns, res.num_prefill_tokens, res.num_decode_seqs,
                                  len(scheduler.running), len(scheduler.waiting), len(out.block_copies),
                                  len(out.preempted_req_ids), usage)
                batch = StepBatch(se, batch_events, engine_events)
                for listener in listeners:
                    listener(batch)

        if auditor is not None:
            last = max(step, 0)  # (the final audit's, in the last step's number)
            found = auditor.audit(manager.cached_entries(), last, clock.now_ns)
            if found and listeners:
                se = StepExecuted(last, clock.now_ns, clock.now_ns, 0, 0, 0, 0, 0, 0, ())
                for listener in listeners:
                    listener(StepBatch(se, (), found))
            stats["stale_hashes"] = auditor.num_stale
        if auditor is None:  # no content checked (--no-content): not measured, not a count of 0
            stats["stale_hashes"] = stats["divergent_outputs"] = stats["table_disagreements"] = None
        stats["steps"] = step + 1
        stats["preemptions"] = scheduler.num_preemptions
        stats["evictions_by_reason"] = dict(sorted(by_reason.items()))
        stats["stale_hashes_left"] = manager.stats.stale_hash_left  # the cache's own count (switch off)
        return EngineResult(self._summary(records, stats, clock.now_ns), records)

    def _manager(self) -> Any:
        """The cache manager of this engine's backend (see ``kvtrace.engine.backends``)."""
        if self.backend == VLLM:
            from kvtrace.engine.backends.vllm.engine_manager import VllmEngineManager

            sc = self.scheduler_config
            return VllmEngineManager(self.cache_config, max_model_len=sc.max_model_len,
                                     max_num_batched_tokens=sc.max_num_batched_tokens,
                                     long_prefill_token_threshold=sc.long_prefill_token_threshold)
        return KVCacheManager(self.cache_config)

    def _worker(self, device):
        """(the worker, the stale-hash auditor or None) for this engine's mode."""
        cc = self.cache_config
        if not self.content:
            return NoContentWorker(cc), None
        from kvtrace.engine.audit import StaleHashAuditor
        from kvtrace.engine.storage import DeviceStorage
        from kvtrace.engine.worker import Worker

        storage = DeviceStorage(cc, device)
        worker = Worker(cc, storage, verify=self.verify)
        return worker, (StaleHashAuditor(cc, storage, worker.oracle) if self.verify else None)

    @staticmethod
    def _record(req: EngineRequest) -> RequestFinished:
        times = req.token_times_ns
        itl = tuple(map(sub, islice(times, 1, None), times))  # each gap (a C loop: a token each)
        return RequestFinished(
            request_id=req.request_id,
            session_id=req.session_id,
            arrival_ns=req.arrival_ns,
            first_scheduled_ns=req.first_scheduled_ns,
            first_token_ns=req.first_token_ns,
            finish_ns=times[-1],
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=len(req.output_token_ids),
            num_local_hit_tokens=max(req.num_local_hit_tokens, 0),
            num_external_hit_tokens=req.num_external_hit_tokens,
            num_computed_prompt_tokens=req.num_computed_prompt_tokens,
            num_preemptions=req.num_preemptions,
            num_divergent_tokens=req.num_divergent_tokens,
            itl_ns=itl,
            prefill_chunks=tuple(req.prefill_chunks),
            num_external_query_tokens=req.num_external_query_tokens,
            num_preempted_query_tokens=req.num_preempted_query_tokens,
            num_preempted_hit_tokens=req.num_preempted_hit_tokens,
        )

    def _summary(self, finished: FinishedRequests, stats: dict, end_ns: int) -> dict:
        records = finished.without_gaps()  # (every field but the gaps: no tuple made again)
        outputs = sum(r.num_output_tokens for r in records)
        first_arrival = min((r.arrival_ns for r in records), default=0)
        # Neither is rounded: 3 output tokens over 10,000 modelled seconds read 0.0 tokens/s (a run
        # that generated nothing), and the duration in whole microseconds was not what the
        # throughput divided by (the table shows a few significant digits of a small one)
        span_s = max(end_ns - first_arrival, 0) / 1e9  # (0 for a run of no request, not 1 ns)
        return {
            "preset": self.preset_name,
            "backend": self.backend,
            "cost_model": self.cost_model.name,  # every time below is modelled by it
            # (in the unit group's blocks, as block_size and capacity_blocks are: group 0's were
            # 64-token blocks beside a block_size of 16 where a Mamba group came first)
            **request_metrics(finished, self.cache_config.groups[self.cache_config.unit_group or 0].block_size,
                              self.percentiles),
            "output_tokens": outputs,
            "computed_prompt_tokens": sum(r.num_computed_prompt_tokens for r in records),
            "output_tok_per_s": outputs / max(span_s, 1e-9),
            "virtual_duration_s": span_s,
            **stats,
        }


def request_metrics(records: Sequence[RequestFinished], block_size: int,
                    percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict:
    """The per-request metrics of a run summary, all from ``kvtrace.metrics``: requests,
    prompt tokens, vLLM's hit counters and rates, the block hit rate, and every latency
    statistic (modelled time) at ``percentiles``. (A ``FinishedRequests`` is read as it is
    kept: its ITL samples the one array of gaps, no int object made a gap.)"""
    gaps = None
    if isinstance(records, FinishedRequests):
        gaps = records.all_gaps
        records = records.without_gaps()
    samples: dict[str, Sequence[float]] = dict(request_latency_samples(records))
    if gaps is not None:  # (the same gaps, request after request: the samples are sorted first)
        samples["itl"] = gaps
    hit_blocks = sum((r.num_local_hit_tokens + r.num_external_hit_tokens) // block_size for r in records)
    blocks = sum(cdiv(r.num_prompt_tokens, block_size) for r in records)
    return {
        "requests": len(records),
        "prompt_tokens": sum(r.num_prompt_tokens for r in records),
        **hit_summary(records),
        **block_hits(hit_blocks, blocks),
        **latency_summary(samples, percentiles),
    }
