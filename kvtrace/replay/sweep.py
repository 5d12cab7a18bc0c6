"""``kvtrace sweep``: every combination of a few settings, each an independent replay.

A capacity x retention x behaviour study is dozens of replays that share nothing, so
they fan out: over local worker processes (default) or as tasks on a Ray cluster
(``--ray ADDRESS``, ``--ray auto``; the optional ``kvtrace[ray]``). Workers write nothing
to the store: each returns its summary and its spans as Arrow tables, and this process,
the one writer, records them as ordinary runs tagged with the sweep id (``config.sweep``).
A replay's events, digest and stored rows do not depend on where it ran: spans are
built from the seed alone, and the run id is given only when the driver stores them.

Parameters are ``RunSpec`` fields: ``capacity_blocks``, ``capacity_tokens``,
``external_capacity_blocks``, ``block_size``, ``retention``, ``preset``, ``policy``,
``mode`` and ``without`` (behaviour names joined with ``+``, or ``none``).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from kvtrace.errors import ConfigError, KVTraceError, TraceFormatError
from kvtrace.metrics import points_text
from kvtrace.names import BEHAVIOURS, printable, shown_value
from kvtrace.process import (
    STOP_SIGNALS,
    handled_stop_signals,
    sigterm_blocked,
    stop_for,
    stop_handlers_kept,
    worker_start,
)
from kvtrace.replay.config_file import parse_retention
from kvtrace.replay.run import FLAG_OF_FIELD, RunResult, RunSpec, is_set, is_unbounded, run_replay
from kvtrace.workload.lines import parse_decimal

_INT_PARAMS = ("capacity_blocks", "capacity_tokens", "external_capacity_blocks", "block_size")
_TEXT_PARAMS = ("retention", "preset", "policy", "mode")
PARAMETERS = (*_INT_PARAMS, *_TEXT_PARAMS, "without")
# The metrics the closing table shows (summary keys; absent ones print as '-'; one no run has,
# left out): the medians by the names every summary carries, whatever --percentiles the runs
# had; the external tier's hit rate where a run had a tier (prefix_cache_hit_rate is the local
# cache's: a sweep of external_capacity_blocks showed columns the tier could not move).
TABLE_METRICS = ("prefix_cache_hit_rate", "prefix_cache_hits", "external_prefix_cache_hit_rate", "evictions",
                 "median_ttft_ms", "median_itl_ms", "divergent_outputs")
ENGINE_METRICS = ("median_ttft_ms", "median_itl_ms", "divergent_outputs")  # nothing to say in cache-only mode
# Combinations of one sweep at most (each a replay): counted before any is built, so that a
# few long --param lists cannot fill the memory with their product.
MAX_COMBINATIONS = 10_000
IN_FLIGHT_PER_WORKER = 2  # local replays queued or held unstored, per worker process
# What a worker sends back of one replay: its result, its span tables (when kept) and the
# sha256 of the --config file as it read it (None: no file)
Replayed = tuple[RunResult, list, str | None]


def parse_param(text: str, flag: str = "--param", names: Sequence[str] = PARAMETERS) -> tuple[str, list[Any]]:
    """``NAME=V1,V2,...`` -> (name, values typed for the RunSpec field); ``names``: the
    parameters ``flag`` takes (a study sweeps fewer)."""
    name, sep, raw = text.partition("=")
    name = name.strip()
    values = [v.strip() for v in raw.split(",")]
    if not sep or not all(values):  # (an empty item, as in 10,,20, is a typo: refused as --capacities does)
        raise ConfigError(flag, text, f"expected NAME=V1,V2,... (no empty value) with NAME one of "
                                      f"{', '.join(names)}")
    if name not in names:
        raise ConfigError(flag, text, f"unknown parameter {name!r}; expected one of {', '.join(names)}")
    if name in _INT_PARAMS:
        # (ASCII digits: int() also took 1_0 and other scripts' digits); capacity_blocks may be
        # inf, as for replay: cache-only's unbounded cache
        ints = [math.inf if name == "capacity_blocks" and is_unbounded(v) else parse_decimal(v) for v in values]
        long = next((v.lstrip("+-") for v, i in zip(values, ints) if i is None and v.lstrip("+-").isascii()
                     and v.lstrip("+-").isdigit()), None)
        if long is not None:  # (an integer all the same: 'values must be integers' said of one was untrue)
            raise ConfigError(flag, text, f"{name} values must be integers of at most 40 digits ({len(long):,} given)")
        if None in ints:
            raise ConfigError(flag, text, f"{name} values must be integers"
                                          + (" (or inf)" if name == "capacity_blocks" else ""))
        return name, ints
    if name == "without":  # (each switch once: a+a is a)
        return name, [() if v.lower() == "none" else _switches(flag, name, v) for v in values]
    return name, values


def _switches(flag: str, name: str, value: str) -> tuple[str, ...]:
    """One ``without`` value, ``a+b``, as its sorted switches; an empty or unknown one is
    refused here, at the value (``+`` or ``a+`` ran as without=none in cache-only mode, and
    in engine mode was blamed on a 'preset' no one gave)."""
    switches = [s.strip() for s in value.split("+")]
    if not all(switches):
        raise ConfigError(flag, f"{name}={value}", "an empty behaviour name; join behaviours with + (or say none)")
    unknown = sorted(set(switches) - set(BEHAVIOURS))
    if unknown:
        raise ConfigError(flag, f"{name}={value}", f"unknown behaviour {', '.join(unknown)}; expected none or "
                                                   f"some of {', '.join(BEHAVIOURS)} joined by +")
    return tuple(sorted(set(switches)))


def _canonical(name: str, value: Any) -> Any:
    """What a swept value means (retention's spellings: none, None, 00, 0)."""
    if name != "retention":
        return value
    try:
        return parse_retention(value)
    except ConfigError:
        return value


def parse_baseline(text: str | None, params: Sequence[tuple[str, list[Any]]]) -> dict[str, Any] | None:
    """``NAME=V,NAME2=V2`` -> the combination the sweep table's deltas are taken against."""
    if text is None:
        return None
    swept = dict(params)
    out: dict[str, Any] = {}
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise ConfigError("--baseline", text, "expected NAME=V,... naming swept values")
    for part in parts:
        name, values = parse_param(part, flag="--baseline")
        if name in out:
            raise ConfigError("--baseline", text, f"{name} is given twice")
        if name not in swept:
            raise ConfigError("--baseline", text, f"{name} is not swept (swept: {', '.join(sorted(swept))})")
        # (checked before the sweep runs, --json or not; a value in any spelling the setting
        # reads the same, e.g. retention None for none, stands for the swept one)
        same = [v for v in swept[name] if _canonical(name, v) == _canonical(name, values[0])]
        if not same:
            raise ConfigError("--baseline", text, f"no combination of the sweep has these values: {part.strip()} "
                                                  "is not one of the swept values")
        out[name] = same[0]
    return out or None


def combinations(params: Sequence[tuple[str, list[Any]]], flag: str = "--param") -> list[dict[str, Any]]:
    """Every combination, in the order the parameters and their values were given (``flag``:
    the option that gave them, which a refusal names)."""
    names = [n for n, _ in params]
    if len(set(names)) != len(names):
        raise ConfigError(flag, ",".join(names), "a parameter is given twice")
    for name, values in params:  # a value twice (in any spelling) ran twice: equal runs, the store's twice
        shown = [label({name: v}).partition("=")[2] for v in values]
        first: dict[Any, int] = {}
        for i, v in enumerate(values):
            j = first.setdefault(_canonical(name, v), i)
            if j != i:
                raise ConfigError(flag, f"{name}={','.join(shown)}", f"{shown[i]} is given twice"
                                  + (f" (as {shown[j]})" if shown[j] != shown[i] else ""))
    count = math.prod(len(v) for _, v in params)
    if count > MAX_COMBINATIONS:
        raise ConfigError(flag, ",".join(names), f"{count:,} combinations; a sweep runs at most "
                                                      f"{MAX_COMBINATIONS:,} (split it)")
    return [dict(zip(names, values)) for values in itertools.product(*(v for _, v in params))]


CAPACITY_FORMS = ("capacity_blocks", "capacity_tokens")  # one setting in blocks or in tokens


def swept_capacity_advice(text: str, swept: str) -> str:
    """An engine error's advice to raise --capacity-blocks, which a sweep of the capacity
    replaces, told as raising the ``swept`` values instead (sweep, curve and study)."""
    from kvtrace.engine.engine import POOL_ADVICE

    return text.replace(POOL_ADVICE, f"raise the {swept}")


def at_swept_value(err: ConfigError, combo: dict[str, Any], values_flag: str) -> ConfigError:
    """A combination's refusal, restated at the swept value that made it when it names that
    setting's flag (``--capacity-blocks: 0: ...`` of ``--param capacity_blocks=0``)."""
    for name, value in combo.items():
        if err.source == FLAG_OF_FIELD.get(name):  # (a refusal names the flag; the value was swept)
            shown = label({name: value}).partition("=")[2]
            return ConfigError(values_flag, f"{name}={shown}" if values_flag in ("--param", "--sweep") else shown,
                               err.what)
    return err


def label(combo: dict[str, Any]) -> str:
    return " ".join(f"{k}={'+'.join(v) or 'none' if k == 'without' else v}" for k, v in combo.items())


def stored_params(combo: dict[str, Any]) -> dict[str, Any]:
    """A combination as JSON holds it: switches as a list, the unbounded cache as null, as
    a run's own ``capacity_blocks`` says it (inf was stored as ``Infinity``, no JSON)."""
    return {k: list(v) if isinstance(v, tuple) else None if v == math.inf else v for k, v in combo.items()}


@dataclass(slots=True)
class SweepRun:
    combo: dict[str, Any]
    summary: dict[str, Any]
    run_id: str | None = None


@dataclass(slots=True)
class SweepResult:
    sweep_id: str
    runs: list[SweepRun] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"sweep_id": self.sweep_id,
                "runs": [{"params": stored_params(r.combo),
                          "run_id": r.run_id, **r.summary} for r in self.runs]}


class _CollectedSpans:
    """Where a worker's exporter puts spans: kept as the Arrow tables the store would get."""

    def __init__(self) -> None:
        self.tables: list = []

    def append_spans(self, table, run_id=None, *, flush_when_due: bool = True) -> int:
        self.tables.append(table)
        return table.num_rows

    def flush_if_due(self) -> int:
        return 0

    def flush(self) -> int:
        return 0

    def release(self) -> None:
        """(A store's: nothing held here.)"""


DEFAULT_WORKERS = 2  # local worker processes when --workers is not given


def check_workers(workers: int | None, ray_address: str | None = None) -> None:
    """ConfigError naming --workers unless it is None (not given) or a count >= 1 (of local
    processes, or with ``ray_address`` of replays in flight on the cluster)."""
    if workers is not None and (type(workers) is not int or workers < 1):
        what = "processes" if ray_address is None else "replays in flight on the cluster"
        raise ConfigError("--workers", shown_value(workers), f"expected a number of {what} >= 1")


def _replay_one(spec: RunSpec, keep_spans: bool) -> Replayed:
    """One replay in a worker: its result, its span tables when kept, and the sha256 of the
    --config file as the replay found it (it reads the file first thing)."""
    config = _config_digest(spec.config_file)
    sink = _CollectedSpans() if keep_spans else None
    return run_replay(spec, spans_to=sink, export=False), (sink.tables if sink is not None else []), config


def _check_params(params: object) -> None:
    """A ConfigError for an API caller's params that are no sequence of (setting name, values)
    pairs (None, 5, "x", a pair's values of 5: TypeErrors and ValueErrors inside the sweep)."""
    pairs = params if isinstance(params, (list, tuple)) else None
    bad = shown_value(params) if pairs is None else next(
        (shown_value(p) for p in pairs if not (isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str)
                                              and isinstance(p[1], (list, tuple)))), None)
    if bad is not None:
        raise ConfigError("--param", bad, "expected a sequence of (setting name, list of values) pairs")
    # (a name that is no RunSpec setting: an AttributeError, 'name' a TypeError; a value that is
    # no key, a list or an array: an unhashable TypeError)
    settings = {f.name for f in fields(RunSpec)} - {"name"}
    for name, values in pairs or ():
        if str.__str__(name) not in settings:
            raise ConfigError("--param", shown_value(name), f"unknown parameter; expected a RunSpec setting, such as "
                                                            f"{', '.join(PARAMETERS)}")
        for value in values:
            try:  # (a key, and a label: str() of an int past 4,300 digits or of a raising repr raised there)
                hash(value)
                str(value)
            except Exception:  # (whatever a caller's __hash__, __str__ or __repr__ raises)
                raise ConfigError("--param", f"{name}={shown_value(value)}",
                                  "expected a setting's value (a number, a string or a tuple)") from None


def _check_callers(on_done: object, ray_address: object, values_flag: object) -> tuple[str | None, str]:
    """A ConfigError for an API caller's on_done that is no callable (a TypeError after the
    first replay, the rest never run), ray_address or values_flag that is no string (a
    TypeError, or a numpy truth ValueError, inside the sweep)."""
    if on_done is not None and not callable(on_done):
        raise ConfigError("on_done", shown_value(on_done), "expected a callable taking each SweepRun, or None")
    if ray_address is not None and not isinstance(ray_address, str):
        raise ConfigError("--ray", shown_value(ray_address), "expected HOST:PORT, ray://HOST:PORT, auto or local")
    if not isinstance(values_flag, str):
        raise ConfigError("values_flag", shown_value(values_flag), "expected the option the values were typed in")
    # (as plain strings: a str subclass's own __eq__ never runs inside the sweep)
    return (None if ray_address is None else str.__str__(ray_address)), str.__str__(values_flag)


def run_sweep(
    base: RunSpec,
    params: Sequence[tuple[str, list[Any]]],
    *,
    db: str | Path | None = None,
    workers: int | None = None,
    ray_address: str | None = None,
    on_done: Callable[[SweepRun], None] | None = None,
    values_flag: str = "--param",
) -> SweepResult:
    """Replay ``base`` with every combination of ``params``; record each into ``db``.
    ``workers``: local worker processes (None: 2), or with ``ray_address`` the most Ray
    tasks in flight at once (None: every replay submitted at once).
    ``values_flag``: the option the swept values were typed in (a refused one is named there:
    ``--param NAME=V``, or the values of one named option, as curve's ``--capacities``)."""
    from kvtrace.replay.run import check_spec

    check_spec(base, "base")
    if db is not None:
        from kvtrace.store.backend import check_db_type

        check_db_type(db)  # (before any replay: Store.open meets it after every one)
    _check_params(params)
    ray_address, values_flag = _check_callers(on_done, ray_address, values_flag)
    combos = combinations(params)
    if not combos:
        raise KVTraceError("sweep: no parameter values to sweep")
    check_workers(workers, ray_address)
    bare = RunSpec(trace=base.trace)
    swept = [name for name, _ in params]
    for name in swept:  # a swept setting also set for the whole sweep: one of them would be dropped
        # (the capacity in blocks and in tokens are one setting: "give either it or --capacity-blocks (30)"
        # named a flag never typed)
        for other in CAPACITY_FORMS if name in CAPACITY_FORMS else (name,):
            if other != name and other in swept:
                raise ConfigError("--param", name, f"is swept with {other}, the same capacity in other units; "
                                                   "sweep one of them")
            if is_set(getattr(base, other), getattr(bare, other)):
                given = f"{other} = " if other != name else ""
                value = getattr(base, other)
                # (a tuple of names as the flag spells it: "(('shared-prefix-pinning',))" was shown)
                shown = ",".join(map(str, value)) if isinstance(value, (tuple, list)) else shown_value(value)
                raise ConfigError("--param", name, f"is also set for the whole sweep ({given}{shown}); give it "
                                                   "one way")
    if base.config_file and any(name == "without" for name, _ in params):
        # (a file's switches add to every run's: a run labelled without=none would run without them)
        from kvtrace.replay.config_file import load_config_file

        if load_config_file(base.config_file).cache.get("without"):
            raise ConfigError(str(base.config_file), "cache.without", "is also swept (--param without); "
                                                                      "give it one way")
    specs = [replace(base, **combo, name=f"{base.name or 'sweep'} {label(combo)}") for combo in combos]
    from kvtrace.replay.run import validate

    for spec, combo in zip(specs, combos):  # every combination refused up front, before anything runs
        try:
            validate(spec)
        except ConfigError as err:
            raise at_swept_value(err, combo, values_flag) from None
    # Each replay reads the --config file itself, as it reads the trace: one rewritten midway
    # gave runs of two configurations under one id. Its content as the sweep began (checked
    # as a file above: no FIFO to block on) is the id's, and a run is stored only if its
    # replay read that content.
    config_digest = _config_digest(base.config_file)
    out: SweepResult | None = None
    with contextlib.ExitStack() as stack:
        # Each result is stored as soon as it and every earlier one are back: in spec order
        # (run ids and seqs do not depend on which worker finished first), and a sweep stopped
        # or failed midway keeps the runs it finished. The store opens after every worker
        # forked; it closes first on the way out, marking a run it was storing failed.
        results = stack.enter_context(_results_in_order(specs, db is not None, workers, ray_address))
        store = None
        trace_digest = None  # (the first replay's: every later one read the same trace)
        latest: Any = None  # the created of the run stored last: no later run is given an older one
        named = _deaths_named(results, combos, lambda: len(out.runs) if out is not None else 0, db is not None,
                              values_flag)
        is_sweep = values_flag in ("--param", "--sweep")

        def stopped_at(combo: dict[str, Any]) -> str:
            """Where a sweep or curve stopped and what it kept, in the words a worker's death uses."""
            at = (f"the sweep stopped at {label(combo)}" if is_sweep else
                  f"the curve stopped at {values_flag} {label(combo).partition('=')[2]}")
            kept = _kept(len(out.runs) if out is not None else 0, len(combos), db is not None, is_sweep)
            return f"{at}, {kept}" + ("" if is_sweep or db is None else " (the curve itself is not recorded)")

        what = "sweep" if is_sweep else "curve"
        for spec, combo, (res, tables, config_read) in zip(specs, combos, named):
            if config_read != config_digest:
                raise ConfigError(str(base.config_file), None, f"changed while the {what} ran: its replay may have "
                                                               f"read other settings than the {what} began with; "
                                                               f"{stopped_at(combo)}")
            if out is None:
                trace_digest = res.record.get("trace_digest")
                out = SweepResult(_sweep_id(base, combos, trace_digest, config_digest))
                if db is not None:
                    from kvtrace.store import Store

                    store = stack.enter_context(Store.open(db))
            elif res.record.get("trace_digest") != trace_digest:  # (each replay reads the trace itself)
                raise TraceFormatError(base.trace, None, f"changed while the {what} ran: its replay read other "
                                                         f"content than the first; {stopped_at(combo)}")
            run = SweepRun(combo, res.summary)
            if store is not None:
                # (created: when the replay began, in its worker; a later combination's replay that
                # began first, on Ray or another worker, listed its run as older than an earlier one,
                # and `runs` ("newest first") in another order than the sequential sweep's)
                created = res.record.get("created")
                if isinstance(created, str) and latest is not None and created < latest:
                    res.record["created"] = latest
                latest = res.record.get("created")
                run.run_id = _record(store, spec, res, tables, out.sweep_id, combo)
                run.summary["run_id"] = run.run_id
            out.runs.append(run)
            if on_done is not None:
                on_done(run)
    assert out is not None  # (combinations() gives at least one)
    return out


def _deaths_named(results: Iterator[Replayed], combos: list[dict[str, Any]], done: Callable[[], int],
                  stored: bool, values_flag: str = "--param") -> Iterator[Replayed]:
    """``results``, with a worker's death (a local one: the pool broken; a Ray task's)
    restated at the combination it stopped the sweep at, and how many were kept before it:
    the one line said only that 'a worker' died, of a sweep of many. A replay's own error
    that no setting names (the engine's 'cannot be scheduled' of a swept capacity too small
    for a request) is named at its swept value, as a refusal before the replays is."""
    from concurrent.futures.process import BrokenProcessPool

    from kvtrace.process import stop_signalled

    for combo in combos:
        # (a curve's capacities are its --capacities values, no 'sweep' or 'combinations' it was told of)
        swept = values_flag in ("--param", "--sweep")
        stopped = (f"the sweep stopped at {label(combo)}" if swept else
                   f"the curve stopped at {values_flag} {label(combo).partition('=')[2]}")
        try:
            item = next(results)
        except StopIteration:
            return
        except BrokenProcessPool:
            if stop_signalled():  # (Ctrl-C or SIGTERM to the process group: the workers died of it)
                raise
            # (the pool fails every replay not yet back: the sweep stops at the first of them)
            raise WorkerDied(f"a worker process died before its replay finished (killed, or out of memory?); "
                             f"{stopped}, {_kept(done(), len(combos), stored, swept)}") from None
        except WorkerDied as err:
            raise WorkerDied(f"{err}; {stopped}, {_kept(done(), len(combos), stored, swept)}") from None
        except KVTraceError as err:
            kept = (f"{stopped}, {_kept(done(), len(combos), stored, swept)}"
                    + ("" if swept or not stored else " (the curve itself is not recorded)"))
            if type(err) is not KVTraceError:  # (a file's, a flag's: named where it is)
                if isinstance(err, ConfigError):  # (a swept setting's flag, as the user typed its values)
                    err = at_swept_value(err, combo, values_flag)
                if not done():
                    raise err from None
                # ... and, once runs were kept, what of the sweep they are: a trace deleted or cut
                # midway was one line naming the file, the runs stored before it unsaid
                raise _with_tail(err, kept) from None
            shown = label(combo) if swept else label(combo).partition("=")[2]
            capacity = next((n for n in CAPACITY_FORMS if n in combo), None)
            text = str(err)
            if not swept:
                text = swept_capacity_advice(text, values_flag)
            elif capacity is not None:
                text = swept_capacity_advice(text, f"{capacity} values of {values_flag}")
            # where the sweep stopped and what it kept, as a worker's death says it: the runs
            # after a failed one were never run, and the line said nothing of them
            raise KVTraceError(f"{values_flag} {shown}: {text}; {kept}") from None
        yield item


def _with_tail(err: KVTraceError, tail: str) -> KVTraceError:
    """``err`` (its class and fields kept: a TraceFormatError's path and line) with ``tail``
    added to its one line."""
    import copy

    out = copy.copy(err)  # (KVTraceError.__reduce__: rebuilt from its message and fields)
    out.args = (f"{err}; {tail}", *err.args[1:])
    if isinstance(getattr(out, "what", None), str):
        out.what = f"{out.what}; {tail}"  # type: ignore[attr-defined]
    return out


def _kept(done: int, total: int, stored: bool, swept: bool = True) -> str:
    return f"{done} of {total} {'combinations' if swept else 'capacities'} {'stored' if stored else 'done'}"


@contextlib.contextmanager
def _results_in_order(specs: list[RunSpec], keep: bool, workers: int | None,
                      ray_address: str | None) -> Iterator[Iterator[Replayed]]:
    """Every spec's (result, span tables), in spec order, as each comes back: on Ray, in
    this process, or on forked local workers, which end with the block however it ends."""
    if ray_address is not None:
        with _on_ray(specs, keep, ray_address, workers) as results:
            yield results
        return
    workers = DEFAULT_WORKERS if workers is None else workers
    if workers == 1 or len(specs) == 1:
        yield (_replay_one(s, keep) for s in specs)
        return
    # fork: the workers start with this process's imports (and no store handle is open yet)
    processes = local_workers(workers, len(specs))
    try:  # (the pool makes its pipes here: an open-file limit refuses them)
        pool = ProcessPoolExecutor(max_workers=processes, initializer=worker_start,
                                   initargs=(os.getpid(),), mp_context=multiprocessing.get_context("fork"))
    except OSError as err:
        raise _cannot_start(workers, err) from None
    # At most `ahead` replays queued or back and not yet stored: a slow one at the head held
    # every later result, its span tables too, in this process's memory (all were queued).
    ahead = IN_FLIGHT_PER_WORKER * processes
    try:
        # SIGTERM held while the workers fork (a fork pool forks them all at its first submit;
        # they unblock SIGTERM once it kills them) and the first replays are queued; one that
        # came meanwhile is delivered after
        with sigterm_blocked():
            try:
                futures = collections.deque(pool.submit(_replay_one, spec, keep) for spec in specs[:ahead])
            except OSError as err:  # a fork or its pipes refused (a process or open-file limit)
                raise _cannot_start(workers, err) from None

        def in_order() -> Iterator[Replayed]:
            for later in [*specs[ahead:], *[None] * min(ahead, len(specs))]:
                head = futures.popleft()
                if later is not None:  # (queued before waiting: the workers never run dry)
                    futures.append(pool.submit(_replay_one, later, keep))
                yield _result(pool, head)

        yield in_order()
    except BaseException:  # Ctrl-C, SIGTERM, a failed replay: the queued replays are not run
        # The workers end first: the pool then finds itself broken and fails every queued
        # replay. Nothing cancels them (pool.map's iterator would, on the way out: a race
        # with the pool failing them, InvalidStateError printed from its thread).
        for proc in list((getattr(pool, "_processes", None) or {}).values()):  # (3.14: terminate_workers)
            proc.terminate()
        # A worker ended while it wrote its result (span tables: megabytes) left the pool's
        # thread reading the rest of it for good, and shutdown() waiting on that thread: Ctrl-C
        # hung the sweep. This process's end of the result pipe is its last writer once the
        # workers are gone: closed, that read ends, and the pool finds itself broken.
        with contextlib.suppress(AttributeError, OSError):
            pool._result_queue._writer.close()  # type: ignore[attr-defined]
        pool.shutdown()
        raise
    pool.shutdown()


def _result(pool: ProcessPoolExecutor, future, poll_s: float = 1.0, polls_dead: int = 2):
    """``future.result()``, or the pool's break when a worker died while it sent a result
    back (killed, the OOM killer at the peak of pickling its span tables): the pool's thread
    then reads the rest of that result for good, never sees the death, never fails a future,
    and the sweep waited forever. A worker found dead at ``polls_dead`` polls in a row with
    the head still not back is taken for that (the pool's thread tells a death at once
    otherwise); the stop path then ends the others and unblocks the pool's thread."""
    from concurrent.futures import TimeoutError as NotYet
    from concurrent.futures.process import BrokenProcessPool
    from multiprocessing.connection import wait

    dead_polls = 0
    while True:
        try:
            return future.result(timeout=poll_s)
        except NotYet:
            try:  # (a sentinel is readable once its process ended; nothing is reaped here)
                dead = wait([p.sentinel for p in list((getattr(pool, "_processes", None) or {}).values())], 0)
            except (ValueError, OSError):  # (the pool closed them: it saw the break itself)
                dead = []
            dead_polls = dead_polls + 1 if dead else 0
            if dead_polls >= polls_dead:
                raise BrokenProcessPool("a worker process died while it sent its result back") from None


def _cannot_start(workers: int, err: OSError) -> KVTraceError:
    return KVTraceError(f"--workers {workers}: cannot start the worker processes ({err.strerror or err}); try fewer")


def local_workers(workers: int, replays: int) -> int:
    """The processes a local sweep forks: what was asked, at most one a replay and one a
    CPU this process may run on (replays are CPU-bound: more would only share the cores,
    each with its own memory, and a large --workers forked thousands)."""
    return max(1, min(workers, replays, len(os.sched_getaffinity(0))))


def _record(store, spec: RunSpec, res: RunResult, tables: list, sweep_id: str, combo: dict[str, Any]) -> str:
    from kvtrace.process import raise_stop, stop_pending
    from kvtrace.replay.run import run_record

    # Ctrl-C or SIGTERM whose KeyboardInterrupt a finalizer swallowed: stop before another run is stored
    if stop_pending():
        raise_stop()
    rec = run_record(spec, res)
    rec["config"]["sweep"] = {"id": sweep_id, "params": stored_params(combo)}
    run_id = store.create_run(spec.name or sweep_id, **rec)
    for table in tables:
        store.append_spans(table, run_id=run_id, flush_when_due=False)
    store.finish_run(run_id, status="complete", digest=res.summary.get("digest"), summary=res.summary)
    return run_id


def id_settings(spec: RunSpec) -> dict[str, Any]:
    """The settings a sweep's or a curve's content id covers, each as it is read, so that
    one set of runs has one id and other runs another: --without's order and repeats,
    retention's spellings (none, None; 0, 00; and none is a setting, no --retention the
    preset's own), and in engine mode a --preset naming the one the runs get without it."""
    from kvtrace.replay.run import DEFAULT_PRESET

    # (--limit is in the trace digest where it cuts the trace: a limit past its end is no setting;
    # --percentiles says how the runs' latencies are summarised, as pairing reads it: no setting)
    settings = {f: getattr(spec, f) for f in spec.__dataclass_fields__
                if f not in ("name", "trace", "limit", "percentiles")}
    settings["without"] = sorted(set(spec.without))
    if spec.retention is not None:
        retention = _canonical("retention", spec.retention)
        settings["retention"] = "none" if retention is None else retention  # (null: no --retention given)
    if spec.mode == "engine" and spec.preset is not None:
        from kvtrace.replay.config_file import load_config_file

        unnamed = (load_config_file(spec.config_file).preset if spec.config_file else None) or DEFAULT_PRESET
        if spec.preset == unnamed:
            settings["preset"] = None
    return settings


def _config_digest(path: str | None) -> str | None:
    """sha256 of a --config file's content (None: no file, or one that is gone)."""
    if not path:
        return None
    from kvtrace.workload.lines import file_sha256

    try:
        return file_sha256(path)
    except KVTraceError:  # (deleted or unreadable since: no longer the content it was)
        return None


def _sweep_id(base: RunSpec, combos: list[dict[str, Any]], trace_digest: str | None,
              config: str | None) -> str:
    """A content id: the same sweep (every setting but the run name and the percentiles
    reported; the trace's content, the config file's: ``config``, its sha256) gets the same
    id, and a sweep that differs in any of them another."""
    import hashlib
    import json

    settings = id_settings(base)
    # the combinations as a set: the same runs however the values and --params were ordered
    runs = sorted(json.dumps({k: sorted(set(v)) if isinstance(v, tuple) else _canonical(k, v) for k, v in c.items()},
                             sort_keys=True, default=str) for c in combos)
    text = json.dumps([trace_digest or f"{base.trace}:limit={base.limit}", config, settings, runs],
                      sort_keys=True, default=str)
    return "sweep-" + hashlib.sha256(text.encode()).hexdigest()[:12]


class WorkerDied(RuntimeError):
    """A replay's worker (a Ray task's process, its node) died or ran out of memory: no
    user error (exit 1, as a local worker's death), and the runs stored before it stay."""


@contextlib.contextmanager
def _on_ray(specs: list[RunSpec], keep: bool, address: str,
            in_flight: int | None = None) -> Iterator[Iterator[Replayed]]:
    """Every spec's (result, span tables) from its Ray task, in spec order, each as it comes
    back (all at once, a sweep failed or stopped at its last replay stored none); the tasks
    not yet back are cancelled when the block ends early. ``in_flight``: the most tasks
    submitted and not yet taken back at once (None: all)."""
    try:
        import ray
    except ImportError:
        raise KVTraceError("--ray: Ray is not installed; install it with: pip install 'kvtrace[ray]'") from None
    # What the cluster tells the driver (a worker that died, its task retried; a worker killed
    # by a cancel) Ray prints from a thread of its own on stdout, log_to_driver or not: it
    # broke `--json`'s one document (and the table's stdout) after a retry the sweep survived.
    # While this process is Ray's driver its stdout is stderr; the command prints after.
    sent = [_resolved(s) for s in specs]
    with contextlib.redirect_stdout(sys.stderr), _on_ray_driver(ray, sent, keep, address, in_flight) as results:
        yield (_as_typed(item, spec, to) for item, spec, to in zip(results, specs, sent))


def _resolved(spec: RunSpec) -> RunSpec:
    """``spec`` with its trace and --config paths absolute: a Ray task opens them in its
    worker's directory (the cluster's, wherever it was started), not this command's; a
    relative trace was 'no such file or directory' there."""
    from kvtrace.replay.run import GENERATED_PREFIX

    changes: dict[str, Any] = {}
    if not spec.trace.startswith(GENERATED_PREFIX) and not os.path.isabs(spec.trace):
        changes["trace"] = os.path.abspath(spec.trace)
    if spec.config_file and not os.path.isabs(spec.config_file):
        changes["config_file"] = os.path.abspath(spec.config_file)
    return replace(spec, **changes) if changes else spec


def _as_typed(item: Replayed, spec: RunSpec, sent: RunSpec) -> Replayed:
    """A Ray task's replay of ``sent`` (its paths resolved) recording the trace as ``spec``
    names it, as the same replay run here records it."""
    if sent.trace != spec.trace:
        res = item[0]
        if res.record.get("trace_source") == sent.trace:
            res.record["trace_source"] = spec.trace
        if res.summary.get("trace") == sent.trace:
            res.summary["trace"] = spec.trace
    return item


@contextlib.contextmanager
def _on_ray_driver(ray, specs: list[RunSpec], keep: bool, address: str,
                   in_flight: int | None) -> Iterator[Iterator[Replayed]]:
    started = False
    held: list[int] = []  # a SIGTERM or Ctrl-C that came while ray.init ran
    # (the command's handlers, acted on once ray.init is done)
    stops = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    if not ray.is_initialized():
        # (address "local" said to Ray too: without it, ray.init followed RAY_ADDRESS, and one that
        # nothing answered on held --ray local for good, deaf to Ctrl-C and SIGTERM)
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "logging_level": "ERROR",
                                  "address": address}
        if address != "local":
            _check_reachable(address)
        try:
            # (Ray's SIGTERM handler would exit without the run's stop path: status 15, no word; and
            # a stop midway left a local cluster half started, its agents running with no parent)
            with stop_handlers_kept(), _stops_held(ray, held):
                ray.init(**kwargs)
        except BaseException as err:
            with contextlib.suppress(Exception):  # (whatever it started goes too)
                ray.shutdown()
            _held_stop(held, stops)  # (Ctrl-C to the process group: Ray's processes died of it too)
            if isinstance(err, OSError) and not isinstance(err, ConnectionError) and err.filename is not None:
                # (Ray writes its token and session files under HOME and the temporary folder:
                # HOME=/dev/null was a NotADirectoryError traceback)
                raise KVTraceError(f"--ray {address}: Ray cannot write {printable(str(err.filename))}: "
                                   f"{err.strerror or err}; set HOME (and TMPDIR) to folders this user can "
                                   "write") from None
            if not isinstance(err, (ConnectionError, RuntimeError, ValueError)):
                raise
            if address == "auto" and "Could not find any running Ray instance" in str(err):
                # (Ray's own text points at flags of its CLI, `--address`, that kvtrace has not)
                raise KVTraceError("--ray auto: no running Ray cluster found on this machine; start one with "
                                   "`ray start --head`, name one (--ray HOST:PORT, or RAY_ADDRESS), or say "
                                   "--ray local") from None
            raise KVTraceError(f"--ray {address}: cannot connect to a Ray cluster ({err})".splitlines()[0]) from None
        started = True
    try:
        _held_stop(held, stops)  # (a stop while Ray started: the command's, now that shutdown ends it all)
        gcs = _gcs_address(ray, address)
        task = ray.remote(_replay_one)
        refs: list = []  # every task submitted so far, in spec order

        def submit(upto: int) -> None:
            refs.extend(task.remote(s, keep) for s in specs[len(refs):upto])

        def results() -> Iterator[Replayed]:
            window = len(specs) if in_flight is None else in_flight
            for i in range(len(specs)):
                submit(i + window)  # (the one taken back next, and window - 1 after it, on the cluster)
                yield _ray_result(ray, refs[i], address, gcs)

        try:
            yield results()
        except BaseException:  # a failed replay, Ctrl-C: the rest would run on, on a shared cluster
            for ref in refs:
                with contextlib.suppress(Exception):  # (one already back, or its worker gone)
                    ray.cancel(ref, force=True)
            raise
    finally:
        if started:
            ray.shutdown()


def _held_stop(held: list[int], handlers: dict) -> None:
    """The first stop ``_stops_held`` held, as the command's handler for it takes it
    (Terminated, KeyboardInterrupt); nothing when none came."""
    if not held:
        return
    which = signal.Signals(held[0])
    stop = handlers.get(which)
    if callable(stop):
        stop(which, None)
    elif stop != signal.SIG_IGN:
        raise stop_for(which)


@contextlib.contextmanager
def _stops_held(ray, came: list[int]) -> Iterator[None]:
    """SIGTERM, SIGINT and SIGHUP remembered in ``came``, not acted on, while ``ray.init`` runs (a
    few seconds; a second one is acted on at once): raised midway, they left a local
    cluster half started, its processes beyond reach of ``ray.shutdown``; and Ray's own
    SIGTERM handler, put in place as it starts (kept out here), exited with status 15
    without a word."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    utils = getattr(getattr(ray, "_private", None), "utils", None)
    install = getattr(utils, "set_sigterm_handler", None)
    if install is not None:
        utils.set_sigterm_handler = lambda handler: None  # type: ignore[union-attr]
    def hold(signum, frame) -> None:
        came.append(signum)
        if len(came) > 1:  # a second one forces it, as a stop that takes too long can be forced
            raise stop_for(signum)

    previous = {sig: signal.signal(sig, hold) for sig in handled_stop_signals()}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if install is not None:
            utils.set_sigterm_handler = install  # type: ignore[union-attr]


def _gcs_address(ray, address: str) -> str | None:
    """HOST:PORT of the cluster's GCS as this driver reaches it: the --ray HOST:PORT given
    (the address the cluster calls its own may be one this machine does not reach), or for
    auto and local the one Ray connected to; None (no watch) for a Ray Client's ray://, whose
    driver talks to the cluster through its client server alone."""
    if address.startswith("ray://"):
        return None
    if address not in ("auto", "local"):
        host, port = ray_host_port(address)
        return f"{host}:{port}"
    try:
        found = ray.get_runtime_context().gcs_address
    except Exception:  # (an older or newer Ray's runtime context: the wait then has no watch)
        return None
    return found if isinstance(found, str) and found.rpartition(":")[2].isdigit() else None


def _gcs_answers(gcs: str, timeout_s: float = 1.0) -> bool:
    """Whether anything accepts a connection at the GCS's HOST:PORT."""
    import socket

    host, _, port = gcs.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except (OSError, UnicodeError, ValueError):
        return False
    return True


RAY_GONE_S = 10.0  # a cluster's GCS refusing connections this long is a cluster gone (Ray's own wait: 60 s)


def _ray_result(ray, ref, address: str, gcs: str | None = None, poll_s: float = 1.0,
                gone_s: float = RAY_GONE_S) -> Replayed:
    """The replay's result from its task; ``gcs``: the cluster's GCS address, watched while
    the result is awaited. A cluster that died (``ray stop``, its head gone) held the sweep
    60 s, then Ray ended the process from its own thread: exit 1 with Ray's lines and no
    word of kvtrace's. A GCS that refuses connections for ``gone_s`` is told as a worker's
    death is (exit 1, the runs stored before it kept)."""
    gone_since = None
    while True:
        try:
            return ray.get(ref) if gcs is None else ray.get(ref, timeout=poll_s)
        except ray.exceptions.GetTimeoutError:
            if gcs is None or _gcs_answers(gcs):
                gone_since = None
                continue
            import time

            now = time.monotonic()
            gone_since = now if gone_since is None else gone_since
            if now - gone_since >= gone_s:
                raise WorkerDied(f"--ray {address}: the Ray cluster stopped answering before a replay finished "
                                 f"(nothing accepted connections at its GCS, {gcs}, for {gone_s:g} s)") from None
        except ray.exceptions.RayTaskError as err:  # a replay's own error, not Ray's remote traceback
            cause = err.cause if isinstance(err.cause, BaseException) else None
            if isinstance(cause, KVTraceError):
                raise cause from None
            raise KVTraceError(f"--ray {address}: a replay failed: {cause!r}"[:500]) from None
        except ray.exceptions.RayError as err:  # its worker or node died (retries spent), out of memory
            what = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise WorkerDied(f"--ray {address}: a replay's worker died before it finished ({type(err).__name__}"
                             f"{': ' + what if what else ''})"[:500]) from None


def ray_host_port(address: str) -> tuple[str, int]:
    """(host, port) of a ``--ray`` HOST:PORT or ray://HOST:PORT; KVTraceError otherwise."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(address if "://" in address else f"ray://{address}")
        host, port = parts.hostname, parts.port
    except ValueError:  # an unclosed [, a port that is not a number or out of range
        host = port = None
    if not host or port is None:
        raise KVTraceError(f"--ray {address}: expected HOST:PORT, ray://HOST:PORT, auto or local")
    return host, port


def _check_reachable(address: str, timeout_s: float = 5.0, token: bool = True) -> None:
    """A HOST:PORT (or ray://HOST:PORT) that nothing answers on fails at once: ``ray.init``
    would retry for a minute, printing its GCS client's warnings. ``token``: check that a
    cluster that wants a token gets one (not for auto, where Ray sends the one it has)."""
    import socket

    if address == "auto":
        # Ray finds the local cluster itself (its session files), or the one RAY_ADDRESS names:
        # a dead one there held ray.init for minutes of retries, deaf to Ctrl-C and SIGTERM
        named = os.environ.get("RAY_ADDRESS", "").strip()
        if named and named not in ("auto", "local"):
            try:
                _check_reachable(named, timeout_s, token=False)
            except KVTraceError as err:
                raise KVTraceError(str(err).replace(f"--ray {named}:", f"--ray auto: RAY_ADDRESS={named}:", 1)
                                   ) from None
        return
    host, port = ray_host_port(address)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except (OSError, UnicodeError) as err:  # (UnicodeError: a host name IDNA refuses)
        reason = getattr(err, "strerror", None) or type(err).__name__
        raise KVTraceError(f"--ray {address}: cannot reach a Ray cluster there ({reason})") from None
    # Something listens; a Ray GCS (and a Ray Client server) speaks gRPC. Anything else (a web
    # server, say) would hold ray.init for minutes of retries: refused once a gRPC channel
    # to it has had timeout_s to become ready.
    import grpc

    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    channel = grpc.insecure_channel(target)
    not_ray = (f"--ray {address}: something listens there, but it is no Ray cluster's "
               f"{'client server' if address.startswith('ray://') else 'GCS'}; expected a Ray head's GCS port "
               "(6379) or ray://HOST:10001")
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
        if not address.startswith("ray://"):  # a GCS has its own service (another gRPC server has not)
            from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

            stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
            try:
                stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s)  # type: ignore[attr-defined]
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    raise KVTraceError(f"{not_ray} (it has no Ray GCS service)") from None
                if token and err.code() == grpc.StatusCode.UNAUTHENTICATED:  # a GCS that takes only its token's
                    _check_token(address, stub, gcs_service_pb2.GetClusterIdRequest(), timeout_s)  # type: ignore[attr-defined]
    except grpc.FutureTimeoutError:
        raise KVTraceError(f"{not_ray} (no gRPC within {timeout_s:g} s)") from None
    finally:
        channel.close()


def _check_token(address: str, stub, request, timeout_s: float) -> None:
    """A GCS that refused a client without its token (token authentication, on by default for
    a cluster ``ray start`` starts): ``ray.init`` of an address sends the token only under
    RAY_AUTH_MODE=token, and otherwise (or with another cluster's token) retried for 20 s,
    printing Ray's warnings, and ended 'cannot connect', no word of the token. Told here,
    in one line, with what to set; the token itself is never shown."""
    import grpc

    try:
        from ray._private.authentication.grpc_authentication_client_interceptor import (
            _get_authentication_metadata_tuple,
        )

        metadata = _get_authentication_metadata_tuple()  # (what Ray would send: the token, in token mode)
    except Exception:  # (another Ray's internals: let ray.init answer)
        return
    if not metadata:
        raise KVTraceError(f"--ray {address}: the Ray cluster there takes only clients with its authentication "
                           "token (token authentication, on by default for `ray start`); set RAY_AUTH_MODE=token "
                           "(Ray then sends ~/.ray/auth_token, or RAY_AUTH_TOKEN or the file RAY_AUTH_TOKEN_PATH "
                           "names), or say --ray auto on the head's machine")
    try:
        stub.GetClusterId(request, timeout=timeout_s, metadata=metadata)
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.UNAUTHENTICATED:
            raise KVTraceError(f"--ray {address}: the Ray cluster there refused this process's authentication token "
                               "(RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token): give the token of the "
                               "cluster's head") from None


def sweep_table(result: SweepResult, baseline: dict[str, Any] | None = None) -> list[list[str]]:
    """Rows of the closing table: the parameter values, then each headline metric with its
    change from the baseline combination (default: the first) in brackets. Metrics no run
    has (latency in cache-only mode) are left out."""
    from kvtrace.replay.report import format_value

    runs = result.runs
    base = runs[0]
    if baseline:
        found = [r for r in runs if all(r.combo.get(k) == v for k, v in baseline.items())]
        if not found:
            raise KVTraceError(f"--baseline {label(baseline)}: no combination of the sweep has these values")
        base = found[0]
    cache_only = all(str(r.summary.get("mode", "")).startswith("cache-only") for r in runs)
    metrics = [m for m in TABLE_METRICS
               if any(r.summary.get(m) is not None for r in runs) and not (cache_only and m in ENGINE_METRICS)]
    # Runs of other block sizes (a sweep of mode: engine mode's blocks are the preset's, cache-only's
    # the trace's; of block_size) hold other caches at one capacity_blocks: each run's own is shown
    sizes = len({r.summary.get("block_size") for r in runs}) > 1 and any(
        r.summary.get("block_size") != r.combo.get("block_size") for r in runs)  # (not told by a swept block_size)
    rows = [[*runs[0].combo, *(["cache (blocks x tokens)"] if sizes else []), *metrics]]
    for r in runs:
        cells = ["+".join(v) or "none" if isinstance(v, tuple) else str(v) for v in r.combo.values()]
        if sizes:
            blocks = r.summary.get("capacity_blocks")
            cells.append(f"{'unbounded' if blocks is None else f'{blocks:,}'} x {r.summary.get('block_size')}")
        for m in metrics:
            a, b = base.summary.get(m), r.summary.get(m)
            text = format_value(m, b)
            if r is base:
                text += " (baseline)"
            elif isinstance(a, (int, float)) and isinstance(b, (int, float)):
                delta = b - a
                text += (f" ({points_text(delta)})" if m.endswith("_rate")
                         else f" ({delta:+,})" if isinstance(delta, int) else f" ({delta:+,.3f})")
            cells.append(text)
        rows.append(cells)
    return rows
