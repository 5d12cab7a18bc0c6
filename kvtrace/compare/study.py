"""Reproducible behaviour studies: one trace, one behaviour switched on and off.

``run_study("shared-prefix-pinning")`` replays the behaviour's generated workload
(``gen:study-<behaviour>``) twice through ``run_replay`` — once as configured (behaviour
on, as in current vLLM) and once with ``without=(behaviour,)`` (the old vLLM) — and diffs
the two runs. With ``sweep`` it repeats the pair for each value of one parameter
(capacities or retention intervals).

Diff direction: A = behaviour **off**, B = behaviour **on**, so every delta reads as
"what the behaviour buys" (a positive prefix_cache_hit_rate delta = the behaviour raises it).

The behaviour names are the cache config's switches, imported from their one home in
``kvtrace.cache.config``.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtrace.cache.config import (
    BEHAVIOURS,
    EXTERNAL_HIT_RUNNING_COW,
    SHARED_PREFIX_PINNING,
    TRANSIENT_CHECKPOINT_RETENTION,
)
from kvtrace.errors import ConfigError, KVTraceError
from kvtrace.metrics import points_text
from kvtrace.names import shown_value
from kvtrace.replay.run import GENERATED_PREFIX, RunSpec, is_set, run_replay, validate
from kvtrace.replay.sweep import (
    CAPACITY_FORMS,
    at_swept_value,
    combinations,
    parse_param,
    swept_capacity_advice,
)

if TYPE_CHECKING:  # (the comparison's polars is loaded once the runs are to be diffed: a bad
    # setting is told before it, and before any replay)
    from kvtrace.compare.model import RunDiff

# What each study expects when the behaviour is switched off (checked by tests and by the
# notebook's verdict): metric -> +1 when "off" should be higher, -1 when lower. Latency by
# its median (vllm bench serve's median_ttft_ms, the p50 every summary carries): p50_ttft_ms
# is in a summary only when --percentiles names 50, and a study at 90,99 failed its
# expectation with "got off=None on=None".
EXPECTED_OFF_DIRECTION: dict[str, dict[str, int]] = {
    TRANSIENT_CHECKPOINT_RETENTION: {"prefix_cache_hit_rate": -1, "median_ttft_ms": +1},
    SHARED_PREFIX_PINNING: {"prefix_cache_hits": -1, "prefix_cache_hit_rate": -1},
    EXTERNAL_HIT_RUNNING_COW: {"divergent_outputs": +1, "stale_hashes": +1},
}


def study_defaults(behaviour: str) -> dict[str, Any]:
    """RunSpec settings under which the behaviour's generated workload exposes it: the
    generator's hints (preset, retention, capacities, external tier). Applied only to the
    built-in workload; a user's --trace runs on the preset as it is."""
    from kvtrace.replay.generate import WORKLOADS, study_workload  # (numpy: a study of a user's trace needs none)

    return dict(WORKLOADS[study_workload(check_behaviour(behaviour))].hints)  # (5: a TypeError in generate)


SWEEP_PARAMETERS = ("capacity_blocks", "capacity_tokens", "external_capacity_blocks", "retention")
# The deltas the closing table of a swept study shows (summary keys): the external tier's hit
# rate where a run had a tier (prefix_cache_hit_rate is the local cache's: a sweep of
# external_capacity_blocks showed no column the tier moved), as kvtrace sweep's table.
SWEEP_TABLE_METRICS = ("prefix_cache_hit_rate", "prefix_cache_hits", "external_prefix_cache_hit_rate", "evictions",
                       "median_ttft_ms", "stale_hashes", "divergent_outputs")
_TIER_METRICS = ("external_prefix_cache_hit_rate",)  # (a column only where some run had a tier)


def study_trace(behaviour: str) -> str:
    """The built-in generated workload that exposes ``behaviour``."""
    return f"gen:study-{check_behaviour(behaviour)}"


def check_behaviour(behaviour: str) -> str:
    # (an array: its truth ValueError; a str subclass's own __eq__ ran in the tuple's test)
    if not isinstance(behaviour, str) or str.__str__(behaviour) not in BEHAVIOURS:
        raise KVTraceError(f"study: unknown behaviour {shown_value(behaviour)}; "
                           f"expected one of {', '.join(BEHAVIOURS)}")
    return str.__str__(behaviour)


@dataclass(slots=True)
class StudyPoint:
    """One on/off pair (one sweep value, or the only pair)."""

    on: dict[str, Any]
    off: dict[str, Any]
    diff: RunDiff
    run_on: str | None = None
    run_off: str | None = None
    parameter: str | None = None
    value: Any = None

    def effect(self, behaviour: str) -> dict[str, Any]:
        """``expected_effect``, judged as this point's diff judges each metric (a latency by its CI)."""
        return expected_effect(behaviour, self.on, self.off, diff=self.diff)

    def to_json(self, behaviour: str) -> dict[str, Any]:
        from kvtrace.compare.render import to_json

        out: dict[str, Any] = {"on": self.on, "off": self.off, "diff": to_json(self.diff),
                               "expected_effect": self.effect(behaviour)}
        if self.run_on is not None:
            out["run_on"], out["run_off"] = self.run_on, self.run_off
        if self.parameter is not None:
            out = {"parameter": self.parameter, "value": self.value, **out}
        return out


@dataclass(slots=True)
class StudyResult:
    behaviour: str
    trace: str
    points: list[StudyPoint] = field(default_factory=list)
    db: str | None = None

    @property
    def first(self) -> StudyPoint:
        return self.points[0]

    @property
    def on(self) -> dict[str, Any]:
        return self.first.on

    @property
    def off(self) -> dict[str, Any]:
        return self.first.off

    @property
    def diff(self) -> RunDiff:
        return self.first.diff

    @property
    def swept(self) -> bool:
        """Whether a sweep was given (even of one value): every view then shows its table
        (--markdown left out the one --json and the terminal showed for one value)."""
        return self.first.parameter is not None

    def to_json(self) -> dict[str, Any]:
        """{"behaviour", "trace", "on", "off", "diff", "expected_effect"} (of the first point) [+ "sweep"]."""
        out: dict[str, Any] = {"behaviour": self.behaviour, "trace": self.trace,
                               **self.first.to_json(self.behaviour)}
        out.pop("parameter", None)
        out.pop("value", None)
        if self.db is not None:  # (a server URL without its password, as every error names it)
            from kvtrace.store.backend import CHDB_PREFIX, db_label, is_clickhouse

            server = is_clickhouse(self.db) and not str(self.db).startswith(CHDB_PREFIX)
            out["db"] = db_label(self.db) if server else self.db
        if self.swept:
            out["sweep"] = {
                "parameter": self.first.parameter,
                "points": [p.to_json(self.behaviour) for p in self.points],
            }
        return out

    def to_markdown(self) -> str:
        from kvtrace.compare.render import to_markdown
        from kvtrace.names import markdown_code

        # the trace path as typed, one code span whatever it holds (backticks, a newline, ESC)
        parts = [f"## kvtrace study `{self.behaviour}` on {markdown_code(self.trace)}", "",
                 "A = behaviour off (old vLLM), B = behaviour on: deltas are what the behaviour buys.", ""]
        if self.swept:
            parts += [self.sweep_markdown(), ""]
        for p in self.points:
            if p.parameter is not None:
                parts += [f"#### {p.parameter} = {p.value}", ""]
            parts += [to_markdown(p.diff), f"**{verdict_line(p.effect(self.behaviour))}**", ""]
        return "\n".join(parts)

    def sweep_markdown(
        self, metrics: Iterable[str] = ("prefix_cache_hit_rate", "median_ttft_ms", "divergent_outputs")
    ) -> str:
        metrics = list(metrics)
        head = f"| {self.first.parameter} | " + " | ".join(f"{m} off | {m} on" for m in metrics) + " |"
        sep = "|---:|" + "---:|---:|" * len(metrics)
        rows = []
        for p in self.points:
            cells = []
            for m in metrics:
                cells += [_cell(p.off.get(m)), _cell(p.on.get(m))]
            rows.append(f"| {p.value} | " + " | ".join(cells) + " |")
        return "\n".join([head, sep, *rows])

    def print(self, console: Any = None) -> None:
        from kvtrace.compare.render import render
        from kvtrace.names import markup_literal, stdout_console

        console = console or stdout_console()
        trace = markup_literal(self.trace)  # the user's path, as typed
        console.print(f"[bold]kvtrace study {self.behaviour}[/bold] on {trace}  (A = off, B = on)")
        for p in self.points:
            if p.parameter is not None:
                console.print(f"[bold]{p.parameter} = {p.value}[/bold]")
            render(p.diff, console)
            effect = p.effect(self.behaviour)
            colour = {True: "green", False: "red", None: "yellow"}[effect["shown"]]
            console.print(f"[{colour}]{markup_literal(verdict_line(effect))}[/{colour}]")
        if self.swept:
            console.print(self.sweep_table())

    def sweep_table(self, metrics: Iterable[str] = SWEEP_TABLE_METRICS) -> Any:
        """One row per swept value: the delta (B - A, what the behaviour buys) of each
        key metric."""
        from rich.table import Table

        # (a latency percentile --percentiles left out is in neither run: no column, not an error)
        metrics = [m for m in metrics if all(m in p.on and m in p.off for p in self.points)]
        metrics = [m for m in metrics if m not in _TIER_METRICS
                   or any(p.on.get(m) is not None or p.off.get(m) is not None for p in self.points)]
        table = Table(title=f"{self.behaviour}: on - off, per {self.first.parameter}", header_style="bold")
        table.add_column(str(self.first.parameter), overflow="fold")
        for m in metrics:
            table.add_column(f"Δ {m}", justify="right", overflow="fold")
        for p in self.points:
            table.add_row(str(p.value), *(_delta_cell(m, _measured_delta(p.diff, m)) for m in metrics))
        return table

    def expectation_failures(self) -> list[str]:
        """The expected off-direction checks this study's first point does not meet."""
        return expectation_failures(self.behaviour, self.on, self.off)


def expectation_failures(behaviour: str, on: Mapping[str, Any], off: Mapping[str, Any]) -> list[str]:
    """Which of the behaviour's expected effects (``EXPECTED_OFF_DIRECTION``) did not show.

    For external-hit-running-cow either divergent outputs or stale hashes suffice, and the
    run with the behaviour on must have none of either.
    """
    failures = []
    if behaviour == EXTERNAL_HIT_RUNNING_COW:
        if any(run.get(k) is None for run in (on, off) for k in ("divergent_outputs", "stale_hashes")):
            return ["divergent outputs and stale hashes were not measured (a run without content checks)"]
        if on.get("divergent_outputs", 0) or on.get("stale_hashes", 0):
            failures.append("behaviour on still has divergent outputs or stale hashes")
        if not (off.get("divergent_outputs", 0) > 0 or off.get("stale_hashes", 0) > 0):
            failures.append("behaviour off shows neither divergent outputs nor stale hashes")
        return failures
    from kvtrace.compare.model import LATENCY_RESOLUTION_MS, MetricDelta

    for metric, sign in EXPECTED_OFF_DIRECTION[behaviour].items():
        a, b = off.get(metric), on.get(metric)
        if a is None or b is None or not (a - b) * sign > 0:
            failures.append(f"{metric}: expected off {'>' if sign > 0 else '<'} on, got off={a} on={b}")
        elif MetricDelta(metric, a, b, b - a, None).verdict == "same":
            # (a latency change below the diff's resolution, which its table calls no change
            # (0.0000): the verdict said the effect showed, from interpolation noise)
            failures.append(f"{metric}: expected off {'>' if sign > 0 else '<'} on, got off={a} on={b}, a change "
                            f"below {LATENCY_RESOLUTION_MS * 1000:g} µs of modelled time (the diff's 'same')")
    return failures


def expected_effect(behaviour: str, on: Mapping[str, Any], off: Mapping[str, Any],
                    diff: RunDiff | None = None) -> dict[str, Any]:
    """The study's verdict: whether the behaviour's expected effect showed (``shown``: None
    where the runs did not measure it), in words (``expected``), and which checks did not
    hold (``unmet``, ``expectation_failures``). ``diff``: the study's diff of the pair, whose
    verdict a latency's check takes (its bootstrap CI's: "shown" beside a table that found no
    change was a claim the table did not make); a latency without a CI (a study without
    --db keeps no request latencies) is not judged, so the effect is not measured."""
    if behaviour == EXTERNAL_HIT_RUNNING_COW:
        expected = "divergent outputs or stale hashes with it off, none with it on"
    else:
        expected = ", ".join(f"{m} {'lower' if sign > 0 else 'higher'} with it on"
                             for m, sign in EXPECTED_OFF_DIRECTION[behaviour].items())
    unmet = expectation_failures(behaviour, on, off)
    measured = all(run.get(m) is not None for run in (on, off) for m in EXPECTED_OFF_DIRECTION[behaviour])
    refuted = measured and bool(unmet)  # (a check that failed on the numbers: the effect is not shown)
    if diff is not None and behaviour != EXTERNAL_HIT_RUNNING_COW:
        for metric in EXPECTED_OFF_DIRECTION[behaviour]:
            if any(u.startswith(f"{metric}:") for u in unmet):
                continue
            problem, judged = _ci_judgement(diff, metric, off.get(metric), on.get(metric))
            if problem:
                unmet.append(problem)
                refuted = refuted or judged
                measured = measured and judged
    # (shown: None where the runs did not measure it, e.g. --no-content, or a CI could not judge it: no
    # verdict, not a refutation; False where any check failed, a hit rate that fell was "not measured"
    # beside a latency without a CI)
    shown = False if refuted else (not unmet) if measured else None
    return {"shown": shown, "expected": expected, "unmet": unmet}


def _ci_judgement(diff: RunDiff, metric: str, off: Any, on: Any) -> tuple[str | None, bool]:
    """Whether the diff finds the change of a latency ``metric`` that the raw check saw:
    (None, True) where it does or ``metric`` needs no CI; else the unmet check's words, and
    whether the CI judged it (False: there is no CI)."""
    from kvtrace.compare.model import UnknownMetric
    from kvtrace.compare.render import fmt

    try:
        m = diff.metric(metric)
    except UnknownMetric:
        return None, True
    if not m.needs_ci or m.verdict in ("better", "worse"):
        return None, True
    s = diff.shift(metric)
    if s is not None:
        return (f"{metric}: off={off} on={on}, a change its bootstrap CI [{fmt(s.ci_low, signed=True)}, "
                f"{fmt(s.ci_high, signed=True)}] does not find (the diff's table gives it no verdict)"), True
    return (f"{metric}: off={off} on={on}, not judged: no bootstrap CI of it (a study resamples its requests "
            "with --db, at the percentiles --percentiles names: a median needs 50)"), False


def verdict_line(effect: Mapping[str, Any]) -> str:
    """``expected_effect`` as the one line study ends with (plain text: kvtrace's own words)."""
    if effect["shown"] is None:
        return f"Expected effect not measured ({effect['expected']}): {'; '.join(effect['unmet'])}."
    if effect["shown"]:
        return f"Expected effect shown: {effect['expected']}."
    return f"Expected effect NOT shown ({effect['expected']}): {'; '.join(effect['unmet'])}."


def parse_sweep(sweep: Any) -> tuple[str, list[Any]] | None:
    """``{"capacity_blocks": [64, 128]}`` or ``"capacity_blocks=64,128"`` -> (name, values)."""
    if sweep is None:
        return None
    if isinstance(sweep, Mapping):
        if len(sweep) != 1:
            raise ConfigError("--sweep", shown_value(list(sweep)), "expected exactly one parameter")
        ((name, values),) = dict(sweep).items()
        # (a name that is no string, or values that are no list: 5's TypeError; each value as the
        # text --sweep reads, a str subclass as the string it is)
        if not isinstance(name, str) or not isinstance(values, (list, tuple)) or not all(
                isinstance(v, (str, numbers.Real)) for v in values):
            raise ConfigError("--sweep", shown_value(dict(sweep)), "expected {NAME: [V1, V2, ...]}")
        sweep = f"{str.__str__(name)}={','.join(map(_sweep_text, values))}"
    if not isinstance(sweep, str):
        raise KVTraceError(f"sweep: expected a mapping or NAME=V1,V2 text, got {type(sweep).__name__}")
    sweep = str.__str__(sweep)
    name, values = parse_param(sweep, flag="--sweep", names=SWEEP_PARAMETERS)
    combinations([(name, values)], flag="--sweep")  # (a value given twice, in any spelling, ran the pair twice)
    return name, values


def _sweep_text(value: Any) -> str:
    """A swept value as --sweep's text reads it: a str subclass as its string, a numpy number
    as the Python number it is (a bool as its name, which --sweep refuses)."""
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return repr(value)
    try:
        return repr(int(value)) if isinstance(value, numbers.Integral) else repr(float(value))
    except (ValueError, OverflowError):  # (an int past Python's 4,300 printable digits or float's range)
        raise ConfigError("--sweep", shown_value(value), "expected a setting's value") from None


def check_sweep_given_once(given: RunSpec, sweep: Any) -> None:
    """ConfigError when the swept setting (or the other spelling of a swept capacity) is
    also set for the whole study, as ``sweep`` refuses it: one of them would be dropped."""
    parsed = parse_sweep(sweep)
    if parsed is None:
        return
    name = parsed[0]
    bare = RunSpec(trace="")
    for other in CAPACITY_FORMS if name in CAPACITY_FORMS else (name,):
        if is_set(getattr(given, other), getattr(bare, other)):
            raise ConfigError("--sweep", name, f"is also set for the whole study ({other} = "
                                               f"{shown_value(getattr(given, other))}); give it one way")


def study_base(behaviour: str, given: RunSpec, swept: str | None = None) -> RunSpec:
    """The settings both runs of a study share: on the behaviour's built-in workload its
    ``study_defaults``, overridden by every setting the user gave (``given``'s fields that
    differ from a bare RunSpec); on a user's trace, the user's settings alone."""
    check_behaviour(behaviour)
    if given.mode != "engine":  # (else the study's own preset is blamed, a flag the user never gave)
        raise ConfigError("--mode", given.mode, "a study switches a cache behaviour of the engine's manager; "
                                                "cache-only mode has none (use --mode engine)")
    if behaviour in given.without:
        raise ConfigError("--without", behaviour, "is the behaviour this study switches on and off itself "
                                                  "(drop it from --without)")
    bare = RunSpec(trace="")
    changed = {f.name: getattr(given, f.name) for f in fields(RunSpec)
               if f.name != "trace" and getattr(given, f.name) != getattr(bare, f.name)}
    defaults = study_defaults(check_behaviour(behaviour)) if not given.trace else {}
    if swept is not None:  # (the sweep's values replace the workload's own: a backend refused the default)
        dropped = CAPACITY_FORMS if swept in CAPACITY_FORMS else (swept,)
        defaults = {k: v for k, v in defaults.items() if k not in dropped}
    spec = RunSpec(trace="", **{**defaults, **changed})
    # The workload's own settings the user left alone: a preset or backend that cannot take
    # one (a dense preset: retention 0; vLLM: two groups' capacities) names what the user
    # gave, not that flag, which the user never gave.
    kept = {k: v for k, v in defaults.items() if k != "preset" and k not in changed}
    culprit = "preset" if "preset" in changed else "backend" if "backend" in changed else None
    if kept and culprit is not None:
        from kvtrace.replay.run import validate

        try:
            validate(replace(spec, trace=study_trace(behaviour)))
        except ConfigError as err:
            key = next((k for k in kept if err.source == _flag(k)), None)
            if key is None:
                raise
            shown = _flag_value(kept[key])
            given_value = str(changed[culprit])
            fix = (f"study it on a hybrid preset such as kimi-hybrid, or give {_flag(key)}" if culprit == "preset"
                   else f"give {_flag(key)} a value it takes")
            raise ConfigError(_flag(culprit), given_value,
                              f"study {behaviour} replays its workload at {_flag(key)} {shown}, which "
                              f"{'this preset' if culprit == 'preset' else f'--backend {given_value}'} cannot take "
                              f"({err.what.split(';')[0]}); {fix}") from None
    return spec


def _flag(setting: str) -> str:
    """The command-line flag of a RunSpec setting: capacity_blocks -> --capacity-blocks."""
    return "--" + setting.replace("_", "-")


def _flag_value(value: Any) -> str:
    """A setting as it is typed: (1024, 16) -> 1024,16."""
    return ",".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)


def run_study(
    behaviour: str,
    trace: str | None = None,
    db: str | Path | None = None,
    sweep: Any = None,
    seed: int = 0,
    progress: bool = False,
    *,
    base: RunSpec | None = None,
    limit: int | None = None,
) -> StudyResult:
    """Replay ``trace`` (default: the behaviour's generated workload, with its
    ``study_defaults``) with the behaviour on and off, for each sweep value, and diff each
    pair (A = off, B = on). ``base``: a RunSpec whose settings (preset, capacity, ...)
    both runs share instead; its trace, seed and behaviours are set here.

    Without ``db`` the runs are diffed as kept in memory (``source.diff_results``: summaries,
    per-request changes, latency CIs, so the same verdicts); with ``db`` both runs are
    recorded and diffed through the store (evictions by reason and divergent requests too).
    """
    check_behaviour(behaviour)
    if base is not None:
        from kvtrace.replay.run import check_spec

        check_spec(base, "base")
    if isinstance(trace, os.PathLike):  # (a notebook's pathlib.Path, as RunSpec takes one: it was refused)
        trace = RunSpec(trace).trace
    if trace is not None and not isinstance(trace, str):  # (a numpy array: its truth ValueError)
        raise ConfigError("TRACE", shown_value(trace), "expected a trace file's path or gen:NAME, a string")
    if base is None:
        base = RunSpec(trace="", **(study_defaults(behaviour) if trace is None else {}))
    trace = trace or study_trace(behaviour)
    spec0 = replace(base, trace=trace, seed=seed, limit=limit if limit is not None else base.limit)
    if spec0.limit is not None and (isinstance(spec0.limit, bool) or not isinstance(spec0.limit, int)):
        # (before == 0 below: an array's truth ValueError, a caller's __eq__ that raises)
        raise ConfigError("--limit", shown_value(spec0.limit), "expected a number of requests >= 1 (without it: "
                                                               "the whole trace)")
    if spec0.limit == 0:  # (a replay takes it; a pair of empty runs read as "the behaviour changes nothing")
        raise ConfigError("--limit", "0", "a study of no requests compares nothing; give at least 1 (or no --limit)")
    if spec0.config_file:  # (a file's without adds to both runs': B would be off too, and said to be on)
        from kvtrace.replay.config_file import load_config_file

        if behaviour in load_config_file(spec0.config_file).cache.get("without", ()):
            raise ConfigError(str(spec0.config_file), "cache.without", f"switches {behaviour} off, the behaviour "
                                                                       "this study switches itself (drop it)")
    parsed = parse_sweep(sweep)
    grid: list[tuple[str | None, Any]] = [(None, None)] if parsed is None else [(parsed[0], v) for v in parsed[1]]
    pairs: list[tuple[str | None, Any, RunSpec, RunSpec]] = []
    for parameter, value in grid:
        swept = {} if parameter is None else {parameter: value}
        if parameter in CAPACITY_FORMS:  # the swept capacity is the capacity (the study's default is dropped)
            swept.update({other: None for other in CAPACITY_FORMS if other != parameter})
        spec = replace(spec0, **swept) if swept else spec0
        suffix = "" if parameter is None else f" {parameter}={value}"
        on_without = tuple(b for b in spec.without if b != behaviour)
        off_without = tuple(sorted(set(spec.without) | {behaviour}))
        # (--name names the pair, as a sweep's runs: it was dropped, each run called "study ...")
        prefix = f"{spec0.name or 'study'} {behaviour}"
        on_spec = replace(spec, without=on_without, name=f"{prefix} on{suffix}")
        # the switch is kvtrace's: with another backend, "on" is that backend as it is and
        # "off" kvtrace's manager with the behaviour switched off
        off_spec = replace(spec, without=off_without, name=f"{prefix} off{suffix}", backend="kvtrace")
        try:  # every pair's settings before the first replay: a bad one is told at once
            validate(off_spec)
            validate(on_spec)
        except ConfigError as err:  # (named at the --sweep value that made it, not at its flag)
            raise err if parameter is None else at_swept_value(err, {parameter: value}, "--sweep") from None
        pairs.append((parameter, value, off_spec, on_spec))
    if not trace.startswith(GENERATED_PREFIX):  # (a generated workload has some)
        # as --limit 0: two empty runs said the behaviour's effect was NOT shown, from nothing
        _first_request(spec0)
    from kvtrace.compare.source import diff_results, diff_runs

    result = StudyResult(behaviour=behaviour, trace=trace, db=str(db) if db is not None else None)
    for parameter, value, off_spec, on_spec in pairs:
        try:
            off = run_replay(off_spec, db=db, progress=progress, export=False)
            on = run_replay(on_spec, db=db, progress=progress, export=False)
        except KVTraceError as err:  # the engine's own (a swept capacity too small): named at its value, as sweep
            if parameter is None or type(err) is not KVTraceError:
                raise
            text = str(err)
            if parameter in CAPACITY_FORMS:  # (the engine's advice named --capacity-blocks, which the sweep replaces)
                text = swept_capacity_advice(text, f"{parameter} values of --sweep")
            # (and what it kept, as a sweep's line says it: the pairs before it were stored, unsaid)
            kept = f"{len(result.points)} of {len(pairs)} values' pairs {'stored' if db is not None else 'done'}"
            raise KVTraceError(f"--sweep {parameter}={value}: {text}; the study stopped at {parameter}={value}, "
                               f"{kept}") from None
        if db is not None and on.run_id and off.run_id:
            diff = diff_runs(db, off.run_id, on.run_id, seed=seed, percentiles=on_spec.percentiles)
        else:
            diff = diff_results(off.summary, off.per_request, on.summary, on.per_request, seed=seed,
                                run_a=_run_info(off_spec, off, trace), run_b=_run_info(on_spec, on, trace),
                                percentiles=on_spec.percentiles)
        result.points.append(
            StudyPoint(on=on.summary, off=off.summary, diff=diff, run_on=on.run_id, run_off=off.run_id,
                       parameter=parameter, value=value)
        )
    return result


def _first_request(spec: RunSpec) -> None:
    """Read the trace's first request, before any replay: a trace of none is refused by its
    reader (TraceFormatError, "holds no request")."""
    from kvtrace.replay.run import open_workload

    next(iter(open_workload(spec).requests), None)


def _run_info(spec: RunSpec, result: Any, trace: str) -> dict[str, Any]:
    """An unrecorded run as ``diff_runs`` describes a stored one: its name, trace, behaviours,
    mode and whose cache manager made its events (with --backend vllm, B is vLLM's and A
    kvtrace's: without --db the diff never said so, with it "Backend: A kvtrace · B vllm ...")."""
    from kvtrace.metrics import run_backend

    config = result.record.get("config")
    config = config if isinstance(config, dict) else {}
    mode = result.record.get("mode")
    return {"run_id": result.run_id, "name": spec.name, "trace": trace, "behaviours": _on_list(spec), "mode": mode,
            "backend": run_backend(mode, config), "vllm_version": config.get("vllm_version"),
            "vllm_commit": config.get("vllm_commit")}


def _on_list(spec: RunSpec) -> list[str]:
    """The behaviours switched on, sorted, as ``diff_runs`` lists a stored run's (``behaviours_on``):
    a study's --json named them in two orders with and without --db."""
    return sorted(b for b in BEHAVIOURS if b not in spec.without)


def _measured_delta(diff: Any, metric: str) -> float | None:
    """B − A of ``metric``; None where neither run measured it (``--no-content``: no stale
    hashes; the table said so by failing, after the study's own output)."""
    from kvtrace.compare.model import UnknownMetric

    try:
        return diff.metric(metric).delta
    except UnknownMetric:
        return None


def _delta_cell(metric: str, delta: float | None) -> str:
    """A delta as the diff's own tables write it (a hits delta of 172,032 read +1.72e+05); a
    rate's in percentage points."""
    from kvtrace.compare.render import fmt

    if delta is None:
        return "–"
    if metric.endswith("_rate"):
        return points_text(delta)
    return fmt(delta, signed=True)


def _cell(v: Any) -> str:
    """A value as the diff's tables write it (172032 lacked its separators, 40.786 ms read 40.79)."""
    from kvtrace.compare.render import fmt

    return fmt(v)
