"""TTFT/ITL percentile shifts with confidence intervals from a seeded request-level bootstrap.

Conventions
- Percentiles are ``kvtrace.numeric``'s, the one definition (numpy's linear interpolation,
  as ``vllm bench serve``): the point estimates call it, and every bootstrap replicate
  applies the same definition to its resampled multiset.
- The unit resampled is the *request*: a replicate draws the run's n requests with
  replacement, and every observation of a drawn request (its TTFT, each of its ITL gaps)
  counts as often as the request was drawn.
- Paired when both runs hold the same request ids (the same trace): one draw of requests
  is applied to both runs, so the interval reflects the change, not the spread of the
  workload. Otherwise each run is resampled on its own.
- The CI is the percentile bootstrap of the replicate deltas B - A at ``CI_LEVEL``.
  The generator is PCG64 seeded with ``seed``: the same seed gives the same intervals.
- No CI (NaN, and ``no_ci`` names it) where the bootstrap cannot give one near its level:
  fewer than ``MIN_REQUESTS`` requests with the latency in a run, or fewer than ``MIN_TAIL``
  observations of a run beyond the percentile on either side (``ci_estimable``). Measured
  (seeded simulations, 300-400 replications, gamma TTFTs, paired and unpaired): with 1-2
  requests the paired interval is one point at the observed delta; the 95% interval of a
  p99 covered the true shift 22% of the time with 30 requests, 68-79% with 100, 82-89% with
  300 (2-3 observations beyond it), 96% with 600 (6); a p90 with 20 requests 82-91%; every
  percentile with 5-6 or more observations beyond it 93-100%.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import polars as pl

from kvtrace.compare.model import PercentileShift, check_argument, check_whole
from kvtrace.compare.options import DEFAULT_RESAMPLES, MAX_RESAMPLES
from kvtrace.errors import MAX_SEED, ConfigError
from kvtrace.metrics import DEFAULT_PERCENTILES
from kvtrace.names import shown_value
from kvtrace.numeric import percentiles as point_percentiles

PERCENTILES = DEFAULT_PERCENTILES  # vllm bench serve's --metric-percentiles, here 50,90,99
LATENCY_METRICS = ("ttft_ms", "itl_ms")
CI_LEVEL = 0.95
MIN_REQUESTS = 10  # requests with the latency, per run, for any CI
MIN_TAIL = 5  # observations of each run beyond the percentile, on both sides


def ci_estimable(requests: int, observations: int, q: float) -> bool:
    """Whether a run of ``requests`` requests holding ``observations`` values supports a
    bootstrap CI of its ``q``-th percentile: at least MIN_REQUESTS requests, and at least
    MIN_TAIL observations below and above the percentile's position ``(m - 1) q / 100``
    (never at 0 or 100: the bootstrap of a minimum or maximum has no such interval)."""
    return requests >= MIN_REQUESTS and (observations - 1) * min(q, 100 - q) / 100 >= MIN_TAIL


def ci_note(names: Sequence[str]) -> str | None:
    """The diff's note for the shifts without a CI (None when every one has its CI)."""
    if not names:
        return None
    return (f"no {round(CI_LEVEL * 100)}% CI for {', '.join(names)}: too few requests or observations for a "
            f"bootstrap interval (each run needs {MIN_REQUESTS} requests with the latency and {MIN_TAIL} "
            "observations beyond the percentile on each side); the point estimates stand")


def resample_counts(rng: np.random.Generator, n_requests: int, resamples: int) -> np.ndarray:
    """(resamples, n_requests) int32: how often each request is drawn in each replicate
    (every row sums to n_requests).

    Drawn a block of replicates at a time (the same stream as one draw of them all): the
    draws and their counts as int64 for every replicate at once were 20 bytes a request a
    resample at their peak (a 50,000-request diff: 1 GB; at --resamples 10,000, 10 GB)."""
    check_argument("rng", rng, np.random.Generator, "a numpy Generator (np.random.default_rng(seed))")
    n_requests = check_whole("n_requests", n_requests, 0, 2**31 - 1)
    resamples = check_whole("resamples", resamples, 0, MAX_RESAMPLES)
    out = np.zeros((resamples, n_requests), dtype=np.int32)
    if n_requests == 0:
        return out
    rows = max(1, _DRAW_BLOCK // n_requests)
    for start in range(0, resamples, rows):
        k = min(rows, resamples - start)
        draws = rng.integers(0, n_requests, size=(k, n_requests), dtype=np.int64)
        draws += (np.arange(k, dtype=np.int64) * n_requests)[:, None]
        out[start:start + k] = np.bincount(draws.ravel(), minlength=k * n_requests).reshape(k, n_requests)
    return out


_DRAW_BLOCK = 1 << 22  # draws made at once (32 MB of int64)


def resample_count_blocks(rng: np.random.Generator, n_requests: int, resamples: int) -> Iterator[np.ndarray]:
    """``resample_counts(rng, n_requests, resamples)``'s rows, a block of replicates at a time
    (at most ``_COUNTS_BLOCK`` counts each): the same stream, in bounded memory. The counts
    of every replicate at once, and the copies the percentiles made of them, grew with
    requests x resamples (an unpaired diff of 100,000 requests peaked at 1.7 GB at the
    default 1,000 resamples, about 17 GB at --resamples 10,000)."""
    rows = max(1, _COUNTS_BLOCK // max(n_requests, 1))
    for start in range(0, resamples, rows):
        yield resample_counts(rng, n_requests, min(rows, resamples - start))


_COUNTS_BLOCK = 1 << 24  # resample counts held at once (64 MB of int32; the percentiles copy them twice)


def chunked_weighted_percentiles(
    sorted_values: np.ndarray,
    owner: np.ndarray,
    counts: np.ndarray,
    percentiles: Sequence[float],
    chunks: int | None = None,
) -> np.ndarray:
    """Linear percentiles of B multisets, without building their (B, m) weight matrix.

    Observation ``i`` (``sorted_values`` ascending, ``owner[i]`` its request) occurs
    ``counts[b, owner[i]]`` times in multiset ``b``. Returns (B, len(percentiles)), each
    value equal to ``np.percentile`` of the expanded multiset (NaN for an empty one): with
    N items, position ``(N - 1) * q / 100`` between the items of ranks ``lo = floor`` and
    ``lo + 1``, interpolated as numpy does.

    Exact and fast when m (every ITL gap) is large: the sorted observations are cut into
    ``chunks`` runs of positions. One matrix product, counts (B, n) @ per-request chunk
    histogram (n, K), gives every replicate's weight per chunk; the chunk holding each
    wanted rank is found on those totals, and only inside that chunk are the individual
    weights expanded, once for both ranks. The default K balances the product (B n K)
    against the expansion (B P m / K). Measured on 4000 requests x 150 gaps, 1000
    resamples, both runs: 0.65x the time of the nearest-rank version it replaced, which
    took about 1 s.
    """
    counts = np.asarray(counts)
    n_rep, n = counts.shape
    m = sorted_values.size
    p = len(percentiles)
    out = np.full((n_rep, p), np.nan)
    if m == 0 or n_rep == 0 or p == 0:
        return out
    if chunks is None:
        chunks = int(np.sqrt(_EXPAND_COST * p * m / max(n, 1))) + 1
    size = -(-m // min(max(chunks, 1), m))  # positions per chunk
    k = -(-m // size)
    hist = np.bincount(owner * k + np.arange(m) // size, minlength=n * k).reshape(n, k)
    # Integer sums through BLAS: exact while each chunk's weight stays below 2**24 (float32)
    # or 2**53 (float64).
    heaviest = size * max(int(counts.max(initial=0)), 1)
    dtype = np.float32 if heaviest < 2**24 else np.float64
    cum = np.cumsum(np.rint(counts.astype(dtype) @ hist.astype(dtype)).astype(np.int64), axis=1)  # (B, K)
    total = cum[:, -1]
    last = np.maximum(total - 1, 0)[:, None]
    pos = last * (np.asarray(percentiles, dtype=np.float64) / 100)[None, :]
    lo = np.floor(pos)
    gamma = pos - lo
    rank_lo = lo.astype(np.int64).ravel()
    rank_hi = np.minimum(rank_lo + 1, np.broadcast_to(last, pos.shape).ravel())
    rows = np.repeat(np.arange(n_rep), p)
    chunk_owner = np.full(k * size, n, dtype=np.intp)  # padded with request n, whose count is 0
    chunk_owner[:m] = owner
    padded = np.zeros((n_rep, n + 1), dtype=np.int32 if heaviest < 2**31 else np.int64)
    padded[:, :n] = counts
    # Rank lo + 1 almost always lies in the chunk of rank lo: one expansion finds both;
    # the few that lie further on get a second one.
    table = (cum, chunk_owner.reshape(k, size), padded)
    at_lo, at_hi = _positions(*table, rows, rank_lo, rank_hi)
    beyond = at_hi < 0
    if beyond.any():
        at_hi[beyond] = _positions(*table, rows[beyond], rank_hi[beyond])[0]
    a = sorted_values[np.minimum(at_lo, m - 1)].reshape(n_rep, p)
    b = sorted_values[np.minimum(at_hi, m - 1)].reshape(n_rep, p)
    value = _lerp(a, b, gamma)
    ok = total > 0
    out[ok] = value[ok]
    return out


# The expansion's cost per weight relative to the product's per multiply-add (measured,
# numpy + OpenBLAS): sets the default chunk count sqrt(cost * P * m / n).
_EXPAND_COST = 300
_BLOCK = 1 << 22  # weights expanded at once: bounds the memory (~32 MB a temporary)


def _positions(
    cum: np.ndarray,
    chunk_owner: np.ndarray,
    counts: np.ndarray,
    rows: np.ndarray,
    rank: np.ndarray,
    rank_next: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted positions of 0-based rank ``rank[e]`` in multiset ``rows[e]``, and of
    ``rank_next[e]`` where it lies in the same chunk (-1 where it does not).

    cum: (B, K) cumulative weight per chunk; chunk_owner: (K, size) the owning request of
    each position (padding: a request whose count is 0); counts: (B, n + 1).
    """
    size = chunk_owner.shape[1]
    at = np.empty(rows.size, dtype=np.int64)
    at_next = np.full(rows.size, -1, dtype=np.int64)
    step = max(1, _BLOCK // size)
    for s in range(0, rows.size, step):
        r, q = rows[s : s + step], rank[s : s + step]
        c = cum[r]
        j = np.minimum((c <= q[:, None]).sum(axis=1), c.shape[1] - 1)  # the chunk holding the rank
        before = np.where(j > 0, c[np.arange(r.size), np.maximum(j - 1, 0)], 0)
        run = np.cumsum(counts[r[:, None], chunk_owner[j]], axis=1, dtype=counts.dtype)  # (E, size)
        at[s : s + step] = j * size + (run <= (q - before)[:, None]).sum(axis=1)
        if rank_next is not None:
            qn = rank_next[s : s + step]
            inside = qn < before + run[:, -1]
            at_next[s : s + step] = np.where(inside, j * size + (run <= (qn - before)[:, None]).sum(axis=1), -1)
    return at, at_next


def _lerp(a: np.ndarray, b: np.ndarray, t: np.ndarray) -> np.ndarray:
    """numpy's interpolation between neighbours, rounding included (from the nearer side)."""
    d = b - a
    return np.where(t >= 0.5, b - d * (1 - t), a + d * t)


def percentile_shifts(
    a_owner: np.ndarray,
    a_values: np.ndarray,
    b_owner: np.ndarray,
    b_values: np.ndarray,
    *,
    metric: str,
    counts: tuple[np.ndarray, np.ndarray],
    percentiles: Sequence[float] = PERCENTILES,
    per_unit: float = 1.0,
) -> list[PercentileShift]:
    """Percentile shifts B - A with bootstrap CIs, given per-request resample counts.

    x_values: one per observation (TTFT: one per request, ITL: one per gap); x_owner: the
    index of the owning request in that run's request universe. counts: (B, n_requests)
    resample counts for A and for B (the same array when paired). A point estimate is
    NaN when its run has no observation; the CI is NaN when either run has none. Every
    figure is divided by ``per_unit`` after the percentiles are taken (ns values, ms
    figures: as the run summary's, to the last bit).
    """
    counts_a, counts_b = counts
    ok = _estimable(a_owner, a_values, b_owner, b_values, percentiles)
    qs = [percentiles[i] for i in ok]
    replicates = None
    if ok:
        replicates = (_boot_percentiles(a_owner, a_values, counts_a, qs),
                      _boot_percentiles(b_owner, b_values, counts_b, qs))
    return _shifts(metric, a_values, b_values, percentiles, ok, replicates, per_unit)


def _estimable(a_owner: np.ndarray, a_values: np.ndarray, b_owner: np.ndarray, b_values: np.ndarray,
               percentiles: Sequence[float]) -> list[int]:
    """The indices of ``percentiles`` whose CI both runs support (``ci_estimable``)."""
    requests_a, requests_b = np.unique(a_owner).size, np.unique(b_owner).size
    return [i for i, q in enumerate(percentiles)
            if ci_estimable(requests_a, a_values.size, q) and ci_estimable(requests_b, b_values.size, q)]


def _shifts(metric: str, a_values: np.ndarray, b_values: np.ndarray, percentiles: Sequence[float], ok: list[int],
            replicates: tuple[np.ndarray, np.ndarray] | None, per_unit: float) -> list[PercentileShift]:
    """The shifts of one metric, given the (B, len(ok)) replicate percentiles of A and B
    at the estimable percentiles ``ok`` (None when there are none)."""
    point_a = _nan_for_none(point_percentiles(a_values, percentiles)) / per_unit
    point_b = _nan_for_none(point_percentiles(b_values, percentiles)) / per_unit
    ci_low, ci_high = np.full(len(percentiles), np.nan), np.full(len(percentiles), np.nan)
    if ok and replicates is not None:
        rep_a, rep_b = replicates
        deltas = rep_b / per_unit - rep_a / per_unit
        alpha = (1 - CI_LEVEL) / 2
        if not np.all(np.isnan(deltas)):
            with np.errstate(all="ignore"):
                ci_low[ok] = np.nanquantile(deltas, alpha, axis=0)
                ci_high[ok] = np.nanquantile(deltas, 1 - alpha, axis=0)
    return [
        PercentileShift(metric, float(p), float(pa), float(pb), float(pb - pa), float(lo), float(hi))
        for p, pa, pb, lo, hi in zip(percentiles, point_a, point_b, ci_low, ci_high)
    ]


def _nan_for_none(values: list[float | None]) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], dtype=np.float64)


def _boot_percentiles(
    owner: np.ndarray, values: np.ndarray, counts: np.ndarray, percentiles: Sequence[float]
) -> np.ndarray:
    """(B, P) replicate percentiles of the observations owned by resampled requests."""
    return chunked_weighted_percentiles(*_sorted(owner, values), counts, percentiles)


def _sorted(owner: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The observations ascending (as float64) and their owners. Any order among equal
    values gives the same percentiles, so the sort need not be stable."""
    order = np.argsort(values)
    return values[order].astype(np.float64), owner[order]


def _request_universe(frames: dict[str, pl.DataFrame]) -> pl.DataFrame:
    """Sorted distinct request ids of a run, with their index: the bootstrap's unit."""
    ids = [f.select(pl.col("request_id").cast(pl.Utf8)) for f in frames.values()]
    if not ids:
        return pl.DataFrame(schema={"request_id": pl.Utf8, "owner": pl.UInt32})
    return pl.concat(ids).unique().sort("request_id").with_row_index("owner")


def _owned_values(frame: pl.DataFrame, metric: str, universe: pl.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    f = frame.select(pl.col("request_id").cast(pl.Utf8), pl.col(metric).cast(pl.Float64)).drop_nulls()
    f = f.join(universe, on="request_id", how="left", maintain_order="left")
    return f["owner"].to_numpy().astype(np.int64), f[metric].to_numpy()


def _check_latency_frames(**given: Any) -> None:
    """ConfigError naming the argument for latency frames that are no dict of polars frames
    (or None) with request_id and the metric's column (an AttributeError inside before)."""
    for name, frames in given.items():
        check_argument(name, frames, Mapping, "a dict of latency frames by metric ('ttft_ms', 'itl_ms')")
        for metric, frame in frames.items():
            if frame is None:
                continue
            check_argument(f"{name}[{shown_value(metric)}]", frame, pl.DataFrame, "a polars DataFrame or None")
            if metric in LATENCY_METRICS and not {"request_id", metric} <= set(frame.columns):
                raise ConfigError(f"{name}[{shown_value(metric)}]", shown_value(frame.columns),
                                  f"expected columns request_id, {metric}")


def latency_shifts(
    latency_a: dict[str, pl.DataFrame],
    latency_b: dict[str, pl.DataFrame],
    *,
    seed: int = 0,
    resamples: int = DEFAULT_RESAMPLES,
    percentiles: Sequence[float] = PERCENTILES,
    per_unit: float = 1.0,
    pair: bool = True,
) -> tuple[list[PercentileShift], dict[str, Any]]:
    """TTFT/ITL percentile shifts and the bootstrap's settings (seed, resamples, paired,
    requests_a, requests_b) and ``no_ci``, the shifts without a CI (``ci_estimable``).
    ``per_unit``: the metric columns' values per reported unit (1e6 for ns columns reported
    in ms, as ``kvtrace.metrics`` reports them).

    latency_x maps 'ttft_ms' / 'itl_ms' to frames with columns request_id and the metric
    (one row per request for TTFT, one per inter-token gap for ITL). The request universe
    of each run is the union of request ids over both metrics. A metric missing from
    either run, or without observations in both, is left out. ``pair=False``: the runs'
    ids do not name the same requests (never paired, whatever ids they share).
    """
    _check_latency_frames(latency_a=latency_a, latency_b=latency_b)
    seed = check_whole("seed", seed, 0, MAX_SEED)
    resamples = check_whole("resamples", resamples, 1, MAX_RESAMPLES)
    from kvtrace.replay.run import check_percentiles  # (the CLI's reading of them: --percentiles)

    percentiles = check_percentiles(percentiles)
    unit = float(per_unit) if isinstance(per_unit, (float, np.floating)) else \
        int(per_unit) if isinstance(per_unit, (int, np.integer)) and not isinstance(per_unit, bool) else math.nan
    if not 0 < unit < 1e300:  # (NaN, a str, an int past float's range: an OverflowError in the division)
        raise ConfigError("per_unit", shown_value(per_unit), "expected a finite number above 0")
    per_unit = float(unit)
    check_argument("pair", pair, bool, "True or False")
    rng = np.random.Generator(np.random.PCG64(seed))
    frames_a = {k: v for k, v in latency_a.items() if v is not None}
    frames_b = {k: v for k, v in latency_b.items() if v is not None}
    ua, ub = _request_universe(frames_a), _request_universe(frames_b)
    paired = pair and ua.equals(ub)
    measured = []  # (metric, A's owners and values, B's, the estimable percentiles)
    for metric in LATENCY_METRICS:
        if metric not in frames_a or metric not in frames_b:
            continue
        oa, va = _owned_values(frames_a[metric], metric, ua)
        ob, vb = _owned_values(frames_b[metric], metric, ub)
        if va.size == 0 or vb.size == 0:
            continue  # a run without this latency (cache-only: no clock) is set against nothing
        measured.append((metric, (oa, va), (ob, vb), _estimable(oa, va, ob, vb, percentiles)))
    # The replicates' percentiles, a block of replicates at a time, from the one stream of
    # resample counts (A's draws, then B's unless paired) that resample_counts draws whole.
    wanted = [(m, [percentiles[i] for i in ok], _sorted(*a), _sorted(*b)) for m, a, b, ok in measured if ok]
    reps: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {m: ([], []) for m, *_ in wanted}
    if wanted:
        for block in resample_count_blocks(rng, ua.height, resamples):
            for m, qs, a, b in wanted:
                reps[m][0].append(chunked_weighted_percentiles(*a, block, qs))
                if paired:
                    reps[m][1].append(chunked_weighted_percentiles(*b, block, qs))
        if not paired:
            for block in resample_count_blocks(rng, ub.height, resamples):
                for m, qs, _, b in wanted:
                    reps[m][1].append(chunked_weighted_percentiles(*b, block, qs))
    shifts: list[PercentileShift] = []
    for metric, (_, va), (_, vb), ok in measured:
        drawn = reps.get(metric)
        replicates = (np.concatenate(drawn[0]), np.concatenate(drawn[1])) if drawn and drawn[0] else None
        shifts += _shifts(metric, va, vb, percentiles, ok, replicates, per_unit)
    info = {"seed": seed, "resamples": resamples, "paired": paired, "requests_a": ua.height, "requests_b": ub.height,
            "no_ci": [s.name for s in shifts if np.isnan(s.ci_low)]}
    return shifts, info
