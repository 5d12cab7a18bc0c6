"""kvtrace's engine scheduler beside vLLM 0.33's own ``Scheduler``, step by step (test-only).

``kvtrace conformance`` compares the cache managers under a driver that imitates vLLM's
``Scheduler.schedule``; this compares the schedulers themselves. One workload goes to
both: kvtrace's ``kvtrace.engine.scheduler.Scheduler`` over its ``KVCacheManager`` (the
engine's ``--no-content`` worker, or its content worker) and vLLM's
``vllm.v1.core.sched.scheduler.Scheduler`` over its own manager, fed a
``ModelRunnerOutput`` each step that samples, for every request whose scheduled tokens
reach its known tokens (what vLLM's model runner does), the token kvtrace appended: the
trace's recorded output when it has one, else its worker's (``NO_CONTENT_TOKEN`` without content; with
``SchedulerCase.content``, the engine's content worker's). Requests arrive in
trace order, at most ``concurrency`` in the system (decode steps, queues and pressure).

Compared each step (``FIELDS``): the scheduled requests and their tokens
(``num_scheduled_tokens``), the new / resumed / running split and its order, each
scheduled request's ``num_computed_tokens`` before the step (its prefix hit on
admission), the preempted requests, the waiting and running queues after the step, the
requests that sampled and those that finished, and the cumulative prefix-cache counters
(vLLM's ``PrefixCacheStats`` from ``make_stats``; kvtrace's from ``kvtrace.metrics``
over the requests admitted so far). The first disagreement stops the run (the two
schedulers no longer see the same state).

vLLM's ``Scheduler`` needs a whole ``VllmConfig``: its ``ModelConfig`` is read from a
hand-written ``config.json`` naming a stand-in architecture registered here (no weights,
no download; vLLM inspects only its interface). What kvtrace deliberately lacks is off
in vLLM: async scheduling, spec decode, structured output, LoRA, connectors. Both have
vLLM's full-sequence admission gate (``scheduler_reserve_full_isl``, on by default);
``SchedulerCase.reserve_full_isl`` sets it in both.

Only vLLM's backend package may import vLLM inside ``kvtrace`` (tests/test_layering.py);
this driver is test support, so it imports vLLM's scheduler and configs itself.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from kvtrace.cache import CacheConfig, KVCacheManager, MambaSpec
from kvtrace.engine.backends.vllm import VllmAPI, vllm_cache_setup
from kvtrace.engine.backends.vllm.manager import init_none_hash
from kvtrace.engine.config import SchedulerConfig
from kvtrace.engine.presets import get_preset
from kvtrace.engine.request import EngineRequest
from kvtrace.engine.scheduler import DecodeRun, Scheduler
from kvtrace.engine.step import NoContentWorker
from kvtrace.metrics import hit_counters
from kvtrace.replay.run import RunSpec, open_workload

FIELDS = ("scheduled", "new", "resumed", "running_scheduled", "computed_before", "preempted", "waiting", "running",
          "sampled", "finished", "prefix_cache_stats")
# kvtrace.metrics counter -> vLLM's PrefixCacheStats field
STATS = {"prefix_cache_queries": "queries", "prefix_cache_hits": "hits",
         "preempted_prefix_cache_queries": "preempted_queries", "preempted_prefix_cache_hits": "preempted_hits"}
ARCH = "KvtraceSchedulerProbeForCausalLM"


@dataclass(slots=True)
class SchedulerCase:
    """One comparison: a workload, a preset with overrides, a pool."""

    trace: str  # gen:NAME or a trace path
    preset: str = "dense-attention"
    capacity_blocks: int = 2000
    limit: int | None = 40
    seed: int = 0
    concurrency: int = 16
    max_output_tokens: int = 24  # outputs capped (decode steps cost time, not coverage)
    cache_overrides: dict[str, Any] = field(default_factory=dict)
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    max_model_len: int = 65536
    reserve_full_isl: bool = True  # the full-sequence admission gate, in both (vLLM's default)
    # with caching off vLLM records no lookup (prefix_cache_queries 0); kvtrace's counters
    # count every prompt: a known difference of kvtrace.metrics, compared unless this is off
    compare_stats: bool = True
    content: bool = False  # the engine's content worker (writes and checks every block) instead of --no-content's
    max_steps: int = 20_000


@dataclass(slots=True)
class Mismatch:
    step: int
    field: str
    vllm: Any
    kvtrace: Any

    def __str__(self) -> str:
        return f"step {self.step}: {self.field}: vLLM {self.vllm!r} != kvtrace {self.kvtrace!r}"


@dataclass(slots=True)
class SchedulerRun:
    case: SchedulerCase
    steps: int = 0
    compared: Counter = field(default_factory=Counter)
    first: Mismatch | None = None
    requests: int = 0  # admitted to both
    skipped: int = 0  # longer than max_model_len: neither gets it
    finished: int = 0
    preemptions: int = 0
    chunks: int = 0  # prefill chunks that did not reach the end of their prompt
    resumed: int = 0
    hit_tokens: int = 0
    max_running: int = 0
    waited_for_seqs: int = 0  # steps with max_num_seqs running and someone waiting
    divergences: int = 0  # content mode: outputs the worker found differ from the no-cache reference
    mixed_finishes: int = 0  # steps where a request admitted in the step and a running one both finished
    stats: dict[str, int] = field(default_factory=dict)
    stuck: str | None = None  # the waiting head neither could ever schedule (larger than the pool)
    gate_refusals: int = 0  # admissions kvtrace's full-sequence gate refused

    @property
    def agree(self) -> bool:
        return self.first is None

    def report(self) -> str:
        c = self.case
        head = (f"{c.trace} {c.preset} pool {c.capacity_blocks} budget {c.max_num_batched_tokens} seqs "
                f"{c.max_num_seqs} thr {c.long_prefill_token_threshold} chunked {c.enable_chunked_prefill}: "
                f"{self.steps} steps, {self.requests} requests, {self.finished} finished, {self.preemptions} "
                f"preemptions, {self.chunks} partial chunks, {self.resumed} resumptions, {self.hit_tokens} hit tokens")
        head += f", {self.gate_refusals} gate refusals"
        if self.stuck:
            head += f", stuck at {self.stuck}"
        return head + ("" if self.first is None else f"; FIRST DISAGREEMENT {self.first}")


class _Stop(Exception):
    pass


# -- vLLM's side ------------------------------------------------------------------------------

@functools.cache
def _register_architecture() -> None:
    """A stand-in model class: what ModelConfig inspects (vLLM's interfaces), nothing to run."""
    import torch.nn as nn
    from vllm import ModelRegistry

    class KvtraceSchedulerProbeForCausalLM(nn.Module):
        def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
            super().__init__()

        def embed_input_ids(self, input_ids: Any) -> Any:
            raise NotImplementedError

        def forward(self, input_ids: Any, positions: Any) -> Any:
            raise NotImplementedError

        def compute_logits(self, hidden_states: Any) -> Any:
            raise NotImplementedError

    ModelRegistry.register_model(ARCH, KvtraceSchedulerProbeForCausalLM)


@functools.cache
def _model_root() -> tempfile.TemporaryDirectory[str]:
    return tempfile.TemporaryDirectory(prefix="kvtrace-sched-")  # (removed at exit)


@functools.cache
def _model_dir(max_model_len: int) -> str:
    """The probe model's config.json for ``max_model_len``: one folder per length, all in one
    temporary folder that goes at exit (a folder per case left thousands in /tmp)."""
    model_dir = os.path.join(_model_root().name, str(max_model_len))
    os.makedirs(model_dir)
    with open(os.path.join(model_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump({"architectures": [ARCH], "model_type": "llama", "hidden_size": 64, "num_attention_heads": 1,
                   "num_key_value_heads": 1, "num_hidden_layers": 1, "intermediate_size": 128, "vocab_size": 65536,
                   "max_position_embeddings": max_model_len, "torch_dtype": "float16"}, f)
    return model_dir


def vllm_scheduler(api: VllmAPI, cc: CacheConfig, sc: SchedulerConfig) -> Any:
    """vLLM 0.33's ``Scheduler`` for kvtrace's configuration (stats on, synchronous)."""
    from vllm.config import CacheConfig as VCacheConfig
    from vllm.config import ModelConfig, VllmConfig
    from vllm.config import SchedulerConfig as VSchedulerConfig
    from vllm.v1.structured_output import StructuredOutputManager

    _register_architecture()
    setup = vllm_cache_setup(api, cc)
    model_dir = _model_dir(sc.max_model_len)
    mc = ModelConfig(model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True, max_model_len=sc.max_model_len,
                     dtype="float16", seed=0)
    vsc = VSchedulerConfig(max_num_seqs=sc.max_num_seqs, max_num_batched_tokens=sc.max_num_batched_tokens,
                           max_model_len=sc.max_model_len, enable_chunked_prefill=sc.enable_chunked_prefill,
                           long_prefill_token_threshold=sc.long_prefill_token_threshold, is_encoder_decoder=False,
                           async_scheduling=False, scheduler_reserve_full_isl=sc.scheduler_reserve_full_isl)
    mamba = any(isinstance(s, MambaSpec) for s in cc.groups)
    vcc = VCacheConfig(block_size=min(s.block_size for s in cc.groups), enable_prefix_caching=cc.enable_caching,
                       mamba_cache_mode="align" if mamba else "none")
    vcc.num_gpu_blocks = cc.total_blocks  # (one shared pool: vllm_cache_setup refuses the rest)
    vc = VllmConfig(model_config=mc, scheduler_config=vsc, cache_config=vcc)
    init_none_hash(api, setup.hash_fn)
    module = api.kv_cache_manager_module
    factory = module.get_kv_cache_coordinator
    if not setup.allow_partial_hash_hits:  # (as VllmKVCacheManager builds its manager)
        module.get_kv_cache_coordinator = functools.partial(factory, allow_partial_hash_hits=False)
    try:
        sched = api.Scheduler(vllm_config=vc, kv_cache_config=setup.kv_cache_config,
                              structured_output_manager=StructuredOutputManager(vc),
                              block_size=setup.scheduler_block_size, hash_block_size=setup.hash_block_size,
                              log_stats=True)
    finally:
        module.get_kv_cache_coordinator = factory
    sched.kvtrace_hasher = api.get_request_block_hasher(setup.hash_block_size, setup.hash_fn)
    return sched


# -- the driver -------------------------------------------------------------------------------

class _Driver:
    def __init__(self, case: SchedulerCase, api: VllmAPI):
        self.case = case
        self.api = api
        preset = get_preset(case.preset)
        cc = replace(preset.cache_config, num_gpu_blocks=case.capacity_blocks, hash_fn="sha256_cbor",
                     **case.cache_overrides)
        sc = SchedulerConfig(max_num_batched_tokens=case.max_num_batched_tokens, max_num_seqs=case.max_num_seqs,
                             long_prefill_token_threshold=case.long_prefill_token_threshold,
                             max_model_len=case.max_model_len, enable_chunked_prefill=case.enable_chunked_prefill,
                             scheduler_reserve_full_isl=case.reserve_full_isl)
        self.cc, self.sc = cc, sc
        self.kv = KVCacheManager(cc)
        self.ours = Scheduler(sc, cc, self.kv)
        if case.content:
            from kvtrace.engine.storage import DeviceStorage
            from kvtrace.engine.worker import Worker

            self.worker: Any = Worker(cc, DeviceStorage(cc, "cpu"), verify=True)
        else:
            self.worker = NoContentWorker(cc)
        self.theirs = vllm_scheduler(api, cc, sc)
        self.run = SchedulerRun(case)
        self.admitted: list[EngineRequest] = []  # every kvtrace request given to the scheduler
        self.by_id: dict[str, EngineRequest] = {}
        self.theirs_stats: Counter = Counter()

    def compare(self, name: str, vllm_value: Any, kvtrace_value: Any) -> None:
        self.run.compared[name] += 1
        if vllm_value != kvtrace_value:
            self.run.first = Mismatch(self.run.steps, name, vllm_value, kvtrace_value)
            raise _Stop

    def drive(self) -> SchedulerRun:
        case = self.case
        workload = open_workload(RunSpec(case.trace, limit=case.limit, seed=case.seed))
        arrivals = iter(workload.requests)
        pending = next(arrivals, None)
        ours, theirs = self.ours, self.theirs
        try:
            while True:
                while pending is not None and len(ours.running) + len(ours.waiting) < case.concurrency:
                    self._add(pending)
                    pending = next(arrivals, None)
                if not ours.has_unfinished_requests():
                    self.compare("drained", theirs.has_unfinished_requests(), False)  # vLLM done too
                    break
                if self.run.steps >= case.max_steps:
                    raise AssertionError(f"{case}: no end after {case.max_steps} steps")
                self.run.steps += 1
                if not self._step():
                    break
        except _Stop:
            pass
        self.run.gate_refusals = self.kv.num_full_sequence_refusals
        return self.run

    def _add(self, trace: Any) -> None:
        out = max(1, min(int(trace.output_length), self.case.max_output_tokens))
        if trace.input_length + out > self.sc.max_model_len:
            self.run.skipped += 1
            return
        trace = replace(trace, output_length=out)
        req = EngineRequest(trace)
        self.ours.add_request(req)
        self.admitted.append(req)
        self.by_id[req.request_id] = req
        api = self.api
        twin = api.Request(request_id=trace.request_id, prompt_token_ids=trace.prompt_token_ids().tolist(),
                           sampling_params=api.SamplingParams(max_tokens=out, ignore_eos=True), pooling_params=None,
                           block_hasher=self.theirs.kvtrace_hasher, cache_salt=trace.cache_salt)
        self.theirs.add_request(twin)
        self.run.requests += 1

    def _step(self) -> bool:
        """One step of both; False when neither can schedule anything and nothing runs (the
        waiting head needs more than the pool: the engine refuses the run there)."""
        from vllm.v1.outputs import ModelRunnerOutput

        ours, theirs, run = self.ours, self.theirs, self.run
        waiting_before = len(ours.waiting)
        kv_out = ours.schedule()
        v_out = theirs.schedule()

        # the schedule
        self.compare("scheduled", dict(v_out.num_scheduled_tokens), dict(kv_out.num_scheduled_tokens))
        k_new = [nr.request_id for nr in kv_out.scheduled_new_reqs if nr.request.num_preemptions == 0]
        k_resumed = [nr.request_id for nr in kv_out.scheduled_new_reqs if nr.request.num_preemptions > 0]
        k_running: list[str] = []
        k_before: dict[str, int] = {nr.request_id: nr.num_computed_tokens for nr in kv_out.scheduled_new_reqs}
        for cr in kv_out.scheduled_cached_reqs:
            if isinstance(cr, DecodeRun):
                k_running += [r.request_id for r in cr.requests]
                k_before.update({r.request_id: s for r, s in zip(cr.requests, cr.starts)})
            else:
                k_running.append(cr.request_id)
                k_before[cr.request_id] = cr.num_computed_tokens
        cached = v_out.scheduled_cached_reqs
        v_resumed = [rid for rid in cached.req_ids if rid in cached.resumed_req_ids]
        self.compare("new", [nr.req_id for nr in v_out.scheduled_new_reqs], k_new)
        self.compare("resumed", v_resumed, k_resumed)
        self.compare("running_scheduled", [rid for rid in cached.req_ids if rid not in cached.resumed_req_ids],
                     k_running)
        v_before = {nr.req_id: nr.num_computed_tokens for nr in v_out.scheduled_new_reqs}
        v_before.update(zip(cached.req_ids, cached.num_computed_tokens))
        self.compare("computed_before", v_before, k_before)
        self.compare("preempted", sorted(v_out.preempted_req_ids), sorted(kv_out.preempted_req_ids))
        if kv_out.total_num_scheduled_tokens == 0 and not ours.running:
            run.stuck = ours.waiting[0].request_id
            return False

        # the worker: kvtrace's (what the engine runs); vLLM's model runner samples where a
        # request's scheduled tokens reach its known ones, the token kvtrace appended (the
        # recorded output where the trace has one, else the worker's)
        res = self.worker.execute(kv_out)
        ids = list(v_out.num_scheduled_tokens)
        v_samples = [rid for rid in ids if theirs.requests[rid].num_computed_tokens >= theirs.requests[rid].num_tokens]
        self.compare("sampled", sorted(v_samples), sorted(res.sampled))
        run.divergences += len(getattr(res, "divergences", ()))
        finished = ours.update_from_output(kv_out, res.sampled, run.steps)
        tokens = {rid: self.by_id[rid].output_token_ids[-1] for rid in v_samples}
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=[[tokens[rid]] if rid in tokens else [] for rid in ids])
        eco = theirs.update_from_output(v_out, mro)
        self.compare("finished", sorted(theirs.finished_req_ids), sorted(r.request_id for r in finished))
        for req in finished:
            self.worker.forget(req.request_id)
        self.kv.new_step_starts()  # (the engine's call between steps; vLLM's is in schedule)

        # the queues after the step
        self.compare("waiting", [r.request_id for r in theirs.waiting], [r.request_id for r in ours.waiting])
        self.compare("running", [r.request_id for r in theirs.running], [r.request_id for r in ours.running])

        if self.case.compare_stats:
            self._compare_stats(eco)

        # what the step exercised (the tests check the pressure they meant to apply)
        run.preemptions += len(kv_out.preempted_req_ids)
        run.resumed += len(k_resumed)
        run.finished += len(finished)
        run.hit_tokens += sum(k_before[r] for r in k_new)
        run.chunks += sum(1 for rid in kv_out.num_scheduled_tokens if rid not in res.sampled)
        run.max_running = max(run.max_running, len(ours.running))
        if len(ours.running) >= self.sc.max_num_seqs and waiting_before:
            run.waited_for_seqs += 1
        admitted_now = set(k_new) | set(k_resumed)
        if any(r.request_id in admitted_now for r in finished) and any(r.request_id not in admitted_now
                                                                        for r in finished):
            run.mixed_finishes += 1
        return True

    def _compare_stats(self, eco: dict) -> None:
        """vLLM's PrefixCacheStats of every step so far against kvtrace.metrics' counters over
        the requests kvtrace has looked up (admitted) so far."""
        for out in eco.values():
            if out.scheduler_stats is not None:
                pcs = out.scheduler_stats.prefix_cache_stats
                self.theirs_stats.update({f: getattr(pcs, f) for f in (*STATS.values(), "requests")})
        looked_up = [r for r in self.admitted if r.num_local_hit_tokens >= 0]
        mine = hit_counters(looked_up)
        theirs = {k: self.theirs_stats[v] for k, v in STATS.items()}
        theirs["requests"] = self.theirs_stats["requests"]
        self.compare("prefix_cache_stats", theirs, {**{k: mine[k] for k in STATS}, "requests": len(looked_up)})
        self.run.stats = theirs


def run_scheduler_conformance(case: SchedulerCase, api: VllmAPI) -> SchedulerRun:
    """Both schedulers over ``case`` until the workload is done, the first disagreement, or a
    waiting head neither can ever schedule."""
    return _Driver(case, api).drive()
