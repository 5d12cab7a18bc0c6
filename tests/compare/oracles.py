"""Reference versions that the fast code in kvtrace.compare is tested against.

Written for clarity, not speed: they build what the fast versions avoid (the full
(B, m) weight matrix and its running sums).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def weighted_percentiles(sorted_values: np.ndarray, weights: np.ndarray, percentiles: Sequence[float]) -> np.ndarray:
    """Linear (numpy default) percentiles of multisets given as integer weights.

    sorted_values: (m,) ascending; weights: (B, m) non-negative ints, one multiset per row
    (value i occurs weights[b, i] times). Returns (B, len(percentiles)); NaN for an empty
    multiset. With N items the percentile q sits at position (N - 1) * q / 100, between
    the items of ranks lo = floor(position) and lo + 1 (clipped to N - 1); the item of
    rank r is the first value whose cumulative weight exceeds r.
    """
    weights = np.asarray(weights, dtype=np.int64)
    n_rows, m = weights.shape
    out = np.full((n_rows, len(percentiles)), np.nan)
    if m == 0 or n_rows == 0:
        return out
    cw = np.cumsum(weights, axis=1)
    for row in range(n_rows):
        total = int(cw[row, -1])
        if total == 0:
            continue
        for i, q in enumerate(percentiles):
            pos = (total - 1) * (q / 100)
            lo = int(np.floor(pos))
            hi = min(lo + 1, total - 1)
            a = sorted_values[np.searchsorted(cw[row], lo, side="right")]
            b = sorted_values[np.searchsorted(cw[row], hi, side="right")]
            t = pos - lo
            # numpy's rounding: interpolate from the nearer neighbour.
            out[row, i] = b - (b - a) * (1 - t) if t >= 0.5 else a + (b - a) * t
    return out
