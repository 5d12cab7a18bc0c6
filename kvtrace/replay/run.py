"""The run driver: one trace, one config -> one recorded run.

It wires a trace source (a file, or ``gen:NAME`` for a built-in generated workload)
through the engine (engine mode) or the bare cache manager (cache-only mode). Listeners
on the per-step event stream: the digest (always), the span instrumentor (when a DuckDB
store or an OTLP endpoint is given) and a progress bar. The run is registered in the
store as ``running`` before the first span and finished as ``complete`` or ``failed``.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import numbers
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtrace.errors import ConfigError, KVTraceError, check_limit, check_option, check_seed
from kvtrace.metrics import (
    DEFAULT_PERCENTILES,
    DEFINITIONS,
    DEFINITIONS_CONFIG_KEY,
    PERCENTILES_CONFIG_KEY,
    is_latency_key,
    parse_percentiles,
)
from kvtrace.names import MODES, otlp_requested, shown_value
from kvtrace.numeric import cdiv
from kvtrace.process import raise_stop, stop_pending
from kvtrace.replay.config_file import load_config_file, parse_retention
from kvtrace.replay.digest import Digest
from kvtrace.workload.lines import MAX_TOKENS, parse_decimal

if TYPE_CHECKING:
    from kvtrace.workload import TraceRequest
# The cache, the engine, the store and the trace readers load where a run needs them, so
# that a user error is reported before any of them (and torch) is imported.

DEFAULT_PRESET = "kimi-hybrid"
GENERATED_PREFIX = "gen:"


@dataclass(slots=True)
class RunSpec:
    trace: str  # a path, or "gen:NAME" for a built-in generated workload
    preset: str | None = None  # engine mode: DEFAULT_PRESET when None
    mode: str = "engine"  # engine | cache-only
    policy: str = "lru"  # lru | belady (cache-only)
    config_file: str | None = None
    trace_format: str | None = None
    trace_block_size: int | None = None  # tokens per hash id where the trace's format does not carry it
    block_size: int | None = None
    capacity_blocks: int | float | None = None  # cache-only: None or math.inf is an unbounded cache
    capacity_tokens: int | None = None
    retention: str | None = None  # "none" | "0" | "K"
    without: tuple[str, ...] = ()
    limit: int | None = None
    seed: int = 0
    name: str | None = None
    external_capacity_blocks: int | None = None
    content: bool = True  # engine mode: False runs without device content (hits and timings only)
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES  # of the summary's latencies (vllm bench serve's)
    backend: str = "kvtrace"  # engine mode: whose cache manager (kvtrace.engine.backends.BACKENDS)

    def __post_init__(self) -> None:
        # a notebook's pathlib.Path, as config_file takes one (the trace's was an AttributeError)
        if isinstance(self.trace, os.PathLike):
            try:
                self.trace = os.fspath(self.trace)
            except Exception:  # (a caller's __fspath__ that raises: its own traceback)
                raise ConfigError("TRACE", shown_value(self.trace), "expected a trace file's path or gen:NAME: "
                                                                     "its path cannot be read") from None


@dataclass(slots=True)
class RunResult:
    summary: dict[str, Any]
    run_id: str | None = None
    per_request: list[dict[str, Any]] = field(default_factory=list)
    record: dict[str, Any] = field(default_factory=dict)  # the run's record (Store.create_run's fields)
    undelivered: str | None = None  # why spans did not reach the OTLP collector, if any did not
    otlp_run_id: str | None = None  # the run id its OTLP export named (pipeline.unique_export_run_id)


# -- the workload ------------------------------------------------------------------------


@dataclass(slots=True)
class _Workload:
    requests: Iterable[TraceRequest]
    source: str  # what the run record calls the trace
    source_id: str  # identity of the input, for "same trace" checks
    total: int | None
    whole_id: str | None = None  # the identity when the limit cuts nothing (the whole file)

    def identity(self, replayed: int) -> str:
        """``source_id``, or the whole file's when ``--limit`` cut nothing: fewer requests
        were replayed, or as many and the file holds no other (it named another trace)."""
        if self.whole_id is not None and self.total is not None:
            if replayed < self.total:
                return self.whole_id
            holds_more = getattr(self.requests, "holds_more", None)  # (a TraceSource's: one past the limit)
            if holds_more is not None and not holds_more():
                return self.whole_id
        return self.source_id


def open_workload(spec: RunSpec) -> _Workload:
    if spec.trace.startswith(GENERATED_PREFIX):
        from kvtrace.replay.generate import WORKLOADS, generate

        for flag, given in (("--format", spec.trace_format), ("--trace-block-size", spec.trace_block_size)):
            if given is not None:  # (it was ignored)
                raise ConfigError(flag, _quoted(given),
                                  f"{spec.trace} is a generated workload, not a file of a format; drop {flag}")

        name = spec.trace[len(GENERATED_PREFIX):]
        if name not in WORKLOADS:  # (generate's own error names its WORKLOAD argument, not TRACE)
            raise ConfigError("TRACE", spec.trace, f"no generated workload {name!r}; expected gen: and one of "
                                                    f"{', '.join(WORKLOADS)}")
        reqs = generate(name, spec.seed)
        if spec.limit is not None:
            reqs = reqs[: spec.limit]
        ident = hashlib.sha256(f"{name}:{spec.seed}:{len(reqs)}".encode()).hexdigest()
        return _Workload(reqs, spec.trace, f"gen:{ident}", len(reqs))
    from kvtrace.replay.readers import open_trace

    check_limit(spec.limit)  # (the reader's own check named its parameter, not the flag)
    src = open_trace(spec.trace, format=spec.trace_format, limit=spec.limit, block_size=spec.trace_block_size)
    file_id = getattr(src, "source_id", None) or spec.trace
    read_at = src.options.get("block_size")  # (None: the format's own size, however given)
    # (the same file read at another block size: other requests)
    read = "" if read_at is None else f":trace_block_size={read_at}"
    if spec.limit is None:
        return _Workload(src, spec.trace, f"{file_id}{read}", None)
    return _Workload(src, spec.trace, f"{file_id}:limit={spec.limit}{read}", spec.limit, f"{file_id}{read}")


# -- configuration -----------------------------------------------------------------------


# Where a setting of the engine's cache and scheduler can come from: the CLI flag, and
# the TOML key of --config. A ConfigError raised on a setting names this origin.
_FLAG_OF = {
    "num_gpu_blocks": "--capacity-blocks", "retention_interval": "--retention", "behaviours": "--without",
    "without": "--without", "external": "--external-blocks", "groups": "--block-size",
    "hash_block_size": "--block-size",
}
_TOML_KEY_OF = {"behaviours": "cache.without", "without": "cache.without",
                "external": "cache.external_capacity_blocks", "preset": "preset"}


# How the unbounded cache (cache-only mode) is spelt, in --capacity-blocks, sweep's
# capacity_blocks values and curve's --capacities alike (any case)
UNBOUNDED_WORDS = ("inf", "infinity", "unbounded")


def is_unbounded(text: str) -> bool:
    return text.strip().lower() in UNBOUNDED_WORDS


def parse_capacity_blocks(text: str | None) -> int | float | None:
    """``--capacity-blocks``: a block count, or ``inf`` (cache-only mode's unbounded cache)."""
    if text is None:
        return None
    if is_unbounded(text):
        return math.inf
    blocks = parse_decimal(text)  # (ASCII digits: int() also took 1_000 and other scripts' digits)
    if blocks is None:
        raise ConfigError("--capacity-blocks", text, "expected a number of blocks, or inf (cache-only mode)")
    return blocks


def engine_preset(spec: RunSpec):
    """The preset named by the spec (or its TOML file), with every override applied.

    A setting the config classes refuse is reported at its origin: the flag
    (``--capacity-blocks: -5: ...``) or the file and key (``run.toml: cache.hash_fn: ...``).
    """
    from kvtrace.engine.presets import KEEP, get_preset

    file_cfg = load_config_file(spec.config_file) if spec.config_file else None
    origin = _origins(spec, file_cfg)
    try:
        preset_name = spec.preset or (file_cfg.preset if file_cfg and file_cfg.preset else None) or DEFAULT_PRESET
        cache_kw = dict(file_cfg.cache) if file_cfg else {}
        without = tuple(cache_kw.pop("without", ())) + tuple(spec.without)
        retention = cache_kw.pop("retention_interval", KEEP)
        if spec.retention is not None:
            retention = parse_retention(spec.retention)
        capacity = cache_kw.pop("num_gpu_blocks", None)
        if spec.capacity_blocks is not None:
            capacity = spec.capacity_blocks
        external = cache_kw.pop("external_capacity_blocks", None)
        groups = cache_kw.pop("groups", None)
        hash_block_size = cache_kw.pop("hash_block_size", None)
        if spec.external_capacity_blocks is not None:
            external = spec.external_capacity_blocks
        if spec.block_size is not None and spec.block_size < 1:
            raise ConfigError("--block-size", _quoted(spec.block_size), "expected a positive token count")
        preset = get_preset(
            preset_name,
            capacity_blocks=capacity,
            capacity_tokens=spec.capacity_tokens,
            retention_interval=retention,
            without=without,
            external_capacity_blocks=external,
            block_size=spec.block_size,
            groups=groups,
            hash_block_size=hash_block_size,
            scheduler=(file_cfg.scheduler if file_cfg else None) or None,
        )
        if cache_kw.get("num_prefill_checkpoint_blocks") == 0:  # checkpoints off: the preset's alignment goes too
            cache_kw.setdefault("prefill_checkpoint_alignment", None)
        if cache_kw:  # the remaining [cache] keys are plain CacheConfig fields
            preset = replace(preset, cache_config=preset.cache_config.with_(**cache_kw))
        if file_cfg is not None and file_cfg.cost_model is not None:
            preset = replace(preset, cost_model=file_cfg.cost_model)
    except ConfigError as err:
        raise _at_origin(err, origin, spec) from None
    return preset


def _file_keys(file_cfg) -> dict[str, str]:
    """Config key -> the file key (``cache.KEY``, ``preset``) of each setting the file holds."""
    keys = {key: f"{section}.{key}" for section in ("cache", "scheduler") for key in getattr(file_cfg, section)}
    if file_cfg.preset:
        keys["preset"] = "preset"
    return keys


def _origins(spec: RunSpec, file_cfg) -> dict[str, str]:
    """Config key -> the flag or file key (``cache.KEY``) that set it."""
    origin: dict[str, str] = {}
    if file_cfg is not None:
        origin.update(_file_keys(file_cfg))
        for key, toml_key in _TOML_KEY_OF.items():
            if toml_key.split(".")[-1] in origin or toml_key in origin.values():
                origin[key] = toml_key
    flags = _flag_values(spec)
    for key, flag in (*_FLAG_OF.items(), ("preset", "--preset")):
        if flags.get(flag) is not None:
            if key == "hash_block_size" and origin.get(key, "").startswith("cache."):
                continue  # (--block-size fits the preset's hash unit to it, never the file's: that one is as given)
            origin[key] = flag
    if spec.capacity_tokens is not None:
        origin["num_gpu_blocks"] = "--capacity-tokens"
    return origin


def _storage_error_at_origin(err: ConfigError, spec: RunSpec) -> ConfigError:
    """The storage check's error naming the config file's keys that size the storage, where
    the file set them and no flag replaced them (``_origins``; it named the flags alone,
    whatever the file held)."""
    if not spec.config_file:
        return err
    from kvtrace.engine.memory import STATE_LANES

    origin = _origins(spec, load_config_file(spec.config_file))
    sized_by = ("groups",) if err.key == STATE_LANES else ("groups", "num_gpu_blocks")  # (lanes: the pool is no cause)
    keys = [origin[k] for k in sized_by if origin.get(k, "").startswith("cache.")]
    if not keys:
        return err
    return ConfigError(spec.config_file, " / ".join(keys), f"KV storage of {err.key}: {err.what}")


def _cost_model_at_origin(err: ConfigError, spec: RunSpec, preset) -> ConfigError:
    """The clock's refusal of a cost model (``cost model NAME: ...``) at the config file's
    ``cost_model`` table when the file gave the model (it named the model alone)."""
    model = preset.cost_model
    if err.source != f"cost model {model.name}" or not spec.config_file:
        return err
    if load_config_file(spec.config_file).cost_model is None:
        return err
    return ConfigError(spec.config_file, "cost_model", f"{model.name}: {err.what}")


def unsupported_at_origin(err: KVTraceError, spec: RunSpec) -> KVTraceError:
    """A configuration the vllm backend refuses (``UnsupportedConfig``, which knows only
    ``CacheConfig`` fields) restated at the first flag or file key of its ``keys`` the
    user set; as it is when the preset alone made it."""
    origin = _origins(spec, load_config_file(spec.config_file) if spec.config_file else None)
    for key in getattr(err, "keys", ()):
        where = origin.get(key)
        if where is not None:
            return ConfigError(*_restated(where, spec), str(err))
    return err


def _restated(where: str, spec: RunSpec) -> tuple[str, str]:
    """(source, key) of a ConfigError about the setting at ``where`` (a flag, or a file key)."""
    if where.startswith("--"):
        return where, str(_flag_values(spec).get(where))
    return str(spec.config_file), where


# RunSpec field -> the run-setting flag that sets it (where they are named alike but for
# external_capacity_blocks); what a refusal of the field's value names
FLAG_OF_FIELD = {f: "--" + f.replace("_", "-") for f in ("capacity_blocks", "capacity_tokens", "retention",
                                                         "without", "block_size", "preset", "policy", "mode")}
FLAG_OF_FIELD["external_capacity_blocks"] = "--external-blocks"


def _flag_values(spec: RunSpec) -> dict[str, Any]:
    """Each run-setting flag and what it was given (None: not given)."""
    return {flag: (",".join(spec.without) or None) if field == "without" else getattr(spec, field)
            for field, flag in FLAG_OF_FIELD.items()}


# a preset's setting -> the settings a file's value of which can make it conflict (the
# refusal names those the file set, not every key it set)
_CONFLICTS_WITH = {"retention_interval": ("groups",)}


def _at_origin(err: ConfigError, origin: dict[str, str], spec: RunSpec) -> ConfigError:
    """``err`` (raised by a config class, which knows only its own field names) restated
    at the flag or file key the value came from."""
    if err.source.startswith("--"):  # already at its flag (--retention -1): the file is not to blame
        return err
    # get_preset says "preset: NAME: unknown" of the name and "preset: without: ..." of behaviours
    key = "preset" if err.source == "preset" and err.key != "without" else err.key
    if key is None:  # about a file as a whole: nothing to restate
        return err
    field = key.split(".")[0].split("[")[0]
    where = origin.get(field)
    if where is None:
        if spec.config_file is None:
            return err
        # (every key the file set, those a flag took over included: --block-size took the
        # file's groups, and the conflict went out as the config class raised it)
        set_by_file = _file_keys(load_config_file(spec.config_file))
        related = [set_by_file[f] for f in _CONFLICTS_WITH.get(field, ()) if f in set_by_file]
        file_keys = related or sorted(set(set_by_file.values()))  # (the keys that can conflict, where known)
        if not file_keys:
            return err
        # the preset's own value of a setting the file left alone, in conflict with what it set
        return ConfigError(str(spec.config_file), ", ".join(file_keys),
                           f"conflicts with the preset's {err.key}: {err.what}")
    return ConfigError(*_restated(where, spec), err.what)


def config_json(preset) -> dict[str, Any]:
    """A JSON-able record of the exact configuration of a run."""
    cc = preset.cache_config
    return {
        "preset": preset.name,
        "cache": {
            "groups": [{"type": type(g).__name__, **asdict(g)} for g in cc.groups],
            # one int: the pool every group shares (vLLM); a list: one pool per group
            "num_gpu_blocks": cc.num_gpu_blocks if cc.shared_pool else list(cc.pool_sizes),
            "hash_block_size": cc.hash_block_size,
            "hash_fn": cc.hash_fn,
            "retention_interval": cc.retention_interval,
            "enable_partial_hits": cc.enable_partial_hits,
            "num_speculative_blocks": cc.num_speculative_blocks,
            "num_prefill_checkpoint_blocks": cc.num_prefill_checkpoint_blocks,
            "prefill_checkpoint_alignment": cc.prefill_checkpoint_alignment,
            "external_capacity_blocks": cc.external.capacity_blocks if cc.external else None,
            "behaviours": sorted(cc.behaviours),
        },
        "scheduler": asdict(preset.scheduler_config),
        "cost_model": asdict(preset.cost_model),
    }


# -- progress --------------------------------------------------------------------------


class _Progress:
    """A rich progress bar on stderr, advanced by finished requests."""

    def __init__(self, enabled: bool, total: int | None, label: str):
        self._bar = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                console=Console(stderr=True), transient=True,
            )
            from kvtrace.names import markup_literal

            # the label names the user's trace: shown as typed, never as markup or terminal codes
            self._task = self._bar.add_task(markup_literal(label), total=total)
            self._bar.start()

    def advance(self, n: int) -> None:
        if self._bar is not None and n:
            self._bar.advance(self._task, n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


# -- the driver ------------------------------------------------------------------------


def run_replay(
    spec: RunSpec,
    *,
    db: str | Path | None = None,
    otlp_endpoint: str | None = None,
    progress: bool = False,
    store=None,
    spans_to=None,
    export: bool = True,
) -> RunResult:
    """Replay ``spec``; record spans and the run into ``db`` (or an open ``store``).

    ``spans_to``: without a store, an object taking the spans as the store would
    (``append_spans``, ``flush_if_due``, ``flush``, ``release``): a sweep worker keeps them in memory.
    ``export``: False sends nothing over OTLP, whatever the OTEL_* variables say (the
    commands that replay many runs into their store: sweep, study, demo).

    Everything a user can get wrong in the spec is checked before the run is created, so
    a refused spec records nothing. The run then goes ``running`` -> ``complete``, or
    ``failed`` with every span emitted before the error kept.
    """
    _check_types(spec)
    _check_destinations(db, otlp_endpoint, store, spans_to, progress=progress, export=export)
    # A trace file is opened (lazily) first: a missing or unreadable one is reported before
    # the engine's configuration loads the cache; a generated workload is built after it.
    workload = None if spec.trace.startswith(GENERATED_PREFIX) else open_workload(spec)
    # (recorded and summarised as the CLI's are: (50, 50, 99) recorded [50, 50, 99], the CLI [50.0, 99.0])
    spec = replace(spec, percentiles=check_percentiles(spec.percentiles))
    config, behaviours, preset = validate(spec)
    otlp = export and otlp_requested(otlp_endpoint)
    if otlp or db is not None or store is not None or spans_to is not None:
        # before the run is created: a refused setting records nothing
        from kvtrace.instrument.pipeline import check_otlp_settings, check_resource_variable

        check_resource_variable()  # (every recording's spans carry the resource)
        if otlp:
            check_otlp_settings(otlp_endpoint)
    config[DEFINITIONS_CONFIG_KEY] = DEFINITIONS  # (diff tells runs recorded under other definitions apart)
    if workload is None:
        workload = open_workload(spec)
        if spec.seed:  # (what was generated: the Compare page's study of the run regenerates it)
            config["seed"] = spec.seed
    resource = backend_resource(config)
    from kvtrace.store.schema import created_now

    # (created: the store's record and the one an OTLP export sends at the end say one time; a
    # collector gave its copy the time it first saw the run's spans, minutes late)
    record = {"trace_source": workload.source, "trace_digest": workload.source_id, "config": config,
              "behaviours": behaviours, "mode": spec.mode if spec.mode == "engine" else f"cache-only/{spec.policy}",
              "created": created_now()}
    name = spec.name or _default_name(spec, behaviours, preset)
    blocked = None
    if preset is None:
        # cache-only: the trace read, at one block size, before a run is created (its replay
        # reads it whole first all the same): a refused --block-size, or a bad line, records
        # nothing, where it left a failed run of 0 spans
        from kvtrace.replay.cache_only import as_block_requests

        blocked = as_block_requests(workload.requests, spec.block_size)
    with contextlib.ExitStack() as stack:
        if store is None and db is not None:
            from kvtrace.store import Store

            # hold: the file stays open between the once-a-second flushes, given up to any
            # other process that asks for it (a dashboard, a second writer)
            store = stack.enter_context(Store.open(db, hold=True))
        run_id = None
        if store is not None:
            run_id = store.create_run(name, **record)
        try:
            digest = Digest()
            sink = store if store is not None else spans_to
            offset = store.time_offset_ns(run_id) if store is not None and run_id is not None else None
            undelivered = None
            exported_as = None
            stored_whole = False  # every span of the finished run is in the store (an export may still drain)
            if otlp:
                from kvtrace.instrument.pipeline import unique_export_run_id

                exported_as = unique_export_run_id(run_id)
            try:
                with _recording(sink, run_id or "unrecorded", otlp_endpoint, otlp, spec.seed, offset,
                                resource, exported_as) as instrumentor, \
                        _failed_record(instrumentor, {"name": name, **record}) as sent:
                    bar = _Progress(progress, workload.total, f"{spec.mode} {Path(workload.source).name}")
                    try:
                        if preset is not None:
                            try:
                                summary, per_request = _run_engine(preset, workload, digest, instrumentor, bar,
                                                                   spec.content, spec.percentiles, spec.backend)
                            except ConfigError as err:
                                raise _cost_model_at_origin(err, spec, preset) from None
                            summary.update({k: v for k, v in config.items() if k.startswith("vllm_")})
                        else:
                            assert blocked is not None
                            summary, per_request = _run_cache_only(spec, blocked, digest, instrumentor, bar)
                    finally:
                        bar.close()
                    summary["digest"] = digest.hexdigest()
                    summary["mode"] = spec.mode
                    summary["trace"] = workload.source
                    record["trace_digest"] = workload.identity(summary["requests"])
                    if instrumentor is not None:
                        instrumentor.flush()  # the last spans: nothing is emitted after this
                        summary["spans"] = instrumentor.spans_emitted
                        # OTLP receivers have no runs table: the record travels as one span
                        instrumentor.record_run({"name": name, **record, "digest": summary["digest"],
                                                 "status": "complete", "summary": summary})
                        sent.append(True)
                        if store is not None:
                            instrumentor.flush_stores()  # (before the OTLP drain the exit waits for)
                            stored_whole = not stop_pending()
            except KVTraceError as err:  # spans an OTLP collector did not take: the run itself is whole
                from kvtrace.instrument import SpansNotDelivered

                if not isinstance(err, SpansNotDelivered):
                    raise
                undelivered = err
                summary["otlp_spans_undelivered"] = err.failed
            if stop_pending():  # (one a finalizer swallowed after the last step: the run is not complete)
                raise_stop()
            if store is not None:
                store.finish_run(run_id, status="complete", digest=summary["digest"], summary=summary,
                                 trace_digest=record["trace_digest"])
            return RunResult(summary, run_id, per_request, record,
                             undelivered=None if undelivered is None else str(undelivered), otlp_run_id=exported_as)
        except BaseException as exc:
            if store is not None and run_id is not None:
                # the recording above has handed every emitted span to the store already
                with contextlib.suppress(Exception):  # the original error matters more
                    if stored_whole and otlp and isinstance(exc, KeyboardInterrupt):
                        # stopped while a collector was still taking the spans: the run itself is
                        # whole (it was marked failed, its summary lost, where the collector's copy
                        # said complete); how many spans the collector missed is unknown
                        summary["otlp_export"] = "stopped"
                        store.finish_run(run_id, status="complete", digest=summary["digest"], summary=summary,
                                         trace_digest=record["trace_digest"])
                    else:
                        store.finish_run(run_id, status="failed", summary={"error": f"{type(exc).__name__}: {exc}"})
            raise


@contextlib.contextmanager
def _failed_record(instrumentor, record: dict[str, Any]) -> Iterator[list[bool]]:
    """Around a recorded run: its OTLP exports get an opening record (its name, trace, config,
    behaviours, created) with their first spans, so a collected copy of a replay killed with -9,
    which sends no other, keeps its settings; when it raises before its record was sent (``sent``
    holds True once it was), a ``failed`` record, as its store marks it (a collected copy of a
    stopped or failed replay read ``incomplete``, with no error)."""
    sent: list[bool] = []
    if instrumentor is not None:
        instrumentor.open_run(record)
    try:
        yield sent
    except BaseException as exc:
        if instrumentor is not None and not sent:
            with contextlib.suppress(Exception):  # (the run's own error matters more)
                instrumentor.record_run({**record, "status": "failed",
                                         "summary": {"error": f"{type(exc).__name__}: {exc}"}})
        raise


def _recording(store, run_id: str, otlp_endpoint: str | None, otlp: bool, seed: int, time_offset_ns: int | None,
               resource_attributes: dict[str, Any] | None = None, export_run_id: str | None = None):
    """The span recording of a run, or nothing when spans go nowhere (building them is
    the cost, so an unrecorded replay builds none). ``otlp``: spans go to a collector (the
    flag's or the standard variables'), naming the run ``export_run_id``. ``time_offset_ns``:
    the store's offset of the run's times, which an OTLP export reuses (metadata: not in
    the digest)."""
    if store is None and not otlp:
        return contextlib.nullcontext(None)
    from kvtrace.instrument import recording

    # background: the store's once-a-second commit (open, insert, checkpoint on close) runs on
    # the export thread, beside the replay, not inside it
    return recording(store=store, run_id=run_id, otlp_endpoint=otlp_endpoint, seed=seed,
                     time_offset_ns=time_offset_ns, background=True, resource_attributes=resource_attributes,
                     export_run_id=export_run_id, export=otlp)


def backend_resource(config: dict[str, Any]) -> dict[str, Any] | None:
    """The span resource attributes naming a run's cache backend: ``kvtrace.backend``,
    ``kvtrace.vllm.version`` and ``kvtrace.vllm.commit`` (when known). None for the
    kvtrace backend: its spans carry no resource attributes per row (absent = kvtrace)."""
    if config.get("backend", "kvtrace") == "kvtrace":
        return None
    from kvtrace.store.schema import BACKEND_RESOURCE_KEY

    attrs = {BACKEND_RESOURCE_KEY: config["backend"], "kvtrace.vllm.version": config.get("vllm_version")}
    if config.get("vllm_commit"):
        attrs["kvtrace.vllm.commit"] = config["vllm_commit"]
    return attrs


def _quoted(value: Any) -> str:
    """A setting's value as its refusal quotes it: a string as typed, anything else as
    shown_value shows it (str() of an int past 4,300 digits, or of an object whose repr
    raises, raised its own exception in place of the error line)."""
    if isinstance(value, str):
        return value
    if isinstance(value, numbers.Number):  # (a numpy int as the CLI would print it: 3, not np.int64(3))
        try:
            return str(value)
        except Exception:  # (an int past 4,300 digits; a caller's number whose str raises)
            pass
    return shown_value(value)


def is_set(value: Any, default: Any) -> bool:
    """Whether a spec's setting differs from its default: a value whose != raises or is no
    bool (a numpy array: its truth ValueError) is set."""
    try:
        return bool(value != default)
    except Exception:  # (whatever a caller's __eq__ or __ne__ raises)
        return True


def _whole(value: Any) -> bool:
    """An int, not a bool (nor a numpy int, which check_option and the presets refuse too)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_spec(spec: object, name: str = "spec") -> None:
    """A ConfigError for an API caller's spec that is no RunSpec (a sweep's, a curve's or a
    study's base of 5 was an AttributeError)."""
    if not isinstance(spec, RunSpec):
        raise ConfigError(name, shown_value(spec), "expected a RunSpec")


def _check_types(spec: RunSpec) -> None:
    """A ConfigError at its flag for an API caller's setting of another type than the CLI
    gives: content="no" ran with content (a non-empty string is true) and was recorded as
    "no"; a name of 123 or ["x"] was stored as the text "123" or "[x]"."""
    check_spec(spec)
    if not isinstance(spec.trace, str):
        raise ConfigError("TRACE", shown_value(spec.trace), "expected a trace file's path or gen:NAME, a string")
    if not isinstance(spec.content, bool):
        raise ConfigError("--no-content", shown_value(spec.content), "expected content True or False")
    if spec.name is not None and not isinstance(spec.name, str):
        raise ConfigError("--name", shown_value(spec.name), "expected a string")
    # (a list or a dict as the preset was an unhashable TypeError; a numpy array in any of them
    # its truth ValueError)
    for flag, value, optional in (("--preset", spec.preset, True), ("--mode", spec.mode, False),
                                  ("--policy", spec.policy, False), ("--format", spec.trace_format, True),
                                  ("--backend", spec.backend, False)):
        if not (isinstance(value, str) or (optional and value is None)):
            raise ConfigError(flag, shown_value(value), "expected a string" + (", or None" if optional else ""))
    if spec.config_file is not None and not isinstance(spec.config_file, (str, os.PathLike)):
        raise ConfigError("--config", shown_value(spec.config_file), "expected a TOML file's path, or None")
    without = spec.without
    if not isinstance(without, str) and (not isinstance(without, (tuple, list)) or not all(
            isinstance(b, str) for b in without)):  # (None, or (5,): a TypeError where the flags were named)
        raise ConfigError("--without", shown_value(without), "expected a sequence of behaviour names")


_SINK_METHODS = ("append_spans", "flush_if_due", "flush", "release")


def _check_destinations(db: Any, otlp_endpoint: Any, store: Any, spans_to: Any, **flags: Any) -> None:
    """A ConfigError for an API caller's destination of another type than the CLI gives: a db
    of 0 or True was a DuckDB file named "0" or "True" in the current directory, an endpoint
    of 5 an AttributeError inside urllib, a store or spans_to that is none an AttributeError
    (spans_to's after the whole run), a numpy array for a flag its truth ValueError."""
    if db is not None:
        from kvtrace.store.backend import check_db_type

        check_db_type(db)
    if otlp_endpoint is not None and not isinstance(otlp_endpoint, str):
        raise ConfigError("--otlp-endpoint", shown_value(otlp_endpoint), "expected a collector's URL, a string")
    if store is not None:
        from kvtrace.store import Store  # (only then: a run without one imports no store)

        if not isinstance(store, Store):
            raise ConfigError("store", shown_value(store), "expected an open kvtrace Store (Store.open(db)), or None")
    if spans_to is not None and not all(callable(getattr(spans_to, m, None)) for m in _SINK_METHODS):
        raise ConfigError("spans_to", shown_value(spans_to), f"expected an object with {', '.join(_SINK_METHODS)}")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ConfigError(name, shown_value(value), "expected True or False")
    # (one destination of the run's spans: with two, the store won and the other was dropped unsaid,
    # a db's file never made, a spans_to never called)
    if store is not None and db is not None:
        raise ConfigError("store", shown_value(store), f"given with db={shown_value(db)}; give one of them")
    if spans_to is not None and (store is not None or db is not None):
        raise ConfigError("spans_to", shown_value(spans_to), "takes the spans of a run without a store; give it "
                                                               "or a db (or an open store), not both")


def _numpy_int_advice(value: Any) -> str | None:
    """What a count that is a numpy (or another library's) integer is told, else None: it is
    a whole number to its reader (np.int64(100) read "100: expected a number of blocks")."""
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
        kind = type(value)
        return f"expected a Python int, not {kind.__module__}.{kind.__name__} (int() it)"
    return None


def _check_whole_numbers(spec: RunSpec) -> None:
    """A ConfigError at its flag for a count of the spec that is no whole number: the CLI's
    are ints, an API caller's 1.5 reached the cache's config (a TypeError) or was truncated
    (a seed of 1.5 ran as 1)."""
    for name, flag in (("block_size", "--block-size"), ("capacity_tokens", "--capacity-tokens"),
                        ("external_capacity_blocks", "--external-blocks"), ("seed", "--seed")):
        value = getattr(spec, name)
        if value is not None and not _whole(value):
            # (np.int64(3) read "3: expected a whole number", a whole number to its reader)
            kind = type(value)
            numpy_int = isinstance(value, numbers.Integral) and not isinstance(value, bool)
            why = (f"expected a Python int, not {kind.__module__}.{kind.__name__} (int() it)" if numpy_int
                   else "expected a whole number")
            raise ConfigError(flag, _quoted(value), why)
    blocks = spec.capacity_blocks  # (also inf, cache-only's unbounded cache, or one int per group: a tuple)
    if blocks is not None and not isinstance(blocks, (numbers.Number, tuple)):  # (an array: its truth ValueError)
        raise ConfigError("--capacity-blocks", shown_value(blocks),
                          "expected a number of blocks, or inf (cache-only mode)")
    if blocks is not None and blocks != math.inf and not _whole(blocks) and not (
            isinstance(blocks, tuple) and all(map(_whole, blocks))):
        raise ConfigError("--capacity-blocks", _quoted(blocks), _numpy_int_advice(blocks)
                          or "expected a number of blocks, or inf (cache-only mode)")
    if isinstance(spec.without, str):  # (its letters were taken for behaviour names)
        raise ConfigError("--without", spec.without, "expected a sequence of behaviour names, not one string")


def check_percentiles(percentiles: Any) -> tuple[float, ...]:
    """An API caller's percentiles as the CLI's --percentiles parses them (floats 0..100, each
    once, in the given order); a one-line ConfigError otherwise. (An API caller's reached the
    summary after the whole run; numpy's numbers are numbers too.)"""
    if getattr(percentiles, "ndim", None) == 1 and hasattr(percentiles, "tolist"):  # (a numpy array of them)
        percentiles = tuple(percentiles) if _narrow_float(percentiles) else tuple(percentiles.tolist())
    if isinstance(percentiles, (tuple, list)):
        # a float32's 99.9 widened is 99.9000015...: recorded as the number it prints, as the CLI reads "99.9"
        percentiles = [float(str(p)) if _narrow_float(p) else p for p in percentiles]
    if isinstance(percentiles, (str, bytes)) or not isinstance(percentiles, (tuple, list)):
        # (a string's characters were taken one by one; a generator was used up by the check)
        raise ConfigError("--percentiles", shown_value(percentiles), "expected a tuple of numbers, e.g. (50, 90, 99)")
    listed = ",".join(map(_quoted, percentiles))  # (str() of an int past 4,300 digits, of a raising repr: raised)
    odd = next((p for p in percentiles if isinstance(p, bool) or not isinstance(p, numbers.Real)), None)
    if odd is not None:  # ('50' passed float() below, and broke the summary's numpy)
        raise ConfigError("--percentiles", listed, f"percentile {shown_value(odd)} is not a number")
    try:
        return parse_percentiles(list(percentiles))
    except ValueError as err:
        raise ConfigError("--percentiles", listed, str(err)) from None


def _narrow_float(value: Any) -> bool:
    """Whether ``value`` is a numpy float (or array of them) narrower than Python's float."""
    dtype = getattr(value, "dtype", None)
    return getattr(dtype, "kind", None) == "f" and getattr(dtype, "itemsize", 8) < 8


def validate(spec: RunSpec) -> tuple[dict[str, Any], list[str], Any]:
    """(the run's config record, its behaviours, the engine preset or None) for a spec
    whose every setting is usable in its mode; a one-line ConfigError otherwise."""
    if spec.mode not in MODES:
        raise ConfigError("--mode", spec.mode, f"expected one of {', '.join(MODES)}")
    # (as a file's reader holds it: a generated workload took 0, an empty run recorded, and True, 1 request)
    advice = _numpy_int_advice(spec.limit)
    if advice is not None:  # (np.int64(3) read "expected a number of requests >= 1")
        raise ConfigError("--limit", _quoted(spec.limit), advice)
    check_limit(spec.limit)
    _check_types(spec)
    _check_whole_numbers(spec)
    check_seed(spec.seed)
    check_percentiles(spec.percentiles)
    if spec.block_size is not None:  # (engine mode without content allocates nothing that would refuse it)
        check_option("--block-size", spec.block_size, 1, MAX_TOKENS)
    if spec.capacity_tokens is not None:
        # one capacity: in blocks or in tokens (each mode would otherwise drop one silently)
        if spec.capacity_blocks is not None:
            raise ConfigError("--capacity-tokens", _quoted(spec.capacity_tokens),
                              f"give either it or --capacity-blocks ({spec.capacity_blocks}), not both")
        check_option("--capacity-tokens", spec.capacity_tokens, 1)
    from kvtrace.engine.backends import BACKENDS, DEFAULT_BACKEND

    if spec.backend not in BACKENDS:
        raise ConfigError("--backend", spec.backend, f"expected one of {', '.join(BACKENDS)}")
    if spec.mode != "engine" and spec.backend != DEFAULT_BACKEND:
        raise ConfigError("--backend", spec.backend, "applies to engine mode only: cache-only mode replays one LRU "
                                                     "over the trace's blocks, not a cache manager (use --mode engine)")
    if spec.backend != DEFAULT_BACKEND and spec.without:
        raise ConfigError("--without", ",".join(spec.without), f"switches kvtrace's own behaviours; the {spec.backend} "
                                                               "backend runs the installed vLLM's code as it is (patch "
                                                               "vLLM instead, or use --backend kvtrace)")
    if spec.mode == "engine":
        from kvtrace.engine.memory import check_storage_fits

        if spec.capacity_blocks == math.inf:
            raise ConfigError("--capacity-blocks", "inf", "engine mode holds its blocks in device storage and needs a "
                                                          "number (an unbounded cache is for --mode cache-only)")
        if spec.policy != "lru":  # (the engine's cache evicts as vLLM's does: its free queue)
            raise ConfigError("--policy", spec.policy, "applies to cache-only mode only: engine mode evicts as "
                                                       "vLLM's cache manager does (drop it, or use --mode cache-only)")

        if spec.backend != DEFAULT_BACKEND and spec.config_file:  # the file's switches, as --without's
            without = load_config_file(spec.config_file).cache.get("without")
            if without:
                raise ConfigError(spec.config_file, "cache.without",
                                  f"switches kvtrace's own behaviours; the {spec.backend} backend runs the installed "
                                  "vLLM's code as it is (patch vLLM instead, or use --backend kvtrace)")
        preset = engine_preset(spec)
        if spec.content:  # no device storage without content
            try:
                check_storage_fits(preset.cache_config)
            except ConfigError as err:
                raise _storage_error_at_origin(err, spec) from None
        config = config_json(preset)
        config["content"] = spec.content
        config["backend"] = spec.backend
        if tuple(spec.percentiles) != DEFAULT_PERCENTILES:
            config[PERCENTILES_CONFIG_KEY] = list(spec.percentiles)
        if spec.backend != DEFAULT_BACKEND:
            from kvtrace.engine.backends.vllm import UnsupportedConfig, check_engine_backend

            try:
                config.update(check_engine_backend(preset.cache_config))
            except UnsupportedConfig as err:
                raise unsupported_at_origin(err, spec) from None
        return config, config["cache"]["behaviours"], preset
    from kvtrace.replay.cache_only import POLICIES

    if spec.policy not in POLICIES:
        raise ConfigError("--policy", spec.policy, f"expected one of {', '.join(POLICIES)}")
    # Cache-only mode is one LRU (or Belady) over the trace's blocks: no KV cache groups,
    # no retention, no behaviours, no second tier. Settings of the engine's cache do
    # nothing here, so they are refused rather than ignored.
    engine_only = (
        ("--preset", spec.preset), ("--config", spec.config_file), ("--retention", spec.retention),
        ("--without", ",".join(spec.without) or None), ("--external-blocks", spec.external_capacity_blocks),
        ("--no-content", None if spec.content else "set"),
    )
    for flag, value in engine_only:
        if value is not None:
            raise ConfigError(flag, _quoted(value), "applies to engine mode only: cache-only mode replays one LRU over "
                                                "the trace's blocks (drop it, or use --mode engine)")
    unbounded = spec.capacity_blocks in (None, math.inf) and spec.capacity_tokens is None
    if not unbounded:
        _check_cache_only_capacity(spec)
    # None: unbounded; --capacity-tokens as the blocks it makes (the run's own capacity: it was
    # stored as None, an unbounded run, and paired with runs of other capacities)
    blocks = spec.capacity_blocks
    if spec.capacity_tokens is not None and spec.block_size:  # (_check_cache_only_capacity wants both)
        blocks = cdiv(spec.capacity_tokens, spec.block_size)  # (the replay's rounding: up)
    config = {"mode": "cache-only", "policy": spec.policy, "block_size": spec.block_size,
              "capacity_blocks": None if unbounded else blocks}
    return config, [], None


def _check_cache_only_capacity(spec: RunSpec) -> None:
    """A bounded cache-only capacity, refused at its flag unless the pool can hold it (a
    bounded pool is allocated whole; an unbounded one grows with the trace)."""
    from kvtrace.replay.cache_only import MAX_CAPACITY_BLOCKS

    given: int | float | None
    blocks: int | float
    if spec.capacity_tokens is not None:
        flag, given = "--capacity-tokens", spec.capacity_tokens
        if spec.block_size is None:
            raise ConfigError(flag, _quoted(given), "cache-only mode needs --block-size with it")
        blocks = cdiv(spec.capacity_tokens, spec.block_size)
    else:
        flag, given = "--capacity-blocks", spec.capacity_blocks
        assert given is not None  # (the caller: bounded)
        blocks = check_option(flag, given, 1)
    if blocks > MAX_CAPACITY_BLOCKS:
        raise ConfigError(flag, _quoted(given), f"{_quoted(blocks) if blocks > 2**64 else format(blocks, ',')} blocks "
                                                f"is beyond what a bounded pool can hold (at most "
                                                f"{MAX_CAPACITY_BLOCKS:,}); omit it, or say --capacity-blocks inf, "
                                                "for an unbounded cache")


def run_record(spec: RunSpec, result: RunResult) -> dict[str, Any]:
    """The fields ``Store.create_run`` takes for a replay made elsewhere (a sweep worker)."""
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in result.record.items()}


def _default_name(spec: RunSpec, behaviours: list[str], preset: Any = None) -> str:
    parts = [Path(spec.trace).name if not spec.trace.startswith(GENERATED_PREFIX) else spec.trace, spec.mode]
    if spec.mode == "engine":
        parts.append(preset.name if preset is not None else spec.preset or DEFAULT_PRESET)  # (a --config's preset too)
        if not spec.content:
            parts.append("no-content")
        if spec.backend != "kvtrace":
            parts.append(f"backend={spec.backend}")
    else:
        parts.append(spec.policy)
    if spec.without:
        parts.append("without " + ",".join(spec.without))
    if spec.retention is not None:
        parts.append(f"retention={spec.retention}")
    if spec.capacity_tokens is not None:
        parts.append(f"tokens={spec.capacity_tokens}")
    elif spec.capacity_blocks is not None or spec.mode != "engine":
        parts.append(f"blocks={'inf' if spec.capacity_blocks in (None, math.inf) else spec.capacity_blocks}")
    # every other setting given, so two runs that differ in it are told apart in `runs`
    for label, value in (("block_size", spec.block_size), ("trace_block_size", spec.trace_block_size),
                         ("external", spec.external_capacity_blocks)):
        if value is not None:
            parts.append(f"{label}={value}")
    if spec.config_file:
        parts.append(f"config={Path(spec.config_file).name}")
    return " ".join(parts)


def _run_engine(preset, workload: _Workload, digest: Digest, instrumentor, bar: _Progress, content: bool,
                percentiles: tuple[float, ...], backend: str = "kvtrace"):
    from kvtrace.engine import Engine
    from kvtrace.engine.events import RequestFinished

    def progress_listener(batch) -> None:
        bar.advance(sum(1 for e in batch.engine_events if isinstance(e, RequestFinished)))

    listeners: list[Callable] = [digest.on_step]
    if instrumentor is not None:
        listeners.append(instrumentor.on_step)
    listeners.append(progress_listener)
    engine = Engine(preset, content=content, percentiles=percentiles, backend=backend)
    result = engine.run(workload.requests, listeners=listeners)
    done = result.requests  # (a FinishedRequests: each request's gaps read as an array, no int object a gap)
    per_request = [
        {
            "request_id": r.request_id,
            "prompt_tokens": r.num_prompt_tokens,
            "hit_tokens": r.num_local_hit_tokens + r.num_external_hit_tokens,
            "ttft_ns": r.first_token_ns - r.arrival_ns,
            # (each gap between its tokens, an array('q'): a study's bootstrap without a store)
            "itl_ns": done.gaps(i),
            "divergent_tokens": r.num_divergent_tokens,
        }
        for i, r in enumerate(done.without_gaps())
    ]
    summary = dict(result.summary)
    summary["capacity_blocks"], summary["block_size"] = engine_capacity(preset.cache_config)
    return summary, per_request


def engine_capacity(cache) -> tuple[int | None, int | None]:
    """An engine run's ``capacity_blocks`` and ``block_size`` in cache-only's units, as
    ``runs`` and the capacity curve read a stored config: the pool the first full-attention
    group allocates from, less vLLM's null block, and that group's block size. (The summary
    had neither: ``diff`` showed null where ``runs`` showed 11×512.)"""
    g = cache.unit_group
    return (None, None) if g is None else (cache.pool_sizes[g] - 1, cache.groups[g].block_size)


def _run_cache_only(spec: RunSpec, blocked: tuple[list[TraceRequest], int], digest: Digest, instrumentor,
                    bar: _Progress):
    from kvtrace.replay.cache_only import replay_cache_only

    capacity = spec.capacity_blocks  # None or inf (and no --capacity-tokens): unbounded
    if capacity is None and spec.capacity_tokens is not None:
        assert spec.block_size is not None  # (validate: cache-only --capacity-tokens needs --block-size)
        capacity = cdiv(spec.capacity_tokens, spec.block_size)
    listeners: list[Callable] = [digest.on_cache_events]
    if instrumentor is not None:  # (Belady's: one lookup a request, its only events)
        listeners.append(instrumentor.on_cache_events)
    done = [0]
    stopped = stop_pending

    def on_progress(n: int) -> None:  # (after each request: cache-only's step)
        if stopped():  # Ctrl-C or SIGTERM whose KeyboardInterrupt a finalizer swallowed: stop here
            raise_stop()
        bar.advance(n - done[0])
        done[0] = n

    requests, block_size = blocked  # (at one block size already: replay_cache_only keeps them as they are)
    res = replay_cache_only(
        requests, capacity_blocks=capacity, block_size=block_size,
        policy=spec.policy, listeners=listeners, progress=on_progress,
    )
    from kvtrace.store.schema import SUMMARY_FIELDS

    summary = res.summary(spec.percentiles)
    for key in SUMMARY_FIELDS:  # engine-only fields (no CoW, no audit, no preemption): not measured
        if not is_latency_key(key):  # (its latency keys are the --percentiles' as an engine run's: p99 at 10 was null)
            summary.setdefault(key, None)
    per_request = [
        {"request_id": rid, "hit_tokens": hit}
        for rid, hit in zip(res.request_ids, res.per_request_hit_tokens)
    ]
    return summary, per_request
