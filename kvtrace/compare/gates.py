"""``kvtrace diff --fail-if METRIC:THRESHOLD``: gates that turn a diff into an exit status.

Sign convention: the threshold's sign names the bad direction.

- Negative: the maximum allowed drop. ``prefix_cache_hit_rate:-0.01`` fails when the metric
  drops by more than 0.01 (``delta < -0.01``).
- Positive or unsigned: the maximum allowed rise. ``p99_ttft_ms:+5`` (or ``:5``) fails when
  it rises by more than 5 (``delta > 5``).
- ``-0`` and ``+0`` differ: no drop at all, no rise at all.
- A trailing ``%`` compares the relative change instead: ``p99_ttft_ms:+10%``.
- A gate that cannot be evaluated (the metric missing in a run or null in both, such as
  ``stale_hashes`` of ``--no-content`` runs) fails: a gate that cannot be checked must not
  pass. A relative gate on a zero baseline can: no change passes it, any change in its
  direction is beyond it.
- A gate reads the raw delta, also of a latency statistic whose bootstrap CI finds no change
  (the diff's verdict): its message says so.
- A change equal to the threshold passes, also where float rounding of the two values puts
  it a few ulps beyond (0.50 -> 0.49 is a drop of exactly 0.01, computed as 0.010000000000000009).

METRIC is any name ``RunDiff.metric`` knows: a summary field or a bootstrap percentile.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass

from kvtrace.compare.bootstrap import CI_LEVEL
from kvtrace.compare.model import MetricDelta, RunDiff
from kvtrace.compare.render import check_diff, fmt
from kvtrace.errors import ConfigError, KVTraceError
from kvtrace.metrics import SUMMARY_RATES
from kvtrace.names import cut_middle, printable, shown_value


@dataclass(slots=True, frozen=True)
class Gate:
    metric: str
    threshold: float  # signed, as a fraction when relative; negative = max allowed drop
    relative: bool
    bad_direction: int  # -1: a drop is bad ("-..."), +1: a rise is bad ("+..." or unsigned)
    text: str


def parse_gate(text: str) -> Gate:
    """'prefix_cache_hit_rate:-0.01' | 'p99_ttft_ms:+5' | 'p99_ttft_ms:10%'; KVTraceError (one
    line, quoting ``text`` cut to a readable length) for anything else, also for a value that
    is no string (None, bytes, a number: an AttributeError before)."""
    if not isinstance(text, str):
        raise ConfigError("--fail-if", shown_value(text), "expected METRIC:THRESHOLD, a string")
    text = str.__str__(text)  # (a str subclass's own partition, strip or repr never runs)
    shown = shown_value(text)  # (a 5,000-character gate was quoted whole)
    metric, sep, raw = text.partition(":")
    metric, raw = metric.strip(), raw.strip()
    if not sep or not metric or not raw:
        raise KVTraceError(f"--fail-if {shown}: expected METRIC:THRESHOLD, e.g. prefix_cache_hit_rate:-0.01")
    relative = raw.endswith("%")
    num = raw[:-1] if relative else raw
    try:  # (in ASCII digits, as every number a user types: float() read '１０' and '1_0' as 10)
        value = float(num)
        if not (num.isascii() and "_" not in num):
            raise ValueError
    except ValueError:
        raise KVTraceError(f"--fail-if {shown}: threshold {shown_value(raw, 40)} is not a number (e.g. -0.01, +5, "
                           "+10%)") from None
    if math.isnan(value) or math.isinf(value):
        raise KVTraceError(f"--fail-if {shown}: threshold must be finite")
    # The sign is read from the text so that "-0" (no drop at all) differs from "+0".
    bad = -1 if num.lstrip().startswith("-") else 1
    # A gate that can never fail would pass silently: refused, with the likely intent.
    if not relative and metric in SUMMARY_RATES and abs(value) >= 1:
        raise KVTraceError(f"--fail-if {shown}: {metric} is a fraction from 0 to 1, so it never changes by more "
                           f"than 1; for percentage points write {value / 100:+g}, for a relative change "
                           f"{cut_middle(printable(raw), 40)}%")
    if relative and value <= -100:
        raise KVTraceError(f"--fail-if {shown}: no metric drops by more than 100% (they are never negative); "
                           "a relative drop gate is above -100%, e.g. -5%")
    return Gate(metric, value / 100 if relative else value, relative, bad, f"{metric}:{raw}")


def parse_gates(gates: Iterable[str]) -> list[Gate]:
    """Each of ``gates`` parsed (``parse_gate``); KVTraceError for ``gates`` that is one string
    (its characters were read as gates) or no iterable, and for a second gate on a metric in
    the same direction and of the same kind (absolute or relative) as an earlier one: one of
    the two never decides, and which was left to the reader (a drop gate and a rise gate on
    one metric, a band, are two directions)."""
    if isinstance(gates, (str, bytes)) or not isinstance(gates, Iterable):
        raise ConfigError("--fail-if", shown_value(gates), "expected METRIC:THRESHOLD strings, a list of them")
    try:
        texts = list(gates)
    except Exception:  # (an iterable whose __iter__ raises: its own error was the traceback)
        raise ConfigError("--fail-if", shown_value(gates),
                          "expected METRIC:THRESHOLD strings, a list of them") from None
    parsed: list[Gate] = []
    seen: dict[tuple[str, int, bool], Gate] = {}
    for text in texts:
        gate = parse_gate(text)
        key = (gate.metric, gate.bad_direction, gate.relative)
        if key in seen:
            kind = ("relative " if gate.relative else "") + ("drop" if gate.bad_direction < 0 else "rise")
            raise KVTraceError(f"--fail-if {shown_value(gate.text)}: a second {kind} gate on "
                               f"{shown_value(gate.metric)} (after {shown_value(seen[key].text)}); give one, the "
                               "limit meant")
        seen[key] = gate
        parsed.append(gate)
    return parsed


def check_fail_if(diff: RunDiff, gates: Iterable[str]) -> list[str]:
    """The gates that ``diff`` violates, one message each (empty list = pass).

    KVTraceError for a malformed gate or an unknown metric (the message lists the known ones),
    for a ``diff`` that is no RunDiff and for ``gates`` that are no list of strings.
    """
    check_diff(diff)
    failures = []
    known = diff.metric_names()
    for gate in parse_gates(gates):  # (all of them first: a malformed one is told before any is judged)
        try:
            m = diff.metric(gate.metric)
        except KeyError:
            if gate.metric in diff.unmeasured:  # a known metric, null in both runs: not an unknown name
                failures.append(f"{gate.text}: cannot evaluate: neither run measured {gate.metric} (A=–, B=–)")
                continue
            msg = (f"--fail-if {shown_value(gate.text)}: unknown metric {shown_value(gate.metric)}; "
                   f"known: {', '.join(known)}")
            raise KVTraceError(msg) from None
        change = m.rel if gate.relative else m.delta
        unit = "%" if gate.relative else ""
        if gate.relative and m.a == 0 and m.b is not None and math.isfinite(m.b) and m.delta is not None:
            # from a zero baseline every change is beyond any relative limit, and none is none
            # (stale_hashes:+0% failed two clean runs, 0 and 0, as "cannot evaluate")
            rose = m.b > 0
            if m.b != 0 and gate.bad_direction == (1 if rose else -1):
                failures.append(f"{gate.metric} {'rose' if rose else 'dropped'} from A=0 to B={m.b:.6g}: beyond any "
                                f"relative {'rise' if rose else 'drop'} ({gate.text})")
            continue
        if change is None or (isinstance(change, float) and math.isnan(change)) or m.a is None or m.b is None:
            # (why, where both values are there: "cannot evaluate (A=0.1583, B=0.3615)" read as a bug)
            why = "" if m.a is None or m.b is None or m.delta is not None else f": {diff.block_units or 'no delta'}"
            failures.append(f"{gate.text}: cannot evaluate{why} (A={fmt(m.a)}, B={fmt(m.b)})")
            continue
        shown = change * 100 if gate.relative else change
        limit = gate.threshold * 100 if gate.relative else gate.threshold
        slack = _rounding(m.a, m.b, gate)
        if gate.bad_direction < 0 and change < gate.threshold - slack:
            by, allowed = _distinct(-shown, abs(limit))
            failures.append(
                f"{gate.metric} dropped by {by}{unit} (A={m.a:.6g}, B={m.b:.6g}); allowed drop {allowed}{unit}"
                + _ci_caveat(diff, m)
            )
        elif gate.bad_direction > 0 and change > gate.threshold + slack:
            by, allowed = _distinct(shown, limit)
            failures.append(
                f"{gate.metric} rose by {by}{unit} (A={m.a:.6g}, B={m.b:.6g}); allowed rise {allowed}{unit}"
                + _ci_caveat(diff, m)
            )
    da, db = diff.run_a.get("definitions"), diff.run_b.get("definitions")
    if failures and da is not None and db is not None and da != db:
        # (a gate judged numbers whose meaning changed between the runs, and its line said nothing of it)
        failures = [f"{f} (A and B were recorded under different metric definitions: see the diff's first note)"
                    for f in failures]
    return failures


def _ci_caveat(diff: RunDiff, m: MetricDelta) -> str:
    """What a failed gate on a latency statistic says of its bootstrap CI, where that finds no
    change or there is none: a gate reads the raw delta (a threshold the user chose), and the
    diff's tables gave the same change no verdict."""
    if not m.needs_ci or m.significant:
        return ""
    s = diff.shift(m.name)
    if s is not None:
        return (f"; a raw change: its {round(CI_LEVEL * 100)}% bootstrap CI [{fmt(s.ci_low, signed=True)}, "
                f"{fmt(s.ci_high, signed=True)}] finds no change")
    return "; a raw change: no bootstrap CI judged it (the diff gives it no verdict)"


def _rounding(a: float, b: float, gate: Gate) -> float:
    """How far float rounding can move a computed change from the exact one: a few ulps of
    the values it was computed from (each a rounded rate or interpolated percentile) and of
    the threshold. Far below any change a gate is written for, and below 1 for any count
    under 10**14."""
    scale = max(abs(a), abs(b))
    if gate.relative:
        scale /= abs(a)  # (a != 0: a relative change exists)
    return 8 * sys.float_info.epsilon * (scale + abs(gate.threshold))


def _distinct(change: float, limit: float) -> tuple[str, str]:
    """A change and its limit with 6 significant digits, or with as many as tell them apart
    ("dropped by 0.01; allowed drop 0.01" read as a gate failing at its own threshold)."""
    for digits in (6, 9, 12, 17):
        a, b = f"{change:.{digits}g}", f"{limit:.{digits}g}"
        if a != b:
            break
    return a, b
