"""Renderings of a ``RunDiff``: JSON, pull-request markdown, rich tables, plain text.

Plain functions over the records of ``model``, so that a diff is data and each view reads
the same numbers: ``to_json(diff)``, ``to_markdown(diff)``, ``tables(diff, metrics)``,
``render(diff, console)`` and ``to_text(diff, width)``. ``fmt`` is the one number format
of every comparison view (tables, markdown, gate messages).
"""

from __future__ import annotations

import decimal
import io
import math
import numbers
import re
import sys
from collections.abc import Iterable
from typing import Any

from kvtrace.compare.bootstrap import CI_LEVEL
from kvtrace.compare.model import (
    CountShift,
    MetricDelta,
    PercentileShift,
    RequestChange,
    RequestHitDiff,
    RunDiff,
    below_latency_resolution,
    events_mode,
)
from kvtrace.errors import ConfigError, check_option
from kvtrace.metrics import backend_label, is_latency_key, times_source, times_word
from kvtrace.names import (
    PIPED_WIDTH,
    markdown_code,
    markdown_literal,
    markup_literal,
    printable,
    shown_value,
    stdout_console,
)
from kvtrace.store.schema import SUMMARY_FIELDS

CORRECTNESS_METRICS = ("stale_hashes", "divergent_outputs")
# What the evictions table counts. Its "publish kind" rows are the store's evicted blocks
# by the kind of the publish that next took each block's place (``read.evictions_by_publish_kind``;
# "none": no publish did), not the kind the evicted entry was published as: read as the
# latter, a cache-only run's "none 1" beside "full 731" (every cache-only publish is full) was
# no kind at all, and an engine run's "checkpoint" rows were said to be checkpoints evicted.
MIN_TEXT_WIDTH = 20  # to_text's narrowest: below it rich folds every number a character a line
EVICTIONS_CAPTION = ("evicted blocks, by eviction reason and by the kind of the publish that next took the block's "
                     "place (none: no publish did)")


def check_diff(diff: object) -> None:
    """ConfigError naming the argument for a ``diff`` that is no RunDiff (None, a dict, a
    list of diffs): every public view of one, here and in ``gates``, checks it first (an
    AttributeError on ``run_a`` before)."""
    if not isinstance(diff, RunDiff):
        raise ConfigError("diff", shown_value(diff), "expected a RunDiff (kvtrace.compare.source.diff_runs)")


def _check_metrics(diff: RunDiff, metrics: object) -> set[str] | None:
    """The names ``tables`` keeps, or None for all; ConfigError for one string (its characters
    were read as names), no iterable, a name that is no string, or one that is neither a
    summary field nor a metric or percentile of ``diff`` (its table came out empty, silently)."""
    if metrics is None:
        return None
    if isinstance(metrics, (str, bytes)) or not isinstance(metrics, Iterable):
        raise ConfigError("metrics", shown_value(metrics), "expected metric names, a list of strings, or None")
    try:
        names = list(metrics)
    except Exception:  # (an iterable whose __iter__ raises: its own error was the traceback)
        raise ConfigError("metrics", shown_value(metrics),
                          "expected metric names, a list of strings, or None") from None
    known = {*SUMMARY_FIELDS, *(m.name for m in diff.metrics), *(s.name for s in diff.latency), *diff.unmeasured}
    for name in names:
        if not isinstance(name, str):
            raise ConfigError("metrics", shown_value(name), "expected a metric name, a string")
        if name not in known:
            raise ConfigError("metrics", shown_value(name), f"unknown metric; known: {', '.join(diff.metric_names())}")
    return {str.__str__(n) for n in names}


def _check_callable(name: str, value: object) -> None:
    if not callable(value):  # (a string: its TypeError on the first name shown)
        raise ConfigError(name, shown_value(value), "expected a function of one text")


def _check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):  # (detail="no" showed the detail)
        raise ConfigError(name, shown_value(value), "expected True or False")


def to_json(diff: RunDiff) -> dict[str, Any]:
    """A JSON-ready dict: run_a, run_b, same_trace, forced, metrics, correctness, and when
    present requests, evictions, latency (with "ci": [low, high], null when unknown) and
    bootstrap; then verdicts (each metric's and percentile's, as --markdown marks them)."""
    check_diff(diff)
    out: dict[str, Any] = {
        "run_a": diff.run_a,
        "run_b": diff.run_b,
        "same_trace": diff.same_trace,
        "forced": diff.forced,
        "notes": diff.notes,
        "metrics": {m.name: {"a": m.a, "b": m.b, "delta": m.delta, "rel": m.rel} for m in diff.metrics},
    }
    if diff.requests is not None:
        r = diff.requests
        out["requests"] = {
            "common": r.requests,
            "gained": r.gained,
            "lost": r.lost,
            "only_a": r.only_a,
            "only_b": r.only_b,
            "cached_tokens_delta": r.cached_tokens_delta,
            "top_gained": [_change_json(c) for c in r.top_gained],
            "top_lost": [_change_json(c) for c in r.top_lost],
        }
    if diff.evictions_by_reason or diff.evictions_by_publish_kind:
        out["evictions"] = {
            "by_reason": {s.key: {"a": s.a, "b": s.b, "delta": s.delta} for s in diff.evictions_by_reason},
            "by_publish_kind": {s.key: {"a": s.a, "b": s.b, "delta": s.delta} for s in diff.evictions_by_publish_kind},
        }
    out["correctness"] = {k: {"a": _side(diff, k, "a"), "b": _side(diff, k, "b")} for k in CORRECTNESS_METRICS}
    if diff.divergent_requests:
        out["correctness"]["divergent_requests"] = {
            side: [{"request_id": rid, "divergent_tokens": n} for rid, n in reqs]
            for side, reqs in diff.divergent_requests.items()
        }
    if diff.latency:
        out["latency"] = {
            s.name: {"a": s.a, "b": s.b, "delta": s.delta, "ci": [_nan_none(s.ci_low), _nan_none(s.ci_high)]}
            for s in diff.latency
        }
        out["bootstrap"] = diff.bootstrap
    # each row's verdict, as --markdown marks it (better, worse, same; null: none): a latency
    # statistic's is its bootstrap CI's, none where it has no CI
    out["verdicts"] = {
        "metrics": {m.name: m.verdict or None for m in diff.metrics},
        "latency": {s.name: _shift_verdict(s) or None for s in diff.latency},
    }
    return out


def _shift_verdict(s: PercentileShift) -> str:
    """A percentile row's verdict (its CI's): 'better', 'worse', 'same' (no change at all, as
    the summary row of the same percentile says: ``--json`` said "same" there and null here)
    or '' (no finding)."""
    if s.delta == 0 or below_latency_resolution(s.delta):
        return "same"
    return "" if not s.significant else ("worse" if s.delta > 0 else "better")


def to_markdown(diff: RunDiff) -> str:
    """A compact report ready to paste into a pull request."""
    check_diff(diff)
    a, b = diff.run_a, diff.run_b
    lines = [
        f"### kvtrace diff: {markdown_code(_label(a))} → {markdown_code(_label(b))}",
        "",
        f"Trace: {markdown_code(a.get('trace') or '?')}"  # (a collected run names none: not `None`)
        + ("" if diff.same_trace else f" vs {markdown_code(b.get('trace') or '?')} (**different traces, forced**)"),
    ]
    if a.get("behaviours") is not None or b.get("behaviours") is not None:
        lines.append(f"Behaviours: A {markdown_code(_fmt_behaviours(a))} · B {markdown_code(_fmt_behaviours(b))}")
    lines.append(times_note(diff))
    backends = backend_note(diff)
    if backends:
        lines.append(backends)
    for side, run in (("A", a), ("B", b)):
        if run.get("status") not in (None, "complete"):
            lines += ["", f"> ⚠️ run {side} is **{markdown_literal(run['status'])}**: its numbers cover only what "
                          "was recorded."]
    lines += [line for note in diff.notes for line in ("", f"> ⚠️ {note}")]  # (kvtrace's own text)
    head = ["| metric | A | B | Δ | Δ% | |", "|---|---:|---:|---:|---:|---|"]

    def row(m: MetricDelta) -> str:
        return (
            f"| {_md_name(m.name)} | {fmt(m.a)} | {fmt(m.b)} | {_change(m)} | "
            f"{fmt_rel(m.rel, m.delta, _fine(m))} | {_mark(m.verdict)} |"
        )

    # The summary fields first; the run's further metrics folded away below them.
    main = [m for m in diff.metrics if m.name in SUMMARY_FIELDS]
    extra = [m for m in diff.metrics if m.name not in SUMMARY_FIELDS]
    lines += ["", *head, *map(row, main or extra)]
    if main and extra:
        lines += ["", f"<details><summary>{len(extra)} more metrics</summary>", "", *head, *map(row, extra),
                  "", "</details>"]
    if diff.latency:
        bs = diff.bootstrap
        paired = ", paired" if bs.get("paired") else ""
        lines += [
            "",
            f"**Latency percentiles** ({round(CI_LEVEL * 100)}% bootstrap CI over requests, "
            f"{bs.get('resamples')} resamples, seed {bs.get('seed')}{paired}; {_times(diff)} time)",
            "",
            "| percentile | A | B | Δ | CI | |",
            "|---|---:|---:|---:|---|---|",
        ]
        for s in diff.latency:
            verdict = _shift_verdict(s)
            lines.append(
                f"| {_md_name(s.name)} | {fmt(s.a)} | {fmt(s.b)} | {fmt(s.delta, signed=True)} | "
                f"[{fmt(s.ci_low, signed=True)}, {fmt(s.ci_high, signed=True)}] | {_mark(verdict)} |"
            )
    if diff.evictions_by_reason or diff.evictions_by_publish_kind:
        lines += ["", f"**Evictions**: {EVICTIONS_CAPTION}.", "", "| by | key | A | B | Δ |",
                  "|---|---|---:|---:|---:|"]
        for dim, shifts in (("reason", diff.evictions_by_reason), ("publish kind", diff.evictions_by_publish_kind)):
            for c in shifts:
                lines.append(f"| {dim} | {_md_name(c.key)} | {c.a:,} | {c.b:,} | {_count_delta(c)} |")
    lines += _correctness_markdown(diff)
    r = diff.requests
    if r is not None and (r.requests or r.only_a or r.only_b):
        lines += [
            "",
            f"**Per-request cached tokens** (local + external hits at first schedule): {r.gained:,} gained, "
            f"{r.lost:,} lost, "
            f"{r.requests - r.gained - r.lost:,} unchanged of {r.requests:,} common requests "
            f"(net {r.cached_tokens_delta:+,d} tokens)."
            + (f" Only in A: {r.only_a:,}, only in B: {r.only_b:,}." if r.only_a or r.only_b else ""),
        ]
        if r.top_gained or r.top_lost:
            lines += ["", "| request | prompt | cached A | cached B | Δ |", "|---|---:|---:|---:|---:|"]
            for ch in r.top_gained + r.top_lost:
                lines.append(f"| {_md_cell_code(ch.request_id)} | {ch.prompt_tokens} | {ch.hit_a} | {ch.hit_b} | "
                             f"{ch.delta:+d} |")
    return "\n".join(lines) + "\n"


def _times(diff: RunDiff) -> str:
    return times_word(*((events_mode(r), r.get("cost_model")) for r in (diff.run_a, diff.run_b)))


def times_note(diff: RunDiff, code: Any = markdown_code, literal: Any = None) -> str:
    """Where the diff's times come from (``metrics.times_source``: a cost model, a
    collector's sender, or none). ``code``: how the model's name is shown (Markdown's code
    span; plain text for a terminal); ``literal``: how a stored coefficient's name and value
    are (default: as Markdown shows them, ``_md_name``)."""
    check_diff(diff)  # (a notebook's None: an AttributeError on run_a)
    _check_callable("code", code)
    if literal is not None:
        _check_callable("literal", literal)

    def source(run: dict[str, Any]) -> str:
        return times_source(events_mode(run), run.get("cost_model"), code)

    a, b = source(diff.run_a), source(diff.run_b)
    if a != b:
        return f"Times: A {a} · B {b}"
    changed = coefficient_changes(diff.run_a.get("cost_model_coefficients"),
                                  diff.run_b.get("cost_model_coefficients"), literal=literal or _md_name)
    return f"Times: {a}" + (f", its coefficients not the same: {changed}" if changed else "")


def coefficient_changes(a: Any, b: Any, most: int = 3, literal: Any = printable) -> str | None:
    """The coefficients two cost models of one name differ in, "KEY A x → B y" (at most
    ``most``, then how many more); None when they agree or either is unknown. ``literal``
    shows each stored key and value (a store's record may hold any text: a key
    '<img src=x>' was live HTML in --markdown, an ESC a terminal code)."""
    if not isinstance(a, dict) or not isinstance(b, dict) or a == b:
        return None
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    shown = ", ".join(f"{literal(k)} A {literal(a.get(k))} → B {literal(b.get(k))}" for k in keys[:most])
    return shown + (f" and {len(keys) - most} more" if len(keys) > most else "")


def backend_note(diff: RunDiff, code: Any = markdown_code) -> str | None:
    """Whose cache manager made each run's events (``metrics.backend_label``), where either
    is not kvtrace's own: a patched vLLM's diff names the commits it compares. None else."""
    check_diff(diff)
    _check_callable("code", code)
    a, b = (backend_label(r.get("mode"), r) for r in (diff.run_a, diff.run_b))
    if a == b == "kvtrace":
        return None
    a, b = (code(x) if x else "unknown (collected)" for x in (a, b))
    return f"Backend: {a}" if a == b else f"Backend: A {a} · B {b}"


def _correctness_markdown(diff: RunDiff) -> list[str]:
    parts = []
    for name in CORRECTNESS_METRICS:
        a, b = _side(diff, name, "a"), _side(diff, name, "b")
        if a or b:
            parts.append(f"{name.replace('_', ' ')} A {fmt(a)} → B {fmt(b)}")
    if not parts:
        return []
    out = ["", "**Correctness**: " + "; ".join(parts) + "."]
    for side in ("a", "b"):
        reqs = diff.divergent_requests.get(side) or []
        if reqs:
            shown = ", ".join(f"{markdown_code(rid)} ({n})" for rid, n in reqs[:5])
            out.append(f"Divergent requests in {side.upper()}: {len(reqs)}; most divergent tokens: {shown}.")
    return out


def tables(diff: RunDiff, metrics: Iterable[str] | None = None, *, detail: bool = True) -> list[Any]:
    """rich Tables for a terminal, in this order: summary metrics, latency percentiles,
    evictions (and the line saying what its publish-kind rows count), top requests (each
    only when it has rows, the first always).
    ``metrics`` limits the first table to those names; ``detail`` False leaves out the
    evictions and top requests (the first two alone, as kvtrace demo shows each diff)."""
    from rich.table import Table
    from rich.text import Text

    check_diff(diff)
    keep = _check_metrics(diff, metrics)
    _check_flag("detail", detail)
    out: list[Any] = [_summary_table(diff, keep)]
    if diff.latency:
        t = Table(title=f"latency percentiles, {_times(diff)} time ({round(CI_LEVEL * 100)}% bootstrap CI)",
                  title_justify="left")
        for col in ("percentile", "A", "B", "Δ", "CI"):
            t.add_column(col, justify="left" if col == "percentile" else "right", overflow="fold")
        for s in diff.latency:
            style = None if not s.significant else ("red" if s.delta > 0 else "green")
            t.add_row(
                markup_literal(s.name), fmt(s.a), fmt(s.b), fmt(s.delta, signed=True),
                f"[{fmt(s.ci_low, signed=True)}, {fmt(s.ci_high, signed=True)}]", style=style,
            )
        out.append(t)
    if not detail:
        return out
    if diff.evictions_by_reason or diff.evictions_by_publish_kind:
        t = Table(title="evictions", title_justify="left")
        for col in ("by", "key", "A", "B", "Δ"):
            t.add_column(col, justify="left" if col in ("by", "key") else "right", overflow="fold")
        for dim, shifts in (("reason", diff.evictions_by_reason), ("publish kind", diff.evictions_by_publish_kind)):
            for c in shifts:
                t.add_row(dim, markup_literal(c.key), f"{c.a:,}", f"{c.b:,}", _count_delta(c))
        out.append(t)
        if diff.evictions_by_publish_kind:  # (the rows' meaning, under the table, at the console's width)
            out.append(Text(EVICTIONS_CAPTION))
    r = diff.requests
    if r is not None and (r.top_gained or r.top_lost):
        t = Table(title=requests_line(r), title_justify="left")
        for col in ("request", "prompt", "cached A", "cached B", "Δ"):
            t.add_column(col, justify="left" if col == "request" else "right", overflow="fold")
        for ch in r.top_gained + r.top_lost:
            t.add_row(markup_literal(ch.request_id), str(ch.prompt_tokens), str(ch.hit_a), str(ch.hit_b),
                      f"{ch.delta:+d}",
                      style="green" if ch.delta > 0 else "red")
        out.append(t)
    return out


def _summary_table(diff: RunDiff, keep: set[str] | None, relative: bool = True) -> Any:
    """The summary metrics' table (``relative`` False: without its Δ% column)."""
    from rich.table import Table

    t = Table(title=markup_literal(f"{_label(diff.run_a)} → {_label(diff.run_b)}"), title_justify="left")
    for col in ("metric", "A", "B", "Δ", *(("Δ%",) if relative else ())):
        t.add_column(col, justify="left" if col == "metric" else "right", overflow="fold")
    for m in diff.metrics:
        if keep is not None and m.name not in keep:
            continue
        style = {"better": "green", "worse": "red"}.get(m.verdict)
        rel = (fmt_rel(m.rel, m.delta, _fine(m)),) if relative else ()
        t.add_row(markup_literal(m.name), fmt(m.a), fmt(m.b), _change(m), *rel, style=style)
    return t


REL_LEFT_OUT = "columns left out to fit the terminal: Δ% (a wider terminal, a pipe, --markdown or --json shows them)"


def _fitted(diff: RunDiff, keep: set[str] | None, first: Any, console: Any) -> Any:
    """The summary table ``first`` as ``console`` shows it: without its Δ% column where only
    that keeps each metric's name and number on one line (at 80 columns, a name such as
    prompt_tokens_by_source.external_kv_transfer folded mid-word, copied with the table's
    border in it), else as it is."""
    from rich.measure import Measurement

    width = console.options.max_width
    unbounded = console.options.update(max_width=PIPED_WIDTH)  # (a measure within the console's is cut to it)
    if Measurement.get(console, unbounded, first).maximum <= width:
        return None
    narrower = _summary_table(diff, keep, relative=False)
    return narrower if Measurement.get(console, unbounded, narrower).maximum <= width else None


def render(diff: RunDiff, console: Any = None, metrics: Iterable[str] | None = None, *,
           detail: bool = True) -> None:
    """Print a warning per unfinished run, the diff's notes, where its times come from and
    whose cache made each run, then ``tables(diff, metrics, detail=detail)`` and the
    per-request line where no table of requests holds it, to ``console`` (default: stdout).
    kvtrace diff prints it all; kvtrace demo each of its diffs with ``detail`` False (the
    same lines, the evictions and top requests left out)."""
    check_diff(diff)
    metrics = _check_metrics(diff, metrics)  # (before a line is printed: an iterator read once)
    _check_flag("detail", detail)
    if console is not None and not callable(getattr(console, "print", None)):
        raise ConfigError("console", shown_value(console), "expected a rich Console (or None: stdout)")
    # (stdout's, study's too: a column left out is said on stderr, as runs and sweep say it)
    own = console is None or getattr(console, "file", None) is sys.stdout
    console = console or stdout_console()
    for side, run in (("A", diff.run_a), ("B", diff.run_b)):
        if run.get("status") not in (None, "complete"):
            label = markup_literal(_label(run))
            console.print(f"[yellow]run {side} ({label}) is {markup_literal(run['status'])}: partial numbers[/yellow]")
    for note in diff.notes:
        console.print(f"[yellow]{markup_literal(note)}[/yellow]")
    console.print(times_note(diff, code=printable, literal=printable), markup=False, highlight=False)
    backends = backend_note(diff, code=printable)
    if backends:
        console.print(backends, markup=False, highlight=False)
    shown = tables(diff, metrics, detail=detail)
    narrower = _fitted(diff, metrics, shown[0], console)
    if narrower is not None:
        shown[0] = narrower
    for t in shown:
        console.print(t)
        if t is narrower and own:
            console.file.flush()
            print(REL_LEFT_OUT, file=sys.stderr, flush=True)
        elif t is narrower:
            console.print(REL_LEFT_OUT, markup=False, highlight=False)
    r = diff.requests
    table = detail and r is not None and bool(r.top_gained or r.top_lost)
    if r is not None and not table and (r.requests or r.only_a or r.only_b):
        # (no request gained or lost: no table, but what the others say is said all the same;
        # 698 requests only in A, of a run stopped later, went unsaid where --markdown said it)
        console.print(requests_line(r), markup=False, highlight=False)


def requests_line(r: RequestHitDiff) -> str:
    """The per-request comparison in one line: the per-request table's title, or the line
    in its place when no request gained or lost (the requests only one run holds too)."""
    if not isinstance(r, RequestHitDiff):  # (None: an AttributeError; a RunDiff: its .requests is this)
        raise ConfigError("r", shown_value(r), "expected a RequestHitDiff (RunDiff.requests)")
    only = f"; only in A: {r.only_a:,}, only in B: {r.only_b:,}" if r.only_a or r.only_b else ""
    return (f"cached tokens per request (local + external hits): {r.gained:,} gained, {r.lost:,} lost of "
            f"{r.requests:,}{only}")


def to_text(diff: RunDiff, width: int = 120) -> str:
    """What ``render`` prints, as plain text (no colour) ``width`` columns wide."""
    from rich.console import Console

    check_diff(diff)
    if isinstance(width, bool) or not isinstance(width, int):  # (2.5 or "80": a TypeError deep in rich)
        raise ConfigError("width", shown_value(width), "expected a whole number of columns")
    check_option("width", width, MIN_TEXT_WIDTH, PIPED_WIDTH)  # (0 gave an empty text)
    console = Console(width=width, record=True, color_system=None, force_terminal=False, file=io.StringIO())
    render(diff, console)
    return console.export_text()


# --------------------------------------------------------------------------- formatting


def fmt(v: float | None, signed: bool = False, fine: bool | None = None) -> str:
    """A number for a table cell: '–' when missing or NaN, thousands separators for ints
    (and integral floats from 1000 on), 1, 3 or 4 decimals by magnitude; ``signed`` adds
    '+' to positive values. |v| < 1e-9 shows as 0 (float noise, not a change), and so
    does a change (``signed``) that rounds to 0 at its decimals (a CI bound of -3e-6 ms read
    "-0.0000"). ``fine`` (default: for a value, not a change) shows a nonzero number that
    small in 3 significant digits: a run's 3e-05 output tokens/s read 0.0000, as none.
    ConfigError for a value that is no number (a str's TypeError before); a numpy int is
    shown as the int it is (it read 5.000), an int past float's range in 6 digits (an
    OverflowError)."""
    _check_flag("signed", signed)  # (an array's truth ValueError, an object's own __bool__, before)
    if fine is not None:
        _check_flag("fine", fine)
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if not isinstance(v, numbers.Real):
        raise ConfigError("value", shown_value(v), "expected a number or None")
    v = _plain(v)  # (a subclass's own __int__, __abs__ or __format__ never runs)
    if isinstance(v, int):
        if abs(v) >= _HUGE:  # (beyond float: its digits, not float's OverflowError)
            return format(decimal.Decimal(v), "+.6g" if signed else ".6g")
    elif math.isnan(v):  # (a numpy float32's, a Fraction's)
        return "–"
    if isinstance(v, float) and abs(v) < 1e-9:
        v = 0.0
    if (not signed if fine is None else fine) and isinstance(v, float) and 0 < abs(v) < 0.00005:
        return f"{v:+.3g}" if signed else f"{v:.3g}"
    if abs(v) >= _HUGE:  # (a damaged record's 1e308 filled a cell with 309 digits)
        return f"{v:+.6g}" if signed else f"{v:.6g}"
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) >= 1000):
        return f"{int(v):+,d}" if signed else f"{int(v):,d}"
    if abs(v) >= 100:
        s = f"{v:,.1f}"
    elif abs(v) >= 1:
        s = f"{v:.3f}"
    else:
        s = f"{v:.4f}"
    if not s.strip("-0.,"):  # (rounded to zero: no sign)
        return s.lstrip("-")
    return ("+" if signed and v > 0 else "") + s


def _plain(v: numbers.Real) -> int | float:
    """A number as the plain int or float it is: an int or float subclass's value, read past
    its own methods (one whose __int__, __abs__ or __format__ raises was that traceback); a
    numpy number, a Fraction, by its own conversion."""
    if isinstance(v, int):
        return int.__int__(v)
    if isinstance(v, float):
        return float.__float__(v)
    try:
        return int(v) if isinstance(v, numbers.Integral) else float(v)
    except Exception:  # (an API caller's number type whose conversion raises)
        raise ConfigError("value", shown_value(v), "expected a number or None") from None


def _change(m: MetricDelta) -> str:
    """A summary row's Δ: a latency's at the diff's resolution (a sub-µs change is none), any
    other small one in its digits (3e-05 output tokens/s more read 0.0000 beside +50%)."""
    return fmt(m.delta, signed=True, fine=_fine(m))


def _fine(m: MetricDelta) -> bool:
    """Whether a summary row's small change keeps its digits: any but a latency's."""
    return not is_latency_key(m.name)


# Beyond any count or time kvtrace records (int64 nanoseconds end near 9.2e18): shown in
# 6 significant digits, not digit by digit.
_HUGE = 1e18


def shows_no_change(v: float | None, fine: bool = False) -> bool:
    """Whether ``fmt`` shows the change ``v`` as none: no digit but 0 at its decimals (a
    change of -3e-6 ms is its 0.0000), or no number at all (–). ``fine``: as a change that
    keeps its digits shows it (a rate's -3.85e-05: a change). Every view that says "no
    change" of a delta (Δ%, the dashboard's tiles) asks here."""
    return not any(c in "123456789" for c in fmt(v, signed=True, fine=fine))


def fmt_rel(rel: float | None, delta: float | None = None, fine: bool = False) -> str:
    """A relative change as a signed percentage; '–' when undefined. ``delta``: the change
    it is relative to (None: none shown). One that rounds to -0.0% reads +0.0%, as no change
    does, only where ``delta`` too shows as zero ("-0.0%" sat beside a delta of 0.0000); a
    fall too small for a tenth of a percent keeps its sign beside the delta that shows it
    (-0.3239 read +0.0%)."""
    _check_flag("fine", fine)
    if rel is None or (isinstance(rel, float) and math.isnan(rel)):  # (NaN read "+nan%", fmt's –)
        return "–"
    if not isinstance(rel, numbers.Real):  # (a str's TypeError from abs, an array's truth ValueError)
        raise ConfigError("rel", shown_value(rel), "expected a number or None")
    rel = _plain(rel)
    if isinstance(rel, int):
        if abs(rel) >= _HUGE / 100:  # (beyond float: its digits, not float's OverflowError)
            return format(decimal.Decimal(rel) * 100, "+.3g") + "%"
    elif math.isnan(rel):
        return "–"
    if abs(rel) >= _HUGE / 100:
        return f"{rel * 100:+.3g}%"
    shown = f"{rel * 100:+.1f}%"
    if shown == "-0.0%" and shows_no_change(delta, fine):
        return "+0.0%"
    return shown


def _side(diff: RunDiff, name: str, side: str) -> Any:
    """Summary metric ``name``'s raw value in run ``side`` ('a'/'b'); None when absent."""
    for m in diff.metrics:
        if m.name == name:
            return m.a if side == "a" else m.b
    return None


def _label(run: dict[str, Any]) -> str:
    """A run as the user named it, on one printable line (for markup: ``markup_literal``)."""
    return printable(run.get("name") or run.get("run_id") or "?")


_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.]+")


def _md_name(name: object) -> str:
    """A metric, percentile or eviction key in a Markdown table: as it is when it is a plain
    name (prefix_cache_hit_rate), else every mark escaped (a stored run may hold any text)."""
    text = str(name)
    return text if _PLAIN_NAME.fullmatch(text) else markdown_literal(text)


def _md_cell_code(text: object) -> str:
    """A code span inside a Markdown table cell (GFM splits cells at a '|' even there)."""
    return markdown_code(text).replace("|", "\\|")


def _fmt_behaviours(run: dict[str, Any]) -> str:
    b = run.get("behaviours")
    if b is None:
        return "?"
    if isinstance(b, str):
        return b or "none"
    return ", ".join(sorted(b)) or "none"


def _count_delta(c: CountShift) -> str:
    """An eviction count's change, with separators as the summary's counts (the table wrote
    302969 below a summary's 302,969); '–' for counts of two block sizes, which have none."""
    return "–" if c.delta is None else f"{c.delta:+,d}"


def _mark(verdict: str) -> str:
    return {"better": "✅ better", "worse": "❌ worse", "same": ""}.get(verdict, "")


def _nan_none(v: float) -> float | None:
    return None if math.isnan(v) else v


def _change_json(c: RequestChange) -> dict[str, Any]:
    return {"request_id": c.request_id, "prompt_tokens": c.prompt_tokens, "hit_a": c.hit_a, "hit_b": c.hit_b,
            "delta": c.delta}
