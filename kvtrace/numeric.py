"""Arithmetic every floor shares: ceiling division and the one percentile definition.

Ground floor: imports nothing of kvtrace (and numpy only when a percentile is asked for,
so that an error path need not load it), so the cache, the engine, the span builder, the
store, ``compare`` and the dashboard all call the same two functions.

Percentiles follow ``vllm bench serve``: numpy's default ``method="linear"``
interpolation between the two nearest ranks (``np.percentile(values, q)``). One
definition, so that "TTFT p99" is the same number in a run summary, on a request span,
in ``kvtrace diff``, in the store's latency tables and on the dashboard.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


def cdiv(a: int, b: int) -> int:
    """Ceiling of ``a / b`` for ints (vLLM's ``cdiv``)."""
    return -(-a // b)


def percentile(values: Sequence[float] | np.ndarray, q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``values`` with linear interpolation, or None
    for no values. Equal to ``float(np.percentile(values, q))``."""
    if len(values) == 0:
        return None
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def percentiles(values: Sequence[float] | np.ndarray, qs: Sequence[float]) -> list[float | None]:
    """``[percentile(values, q) for q in qs]`` with one sort."""
    if len(values) == 0:
        return [None] * len(qs)
    import numpy as np

    out = np.percentile(np.asarray(values, dtype=np.float64), list(qs))
    return [float(v) for v in np.atleast_1d(out)]


def sorted_percentile(ordered: Sequence[float], q: float) -> float:
    """``percentile`` of an already sorted, non-empty sequence, without numpy's per-call
    cost (the span builder calls this once per request). Same definition, computed as
    numpy computes it: position ``(n - 1) * q / 100``, linear between its neighbours."""
    pos = (len(ordered) - 1) * (q / 100.0)  # numpy's virtual index for method="linear", same float ops
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    # float64 first, as numpy converts them: ints past 2^53 subtracted exactly gave another
    # last digit (a request span's ITL p50 of 35768945296019518 ns was numpy's + 2)
    a, b, t = float(ordered[lo]), float(ordered[hi]), pos - lo
    # numpy's lerp, to the last bit: from the nearer end
    return a + (b - a) * t if t < 0.5 else b - (b - a) * (1 - t)
