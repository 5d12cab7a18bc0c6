"""Reference models the tests check the package against (and bench times it against).

Written for clarity, not speed.

* ``lru_reference``: a bare OrderedDict LRU with cache-only replay's conventions
  (``kvtrace.replay.cache_only``): vLLM's free order, one block per trace id, the
  partial last block included.
* ``weighted_percentiles``: linear percentiles of multisets given as integer weights,
  the oracle of ``kvtrace.compare.bootstrap`` (it builds the (B, m) weight matrix the
  fast version avoids).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np


def lru_reference(keys: Sequence[Sequence[int]], capacity: int) -> tuple[list[int], int, int, int]:
    """Bare OrderedDict LRU with vLLM's free order: (hits per request, publishes,
    evictions, oversized). The benchmark's baseline and the tests' oracle."""
    free: OrderedDict[int, None] = OrderedDict()  # cached, unused; first = next victim
    unhashed = capacity  # never-used blocks (popped before any eviction)
    hits: list[int] = []
    publishes = evictions = oversized = 0
    for ks in keys:
        n = len(ks)
        hit = 0
        while hit < n and ks[hit] in free:
            hit += 1
        hits.append(hit)
        if n > capacity:
            oversized += 1
            continue
        for k in ks[:hit]:
            del free[k]  # touch: in use now
        need = n - hit
        take = min(need, unhashed)
        unhashed -= take
        for _ in range(need - take):
            free.popitem(last=False)
            evictions += 1
        # No key past the hit can still be cached: a child is always used with its parent
        # and freed before it, so LRU never evicts a parent before its children.
        publishes += need
        for k in reversed(ks):
            free[k] = None
    return hits, publishes, evictions, oversized


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
