"""``kvtrace diff --fail-if METRIC:THRESHOLD``: gates that turn a diff into an exit status.

Sign convention: the threshold's sign names the bad direction.

- Negative: the maximum allowed drop. ``prefix_cache_hit_rate:-0.01`` fails when the metric
  drops by more than 0.01 (``delta < -0.01``).
- Positive or unsigned: the maximum allowed rise. ``p99_ttft_ms:+5`` (or ``:5``) fails when
  it rises by more than 5 (``delta > 5``).
- ``-0`` and ``+0`` differ: no drop at all, no rise at all.
- A trailing ``%`` compares the relative change instead: ``p99_ttft_ms:+10%``.
- A gate that cannot be evaluated (the metric missing in a run, a relative gate on a zero
  baseline) fails: a gate that cannot be checked must not pass.

METRIC is any name ``RunDiff.metric`` knows: a summary field or a bootstrap percentile.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from kvtrace.compare.model import RunDiff
from kvtrace.compare.render import fmt
from kvtrace.errors import KVTraceError


@dataclass(slots=True, frozen=True)
class Gate:
    metric: str
    threshold: float  # signed, as a fraction when relative; negative = max allowed drop
    relative: bool
    bad_direction: int  # -1: a drop is bad ("-..."), +1: a rise is bad ("+..." or unsigned)
    text: str


def parse_gate(text: str) -> Gate:
    """'prefix_cache_hit_rate:-0.01' | 'p99_ttft_ms:+5' | 'p99_ttft_ms:10%'; KVTraceError (one
    line) for anything else."""
    metric, sep, raw = text.partition(":")
    metric, raw = metric.strip(), raw.strip()
    if not sep or not metric or not raw:
        raise KVTraceError(f"--fail-if {text!r}: expected METRIC:THRESHOLD, e.g. prefix_cache_hit_rate:-0.01")
    relative = raw.endswith("%")
    num = raw[:-1] if relative else raw
    try:
        value = float(num)
    except ValueError:
        raise KVTraceError(f"--fail-if {text!r}: threshold {raw!r} is not a number (e.g. -0.01, +5, +10%)") from None
    if math.isnan(value) or math.isinf(value):
        raise KVTraceError(f"--fail-if {text!r}: threshold must be finite")
    # The sign is read from the text so that "-0" (no drop at all) differs from "+0".
    bad = -1 if num.lstrip().startswith("-") else 1
    return Gate(metric, value / 100 if relative else value, relative, bad, f"{metric}:{raw}")


def check_fail_if(diff: RunDiff, gates: Iterable[str]) -> list[str]:
    """The gates that ``diff`` violates, one message each (empty list = pass).

    KVTraceError for a malformed gate or an unknown metric (the message lists the known ones).
    """
    failures = []
    known = diff.metric_names()
    for text in gates:
        gate = parse_gate(text)
        try:
            m = diff.metric(gate.metric)
        except KeyError:
            msg = f"--fail-if {text!r}: unknown metric {gate.metric!r}; known: {', '.join(known)}"
            raise KVTraceError(msg) from None
        change = m.rel if gate.relative else m.delta
        unit = "%" if gate.relative else ""
        if change is None or (isinstance(change, float) and math.isnan(change)):
            failures.append(f"{gate.text}: cannot evaluate (A={fmt(m.a)}, B={fmt(m.b)})")
            continue
        shown = change * 100 if gate.relative else change
        limit = gate.threshold * 100 if gate.relative else gate.threshold
        if gate.bad_direction < 0 and change < gate.threshold:
            failures.append(
                f"{gate.metric} dropped by {-shown:.6g}{unit} (A={m.a:.6g}, B={m.b:.6g}); "
                f"allowed drop {abs(limit):.6g}{unit}"
            )
        elif gate.bad_direction > 0 and change > gate.threshold:
            failures.append(
                f"{gate.metric} rose by {shown:.6g}{unit} (A={m.a:.6g}, B={m.b:.6g}); allowed rise {limit:.6g}{unit}"
            )
    return failures
