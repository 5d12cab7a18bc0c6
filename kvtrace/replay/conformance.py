"""Conformance: kvtrace's cache manager beside vLLM's own, request by request.

One driver runs a trace through both managers at once: kvtrace's ``KVCacheManager``
and vLLM 0.33's ``vllm.v1.core.kv_cache_manager.KVCacheManager`` (through
``kvtrace.engine.backends.vllm``, the only place that imports vLLM). Both get the same
requests (one kvtrace ``Request`` per trace request, token ids synthesised from its
hash ids, and a vLLM twin whose block hashes it shares), the same chunking and the same
sequence of calls, which mirrors vLLM's ``Scheduler.schedule`` in synchronous mode:

* each step: running requests first, in admission order (``allocate_slots``; when vLLM
  has no room, the last admitted request is preempted in both and the allocation
  retried), then, unless someone was preempted, waiting requests in order
  (``get_computed_blocks``, then ``allocate_slots`` with the hit, and vLLM's admission gate,
  ``full_sequence_must_fit``, unless ``scheduler_reserve_full_isl`` is off); the token
  budget and ``max_num_seqs`` of the preset's scheduler apply;
* a chunk is capped by the budget and ``long_prefill_token_threshold`` (only with another
  request in the system, as vLLM's scheduler cuts long prefills; without chunked
  prefill a new request waits for a budget that takes it whole), then, where
  Mamba groups exist, cut by vLLM's own ``Scheduler._mamba_block_aligned_split``; the
  chunk kvtrace's port (``kvtrace.engine.scheduler``) gives is compared, vLLM's is used;
* the step's copy-on-write copies are taken (their endpoints freed); every request that
  consumed all its known tokens samples one token (the same in both); a request with
  its output length done is freed;
* arrivals: the trace's requests join the waiting queue in order, keeping at most
  ``concurrency`` requests in the system (decode steps and concurrency, so eviction
  under pressure, copy-on-write and the Mamba same-step rule are exercised);
* with an external tier (``external_capacity_blocks``), kvtrace's tier plays the KV
  connector under vLLM's Scheduler rule (asked from the local hit cut to a scheduler
  block; a longer load replaces a local sub-block tail, both managers' hit blocks cut by
  their own ``truncate_computed_blocks``): its tokens go to both managers as
  ``num_external_computed_tokens`` (vLLM's manager takes a connector's word for them).

Compared fields, counted per comparison: ``chunk``, ``hit_tokens``, ``hit_blocks`` (block
ids of the hit per group), ``shared_prefix_boundary``, ``allocation`` (None, or the block
ids handed out per group), ``block_table`` (the request's whole table afterwards),
``copies`` (the step's (group, src, dst) list), ``cached_keys`` (the set of cached
(hash, group) keys after each step) and ``events`` (the step's stored/removed
(group, hash) entries as multisets; see ``kvtrace.engine.backends.vllm.events``).
A disagreement on ``chunk``, ``hit_tokens`` or the None-ness of ``allocation`` makes the
two call sequences part: the run stops there (the rest is not compared).

With behaviours switched off kvtrace is expected to differ: the report names the
switches whose old behaviour had acted (``CacheStats.old_behaviour_acted``) by the
first disagreement, or says that none had; and it names the switched-off behaviours whose
old code never acted at all (``never_acted``: an agreement says nothing of them).
A disagreement on ``events`` or ``cached_keys`` gives what each side alone holds: how many
entries (``only_in``) and the first ``SHOWN`` of them.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field, replace
from typing import Any

from kvtrace.cache import ALL_BEHAVIOURS, CacheConfig, KVCacheManager
from kvtrace.errors import ConfigError, KVTraceError
from kvtrace.names import printable

FIELDS = ("chunk", "hit_tokens", "hit_blocks", "shared_prefix_boundary", "allocation", "block_table", "copies",
          "cached_keys", "events")


@dataclass(slots=True)
class ConformanceSpec:
    """One conformance check: a trace, a configuration, one or more pool sizes."""

    trace: str  # a path, or gen:NAME
    preset: str | None = None
    config_file: str | None = None
    trace_format: str | None = None
    trace_block_size: int | None = None  # tokens per hash id where the trace's format does not carry it
    block_size: int | None = None
    capacity_blocks: tuple[int | None, ...] = (None,)  # one comparison per entry (None: the preset's)
    retention: str | None = None
    without: tuple[str, ...] = ()
    cache_overrides: dict[str, Any] = field(default_factory=dict)  # further CacheConfig fields
    limit: int | None = None
    concurrency: int = 8
    max_output_tokens: int = 4
    # kvtrace's external tier (N blocks) as the connector: its hit tokens go to both
    # managers as num_external_computed_tokens
    external_capacity_blocks: int | None = None
    seed: int = 0


SHOWN = 8  # entries of a set-valued field's difference shown (the first, sorted)


@dataclass
class Disagreement:
    field: str
    step: int
    request_id: str | None
    vllm: Any
    kvtrace: Any
    # ``events`` and ``cached_keys``: how many entries each side holds that the other does not
    # (``vllm`` and ``kvtrace`` are then the first ``SHOWN`` of them, not the side's whole value)
    only: tuple[int, int] | None = None

    def as_dict(self) -> dict[str, Any]:
        out = {"field": self.field, "step": self.step, "request_id": self.request_id,
               "vllm": _jsonable(self.vllm), "kvtrace": _jsonable(self.kvtrace)}
        if self.only is not None:
            out["only_in"] = {"vllm": self.only[0], "kvtrace": self.only[1]}
        return out


@dataclass
class ConformanceRun:
    """The comparison at one pool size."""

    # vLLM's num_gpu_blocks, as --capacity-blocks gave it (null block included): not replay's
    # capacity_blocks, the usable blocks (metrics.py's one meaning)
    num_gpu_blocks: int
    config: CacheConfig
    requests: int = 0  # requests that finished in both
    steps: int = 0
    agreed: Counter[str] = field(default_factory=Counter)
    compared: Counter[str] = field(default_factory=Counter)
    first: Disagreement | None = None  # the first disagreement of any field
    first_by_field: dict[str, Disagreement] = field(default_factory=dict)
    stopped: str | None = None  # why the run stopped before the trace ended
    preemptions: int = 0
    refusals: int = 0  # allocations both managers refused
    copies: int = 0
    evictions: int = 0  # keys vLLM removed (BlockRemoved entries)
    unschedulable: int = 0  # requests larger than the whole pool: skipped in both
    explained_by: list[dict[str, Any]] = field(default_factory=list)  # switched-off behaviours that acted
    # switched-off behaviours whose old code never acted on the whole trace (none told of a stopped run)
    never_acted: list[str] = field(default_factory=list)

    @property
    def disagreements(self) -> int:
        return sum(self.compared[f] - self.agreed[f] for f in FIELDS)

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_gpu_blocks": self.num_gpu_blocks,
            "behaviours_off": sorted(ALL_BEHAVIOURS - self.config.behaviours),
            "requests": self.requests,
            "steps": self.steps,
            "fields": {f: {"compared": self.compared[f], "agreed": self.agreed[f]} for f in FIELDS},
            "disagreements": self.disagreements,
            "first_disagreement": self.first.as_dict() if self.first else None,
            "first_by_field": {f: d.as_dict() for f, d in self.first_by_field.items()},
            "stopped": self.stopped,
            "explained_by": self.explained_by, "never_acted": self.never_acted,
            "preemptions": self.preemptions, "refusals": self.refusals, "copies": self.copies,
            # (vLLM's BlockRemoved entries: a replay's "evictions" also count moved keys and the tier's)
            "keys_removed": self.evictions, "unschedulable": self.unschedulable,
        }


@dataclass
class ConformanceResult:
    trace: str
    preset: str
    vllm_version: str
    runs: list[ConformanceRun]

    @property
    def agree(self) -> bool:
        return all(r.disagreements == 0 and r.stopped is None for r in self.runs)

    def as_dict(self) -> dict[str, Any]:
        return {"trace": self.trace, "preset": self.preset, "vllm_version": self.vllm_version, "agree": self.agree,
                "runs": [r.as_dict() for r in self.runs]}


def _jsonable(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.hex()[:16]
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (set, frozenset)):
        return sorted((_jsonable(x) for x in v), key=repr)
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return v


class _Stop(Exception):
    """The call sequences parted: nothing further is comparable."""


class _Driver:
    """Both managers in lockstep over one workload (see the module docstring)."""

    def __init__(self, cache_config: CacheConfig, scheduler_config, spec: ConformanceSpec, api):
        from kvtrace.engine.backends.vllm import VllmKVCacheManager
        from kvtrace.engine.scheduler import Scheduler

        self.cc = cache_config
        self.sc = scheduler_config
        self.spec = spec
        self.kv = KVCacheManager(cache_config)
        self.kv_events: list = []
        self.kv.subscribe(self.kv_events.extend)
        self.vm = VllmKVCacheManager(cache_config, max_model_len=scheduler_config.max_model_len,
                                     max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
                                     long_prefill_token_threshold=scheduler_config.long_prefill_token_threshold,
                                     connector=True, api=api)
        # kvtrace's port of the block-aligned split, on a scheduler of kvtrace's own
        self.port = Scheduler(scheduler_config, cache_config, self.kv)
        self.run = ConformanceRun(cache_config.num_gpu_blocks, cache_config)  # type: ignore[arg-type]
        self.step = 0
        self.group_suffix = [g.to_bytes(4, "big") for g in range(cache_config.num_groups)]
        self.convert = self.vm.external_hash

    # -- comparisons ----------------------------------------------------------------
    def compare(self, name: str, request_id: str | None, vllm_value: Any, kvtrace_value: Any,
                hard: bool = False, only: tuple[int, int] | None = None) -> bool:
        run = self.run
        run.compared[name] += 1
        if vllm_value == kvtrace_value:
            run.agreed[name] += 1
            return True
        d = Disagreement(name, self.step, request_id, vllm_value, kvtrace_value, only)
        run.first_by_field.setdefault(name, d)
        if run.first is None:
            run.first = d
        if hard:
            run.stopped = f"step {self.step:,}: the managers parted on {name} (request {request_id})"
            raise _Stop
        return False

    # -- the loop -------------------------------------------------------------------
    def drive(self, workload) -> ConformanceRun:
        spec = self.spec
        arrivals = iter(workload)
        waiting: deque = deque()  # (kvtrace request, max tokens)
        running: list = []
        max_tokens: dict[str, int] = {}
        pending = next(arrivals, None)
        try:
            while True:
                while pending is not None and len(running) + len(waiting) < spec.concurrency:
                    waiting.append(self._new_request(pending, max_tokens))
                    pending = next(arrivals, None)
                if not running and not waiting:
                    break
                self.step += 1
                self.run.steps = self.step
                self._schedule(running, waiting, max_tokens)
        except _Stop:
            pass
        return self.run

    def _new_request(self, trace, max_tokens: dict[str, int]):
        out = max(1, min(int(trace.output_length), self.spec.max_output_tokens))
        limit = self.sc.max_model_len
        if trace.input_length + out > limit:  # as the engine refuses it (vLLM's manager: an IndexError)
            raise KVTraceError(f"request {trace.request_id}: {trace.input_length:,} prompt + {out:,} output tokens "
                               f"exceed max_model_len {limit:,} (raise [scheduler] max_model_len in --config, or "
                               "drop the request)")
        req = self.vm.new_request(trace.request_id, trace.prompt_token_ids(), max_tokens=out,
                                  cache_salt=trace.cache_salt)
        max_tokens[req.request_id] = out
        return req

    def _cap(self, request, n: int, budget: int | None, thr: int) -> int:
        if 0 < thr < n:
            n = thr
        return n if budget is None else min(n, budget)

    def _split(self, request, n: int, local: int = 0, external: int = 0) -> int:
        if not self.vm.need_mamba_block_aligned_split:
            return n
        theirs = self.vm.block_aligned_split(request, n, local, external)
        ours = self.port._mamba_block_aligned_split(request, n, local, external)
        self.compare("chunk", request.request_id, theirs, ours, hard=True)
        return theirs

    def _connector(self, request, local: int, kv_hit, vllm_hit) -> tuple[int, int, Any, Any]:
        """vLLM's connector rule with kvtrace's tier as the connector: (local hit, external
        hit, kvtrace's hit blocks, vLLM's). kvtrace's manager applies it
        (``get_connector_hit``); vLLM's blocks are cut where kvtrace's were, by vLLM's own
        ``truncate_computed_blocks``, and the cut blocks compared."""
        if self.cc.external is None:
            return local, 0, kv_hit, vllm_hit
        kv_hit, cut, external = self.kv.get_connector_hit(request, kv_hit, local)
        if cut < local:
            vllm_hit = self.vm.manager.truncate_computed_blocks(vllm_hit, cut)
            self.compare("hit_blocks", request.request_id, vllm_hit.get_block_ids(), kv_hit.get_block_ids())
        return cut, external, kv_hit, vllm_hit

    def _allocate(self, request, n: int, local: int = 0, kv_hit=None, vllm_hit=None, external: int = 0,
                  gate: bool = False) -> bool:
        """Both allocations; False when both refused. ``gate``: vLLM's admission gate
        (``full_sequence_must_fit``), which its scheduler asks of a waiting request."""
        rid = request.request_id
        try:
            vm_out = self.vm.allocate_slots(request, n, num_new_computed_tokens=local, new_computed_blocks=vllm_hit,
                                            num_external_computed_tokens=external, full_sequence_must_fit=gate)
        except Exception as exc:  # vLLM 0.33 under-counts an external load's Mamba blocks (README, Conformance)
            from kvtrace.engine.backends.vllm._load import vllm_location

            where = vllm_location(self.vm.api, exc)  # (or a patched checkout's raises: where, in one line)
            if where is None:
                raise
            kv_out = self.kv.allocate_slots(request, n, num_new_computed_tokens=local, new_computed_blocks=kv_hit,
                                            num_external_computed_tokens=external, full_sequence_must_fit=gate)
            self.compare("allocation", rid, f"vLLM raised {type(exc).__name__}: {exc} (at {where})",
                         None if kv_out is None else kv_out.get_block_ids(), hard=True)
            raise
        kv_out = self.kv.allocate_slots(request, n, num_new_computed_tokens=local, new_computed_blocks=kv_hit,
                                        num_external_computed_tokens=external, full_sequence_must_fit=gate)
        theirs = None if vm_out is None else vm_out.get_block_ids()
        ours = None if kv_out is None else kv_out.get_block_ids()
        # one refused, the other not: the call sequences part
        self.compare("allocation", rid, theirs, ours, hard=(theirs is None) != (ours is None))
        if theirs is None:
            self.run.refusals += 1
            return False
        self.compare("block_table", rid, self.vm.get_block_ids(rid), self.kv.get_block_ids(rid))
        return True

    def _free(self, request, finished: bool) -> None:
        self.vm.free(request, finished=finished)
        self.kv.free(request)

    def _schedule(self, running: list, waiting: deque, max_tokens: dict[str, int]) -> None:
        budget = self.sc.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        preempted = False
        whole_prompt_waits = False  # chunked prefill off: the head's prompt exceeds the step's budget
        # (vLLM cuts a long prefill only where another request could be starved by it)
        thr = self.sc.long_prefill_token_threshold if len(running) + len(waiting) > 1 else 0
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = self._cap(req, req.num_tokens - req.num_computed_tokens, budget, thr)
            n = self._split(req, n)
            if n <= 0:
                i += 1
                continue
            ok = False
            while True:
                if self._allocate(req, n):
                    ok = True
                    break
                victim = running.pop()
                self._free(victim, finished=False)
                victim.num_computed_tokens = 0
                waiting.appendleft(victim)
                preempted = True
                self.run.preemptions += 1
                if victim is req:
                    break
            if not ok:
                break
            scheduled[req.request_id] = n
            budget -= n
            i += 1
        if not preempted:
            while waiting and budget > 0 and len(running) < self.sc.max_num_seqs:
                req = waiting[0]
                rid = req.request_id
                vm_blocks, vm_hit, vm_boundary = self.vm.get_computed_blocks(req)
                kv_blocks, kv_hit, kv_boundary = self.kv.get_computed_blocks(req)
                req.shared_prefix_boundary = kv_boundary
                self.compare("shared_prefix_boundary", rid, vm_boundary, kv_boundary)
                self.compare("hit_blocks", rid, vm_blocks.get_block_ids(), kv_blocks.get_block_ids())
                self.compare("hit_tokens", rid, vm_hit, kv_hit, hard=True)
                vm_hit, ext, kv_blocks, vm_blocks = self._connector(req, vm_hit, kv_blocks, vm_blocks)
                n = self._cap(req, req.num_tokens - vm_hit - ext, None, thr)
                if not self.sc.enable_chunked_prefill and n > budget:  # a whole prompt or nothing, as vLLM's
                    whole_prompt_waits = True
                    break
                n = self._split(req, min(n, budget), vm_hit, ext)
                if n <= 0:
                    break
                if not self._allocate(req, n, vm_hit, kv_blocks, vm_blocks, ext, self.sc.scheduler_reserve_full_isl):
                    break
                waiting.popleft()
                running.append(req)
                self.vm.set_running(req)
                req.num_computed_tokens = vm_hit + ext
                scheduled[rid] = n
                budget -= n
        theirs = [c[:3] for c in self.vm.take_block_copies()]
        self.compare("copies", None, theirs, [c[:3] for c in self.kv.take_block_copies()])
        self.run.copies += len(theirs)
        if not scheduled and not running and waiting:
            if whole_prompt_waits:  # the whole budget could not take it: it never will (the engine refuses it too)
                raise KVTraceError(
                    f"request {waiting[0].request_id} ({waiting[0].num_tokens:,} tokens) cannot be scheduled: without "
                    f"chunked prefill a prompt must fit one step's max_num_batched_tokens "
                    f"{self.sc.max_num_batched_tokens:,} (raise [scheduler] max_num_batched_tokens in --config, or "
                    "set enable_chunked_prefill = true)")
            # the head request needs more blocks than the whole pool (both refused it
            # with nothing running): vLLM would wait for ever; skip it in both
            req = waiting.popleft()
            self.vm.forget(req.request_id)
            self.run.unschedulable += 1
        self.kv.take_state_writes()
        finished = []
        for req in running:
            num = scheduled.get(req.request_id)
            if not num:
                continue
            req.num_computed_tokens += num
            if req.num_computed_tokens >= req.num_tokens:
                self.vm.append_output_token_ids(req, (hash_token(req.request_id, req.num_output_tokens)))
                if req.num_output_tokens >= max_tokens[req.request_id]:
                    finished.append(req)
        for req in finished:
            running.remove(req)
            self._free(req, finished=True)
            self.vm.forget(req.request_id)
            self.run.requests += 1
        self._end_step()

    def _end_step(self) -> None:
        from kvtrace.engine.backends.vllm import kvtrace_event_keys, vllm_event_keys

        self.kv.new_step_starts()  # flushes kvtrace's events of the step into kv_events
        theirs = Counter(vllm_event_keys(self.vm.take_events()))
        self.run.evictions += sum(n for (op, _, _), n in theirs.items() if op == "removed")
        ours = Counter(kvtrace_event_keys(self.kv_events, self.convert))
        self.kv_events.clear()
        if theirs != ours:
            vllm_only, kvtrace_only = theirs - ours, ours - theirs
            self.compare("events", None, sorted(vllm_only.elements(), key=repr)[:SHOWN],
                         sorted(kvtrace_only.elements(), key=repr)[:SHOWN],
                         only=(vllm_only.total(), kvtrace_only.total()))
        else:
            self.compare("events", None, 0, 0)
        self.vm.new_step_starts()
        vm_keys = set(self.vm.block_pool.cached_block_hash_to_block._cache)
        suffix = self.group_suffix
        kv_keys: set[bytes] = set()
        for pool in dict.fromkeys(self.kv.pools):
            for g, cached in enumerate(pool.cached):
                sfx = suffix[g]
                kv_keys.update([h + sfx for h in cached])  # type: ignore[operator, misc]  # vLLM hashes: bytes
        if vm_keys != kv_keys:
            vm_alone, kv_alone = vm_keys - kv_keys, kv_keys - vm_keys
            self.compare("cached_keys", None, self._keys(vm_alone), self._keys(kv_alone),
                         only=(len(vm_alone), len(kv_alone)))
        else:
            self.compare("cached_keys", None, len(vm_keys), len(kv_keys))

    def _keys(self, keys: set[bytes]) -> list[tuple[int, Any]]:
        """The first ``SHOWN`` of vLLM-map keys (hash + 4-byte group) as (group, hash), the hash
        as vLLM's events carry it, so a key reads alike in ``events`` and ``cached_keys``
        (it was the hash's first 8 bytes in hex here, its low 64 bits as an int there)."""
        return sorted((int.from_bytes(k[-4:], "big"), self.convert(k[:-4])) for k in keys)[:SHOWN]


def hash_token(request_id: str, index: int) -> int:
    """The token both managers' requests sample at output ``index`` (deterministic)."""
    h = 0
    for ch in request_id:
        h = (h * 131 + ord(ch)) % 1_000_003
    return (h * 7919 + index * 104_729) % 50_000


# -- the entry point -----------------------------------------------------------------------

def run_conformance(spec: ConformanceSpec, api=None) -> ConformanceResult:
    """Compare both managers on ``spec`` (one run per pool size). Raises ``KVTraceError``
    when vLLM is missing or the configuration has no vLLM counterpart."""
    from kvtrace.engine.backends.vllm import UnsupportedConfig, check_expressible, load_vllm
    from kvtrace.replay.run import RunSpec, open_workload, unsupported_at_origin, validate

    if spec.concurrency < 1:
        raise ConfigError("--concurrency", str(spec.concurrency), "expected >= 1")
    # (as a sweep refuses a value given twice: the same comparison was run twice, and listed twice)
    twice = next((c for i, c in enumerate(spec.capacity_blocks) if c in spec.capacity_blocks[:i]), None)
    if twice is not None:
        raise ConfigError("--capacity-blocks", str(twice), "is given twice (one comparison per pool size)")
    # every setting (the seed, the limit...: validate) and the trace's opening checked before
    # vLLM loads (10 s and more), so a mistake is told at once
    planned = []
    for capacity in spec.capacity_blocks:
        rs = RunSpec(spec.trace, preset=spec.preset, config_file=spec.config_file, trace_format=spec.trace_format,
                     trace_block_size=spec.trace_block_size, block_size=spec.block_size, capacity_blocks=capacity,
                     retention=spec.retention, without=spec.without, limit=spec.limit, seed=spec.seed, content=False,
                     external_capacity_blocks=spec.external_capacity_blocks)
        preset = validate(rs)[2]
        cc = preset.cache_config
        if spec.cache_overrides:
            cc = replace(cc, **spec.cache_overrides)
        try:
            check_expressible(cc, connector=cc.external is not None)  # (what vLLM cannot express: before it loads)
        except UnsupportedConfig as err:
            raise unsupported_at_origin(err, rs) from None
        planned.append((rs, preset, cc, open_workload(rs)))
    api = api or load_vllm()
    runs = []
    preset_name = ""
    for rs, preset, cc, workload in planned:
        preset_name = preset.name
        try:
            driver = _Driver(cc, preset.scheduler_config, spec, api)
        except UnsupportedConfig as err:  # what only vLLM's own API can tell (its fine-grained hits)
            raise unsupported_at_origin(err, rs) from None
        run = driver.drive(workload.requests)
        if run.first is not None:
            run.explained_by = _explanations(driver.kv, run.first.step)
        acted = {behaviour for _, _, behaviour in driver.kv.stats.old_behaviour_acted}
        # (a run stopped at a disagreement replayed only part of the trace: what did not act
        # before the stop may act after it, so it is not told as never acting)
        run.never_acted = [] if run.stopped else sorted(ALL_BEHAVIOURS - cc.behaviours - acted)
        runs.append(run)
    return ConformanceResult(spec.trace, preset_name, api.version, runs)


def _explanations(kv: KVCacheManager, step: int) -> list[dict[str, Any]]:
    """The switched-off behaviours that acted by ``step`` (first time each)."""
    seen: dict[str, dict[str, Any]] = {}
    for s, rid, behaviour in kv.stats.old_behaviour_acted:
        s += 1  # the manager counts steps from 0, the driver from 1
        if s <= step and behaviour not in seen:
            seen[behaviour] = {"behaviour": behaviour, "step": s, "request_id": rid}
    return list(seen.values())


# what one entry of a set-valued field is, as the report counts them
_ENTRIES = {"events": "event entries (operation, group, hash)", "cached_keys": "cached keys (group, hash)"}


def format_report(result: ConformanceResult) -> list[str]:
    """The human-readable report: agreement per field, then the first disagreement."""
    lines = [f"kvtrace conformance {result.trace}  preset {result.preset}  vLLM {result.vllm_version}"]
    for run in result.runs:
        off = sorted(ALL_BEHAVIOURS - run.config.behaviours)
        # (every count with its thousands separated, as num_gpu_blocks and the field table: the
        # README quotes "4,011 keys removed" where this line printed 4011)
        head = (f"num_gpu_blocks {run.num_gpu_blocks:,}: {run.requests:,} requests, {run.steps:,} steps, "
                f"{run.preemptions:,} preemptions, {run.refusals:,} refused allocations, "
                f"{run.evictions:,} keys removed (vLLM's BlockRemoved entries; a replay's evictions count moved "
                f"keys and the external tier's too), "
                f"{run.copies:,} copies")
        if run.unschedulable:
            head += (f", {run.unschedulable:,} request{'' if run.unschedulable == 1 else 's'} larger than the pool "
                     "skipped")
        if off:
            head += f"  (switched off: {', '.join(off)})"
        lines.append(head)
        if run.unschedulable and not run.requests and run.stopped is None:  # an agreement on lookups alone
            if run.compared["block_table"]:  # (an allocation went through: a request ran until it preempted itself)
                lines.append("  no request finished: each needed more blocks than the pool holds, so only their "
                             "lookups, refusals and the chunks before a preemption were compared (raise "
                             "--capacity-blocks)")
            else:
                lines.append("  no request ran: each was larger than the pool, so only their lookups and refusals "
                             "were compared (raise --capacity-blocks)")
        if run.never_acted:  # an agreement says nothing of these switches
            lines.append(f"  never acted here (switched off, but the old code took no other path): "
                         f"{', '.join(run.never_acted)}")
        for f in FIELDS:
            c, a = run.compared[f], run.agreed[f]
            mark = "" if a == c else f"   <- {c - a:,} disagree"
            lines.append(f"  {f:24s} {a:>8,} / {c:<8,} agree{mark}")
        if run.first is not None:
            d = run.first
            lines.append(f"  first disagreement: {d.field} at step {d.step:,}"
                         + (f", request {d.request_id}" if d.request_id else ""))
            if d.only is None:
                lines.append(f"    vLLM:    {_jsonable(d.vllm)}")
                lines.append(f"    kvtrace: {_jsonable(d.kvtrace)}")
            else:  # set differences: what each side holds that the other does not
                for who, n, shown in (("vLLM", d.only[0], d.vllm), ("kvtrace", d.only[1], d.kvtrace)):
                    part = f"{len(shown)} shown: " if n > len(shown) else ""
                    lines.append(f"    only in {who + ':':9s}{n:,} {_ENTRIES[d.field]}"
                                 + (f" ({part}{_jsonable(shown)})" if n else ""))
            if off:
                if run.explained_by:
                    for e in run.explained_by:
                        lines.append(f"    explained by switch {e['behaviour']} (its old behaviour acted at step "
                                     f"{e['step']:,}, request {e['request_id']})")
                else:
                    lines.append("    not explained by a switch: no switched-off behaviour acted before it")
        if run.stopped:
            lines.append(f"  stopped: {run.stopped}")
    lines.append("agree" if result.agree else "DISAGREE")
    # (a trace path or request id of the user's is shown as printable text: an escape sequence in
    # a file name recoloured the terminal)
    return [printable(line) for line in lines]
