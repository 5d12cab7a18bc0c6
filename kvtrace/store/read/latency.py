"""Requests and latency: per-request rows, inter-token gaps, TTFT/E2E/queue/ITL
distributions (exact quantile grid, percentiles, histogram), ITL over time, and one
request's waterfall. All from request spans (the waterfall also reads its cache spans)."""

from __future__ import annotations

import bisect
from itertools import pairwise

import polars as pl

from kvtrace.store import derived
from kvtrace.store.read._sql import DB, open_run, query, with_run
from kvtrace.store.schema import SPAN_COW, SPAN_EVICT, SPAN_LOOKUP, SPAN_REQUEST

QUANTILE_GRID = derived.QUANTILE_GRID  # latency_cdf's q steps are 1 / QUANTILE_GRID

_REQUEST_COLUMNS = """
    request_id, session_id, coalesce(arrival_ns, start_ns) AS arrival_ns, first_scheduled_ns,
    first_token_ns, end_ns AS finish_ns,
    first_scheduled_ns - coalesce(arrival_ns, start_ns) AS queue_ns,
    coalesce(ttft_ns, first_token_ns - coalesce(arrival_ns, start_ns)) AS ttft_ns,
    end_ns - coalesce(arrival_ns, start_ns) AS e2e_ns,
    num_prompt_tokens, num_output_tokens, num_hit_tokens AS num_local_hit_tokens,
    num_external_hit_tokens, num_computed_tokens, num_preemptions, num_divergent_tokens,
    itl_mean_ns, itl_p50_ns, itl_p99_ns, itl_max_ns"""


def requests(db: DB, run_id: str) -> pl.DataFrame:
    """One row per finished request, by arrival. Columns: request_id, session_id,
    arrival_ns, first_scheduled_ns, first_token_ns, finish_ns, queue_ns, ttft_ns, e2e_ns,
    num_prompt_tokens, num_output_tokens, num_local_hit_tokens, num_external_hit_tokens,
    num_computed_tokens, num_preemptions, num_divergent_tokens, itl_mean_ns, itl_p50_ns,
    itl_p99_ns, itl_max_ns."""
    return with_run(db, run_id, f"""
        SELECT {_REQUEST_COLUMNS} FROM request_spans
        WHERE run_id = $run_id AND name = '{SPAN_REQUEST}' ORDER BY arrival_ns, request_id""")


def per_request_hits(db: DB, run_id: str) -> pl.DataFrame:
    """Per request (for diffs): columns request_id, num_prompt_tokens,
    num_local_hit_tokens, num_external_hit_tokens, num_hit_tokens (local + external),
    num_computed_tokens, ttft_ns."""
    return with_run(db, run_id, f"""
        SELECT request_id, num_prompt_tokens, coalesce(num_hit_tokens, 0) AS num_local_hit_tokens,
               coalesce(num_external_hit_tokens, 0) AS num_external_hit_tokens,
               coalesce(num_hit_tokens, 0) + coalesce(num_external_hit_tokens, 0) AS num_hit_tokens,
               num_computed_tokens,
               coalesce(ttft_ns, first_token_ns - coalesce(arrival_ns, start_ns)) AS ttft_ns
        FROM request_spans WHERE run_id = $run_id AND name = '{SPAN_REQUEST}' ORDER BY request_id""")


def itl_gaps(db: DB, run_id: str, request_id: str | None = None) -> pl.DataFrame:
    """Inter-token gaps exploded, of one request or all: columns request_id, index (1 =
    the gap after the first token), token_ns (time of the token that ends the gap), gap_ns."""
    return with_run(db, run_id, f"""
        WITH r AS (
            SELECT request_id, first_token_ns, unnest(itl_ns) AS gap_ns,
                   unnest(range(1, len(itl_ns) + 1)) AS index
            FROM request_spans WHERE run_id = $run_id AND name = '{SPAN_REQUEST}'
              AND ($rid IS NULL OR request_id = $rid)
        )
        SELECT request_id, index,
               first_token_ns + sum(gap_ns) OVER (PARTITION BY request_id ORDER BY index) AS token_ns,
               gap_ns
        FROM r ORDER BY request_id, index""", params={"rid": request_id})


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    """Piecewise-linear y(x) through sorted xs (clamped at the ends), like numpy.interp."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 if x1 == x0 else y0 + (x - x0) * (y1 - y0) / (x1 - x0)


def latency_cdf(db: DB, run_id: str, metric: str = "ttft") -> pl.DataFrame:
    """Exact quantiles (quantile_cont) of a latency (ttft | e2e | queue | itl over every
    gap) on a fixed grid: columns q (0..1 in 1/QUANTILE_GRID steps), value_ns, n (samples).
    Empty when the run has no samples."""
    if metric not in derived.LATENCY_VALUES:
        raise ValueError(f"metric must be one of {sorted(derived.LATENCY_VALUES)}, not {metric!r}")
    with open_run(db, run_id) as (con, status):
        if status == "running":  # the grid finish_run would store, computed now
            return query(con, f"SELECT q, value_ns, n FROM {derived.quantile_grid_sql(metric)} ORDER BY q",
                         {"run_id": run_id})
        return query(con, "SELECT q, value_ns, n FROM latency_quantiles WHERE run_id = $run_id AND metric = $m "
                          "ORDER BY q", {"run_id": run_id, "m": metric})


def latency_percentiles(
    db: DB, run_id: str, metric: str = "ttft", qs: tuple[float, ...] = (0.5, 0.9, 0.99)
) -> dict[float, float]:
    """Percentiles of one latency metric in ns ({} without samples): exact quantile_cont at
    multiples of 1/QUANTILE_GRID (0.5, 0.9, 0.99 ...), linear between grid points."""
    cdf = latency_cdf(db, run_id, metric)
    if cdf.height == 0:
        return {}
    grid_q, grid_v = cdf["q"].to_list(), cdf["value_ns"].to_list()
    return {q: float(_interp(q, grid_q, grid_v)) for q in qs}


def latency_histogram(db: DB, run_id: str, metric: str = "ttft", bins: int = 50) -> pl.DataFrame:
    """Linear-bin histogram of a latency (ns) from its quantile grid: columns bin_lo,
    bin_hi, count (samples per bin, interpolated within each 1/QUANTILE_GRID slice, so
    fractional)."""
    bins = max(1, int(bins))
    cdf = latency_cdf(db, run_id, metric)
    if cdf.height == 0:
        return pl.DataFrame(schema={"bin_lo": pl.Float64, "bin_hi": pl.Float64, "count": pl.Float64})
    grid_q, grid_v, n = cdf["q"].to_list(), cdf["value_ns"].to_list(), int(cdf["n"][0])
    lo, hi = grid_v[0], grid_v[-1]
    width = (hi - lo) / bins if hi > lo else 1.0 / bins
    edges = [lo + i * width for i in range(bins + 1)]
    # the CDF at each edge: invert the monotone quantile function (last point of a tie run)
    mass = []
    for e in edges:
        j = bisect.bisect_right(grid_v, e)
        mass.append(1.0 if j >= len(grid_v) else (0.0 if j == 0 else
                    _interp(e, grid_v[j - 1:j + 1], grid_q[j - 1:j + 1])))
    mass[-1] = 1.0
    counts = [(b - a) * n for a, b in pairwise(mass)]
    return pl.DataFrame({"bin_lo": edges[:-1], "bin_hi": edges[1:], "count": counts})


def itl_over_time(db: DB, run_id: str, window_ns: int | None = None) -> pl.DataFrame:
    """Per window of first-token time: columns window_start_ns, requests, mean_itl_ns
    (gap-weighted), p50_itl_ns (median of the requests' p50), max_p99_itl_ns, max_itl_ns."""
    return with_run(db, run_id, f"""
        SELECT first_token_ns // $w * $w AS window_start_ns, count(*) AS requests,
               sum(itl_mean_ns * len(itl_ns)) / nullif(sum(len(itl_ns)), 0) AS mean_itl_ns,
               median(itl_p50_ns) AS p50_itl_ns, max(itl_p99_ns) AS max_p99_itl_ns,
               max(itl_max_ns) AS max_itl_ns
        FROM request_spans WHERE run_id = $run_id AND name = '{SPAN_REQUEST}' AND first_token_ns IS NOT NULL
        GROUP BY ALL ORDER BY window_start_ns""", window_ns=window_ns)


def request_waterfall(db: DB, run_id: str, request_id: str) -> pl.DataFrame:
    """Segments of one request in time order: queue, prefill chunks, decode, and point
    marks for its cache lookups (cache_hit), CoW copies (cow) and the evictions it caused
    (evict). Columns: segment, start_ns, end_ns, num_tokens, detail."""
    return with_run(db, run_id, f"""
        WITH r AS (
            SELECT * FROM spans WHERE run_id = $run_id AND request_id = $rid
        ),
        req AS (SELECT * FROM r WHERE name = '{SPAN_REQUEST}'),
        segs AS (
            SELECT 'queue' AS segment, coalesce(arrival_ns, start_ns) AS start_ns,
                   first_scheduled_ns AS end_ns, NULL::BIGINT AS num_tokens, NULL AS detail FROM req
            UNION ALL
            SELECT 'prefill', c.start_ns, c.end_ns, c.num_tokens, NULL
            FROM (SELECT unnest(prefill_chunks) AS c FROM req)
            UNION ALL
            SELECT 'decode', first_token_ns, end_ns, num_output_tokens, NULL FROM req
            UNION ALL
            SELECT 'cache_hit', start_ns, end_ns, num_hit_tokens,
                   printf('%d/%d tokens hit, %d external', coalesce(num_hit_tokens, 0),
                          coalesce(num_query_tokens, 0), coalesce(num_external_hit_tokens, 0))
            FROM r WHERE name = '{SPAN_LOOKUP}'
            UNION ALL
            SELECT 'cow', start_ns, end_ns, NULL, printf('%s: %d -> %d', copy_reason, copy_src, copy_dst)
            FROM r WHERE name = '{SPAN_COW}'
            UNION ALL
            SELECT 'evict', start_ns, end_ns, len(block_ids), printf('%s: %d blocks', evict_reason, len(block_ids))
            FROM r WHERE name = '{SPAN_EVICT}'
        )
        SELECT * FROM segs
        ORDER BY start_ns, list_position(['queue', 'cache_hit', 'prefill', 'cow', 'evict', 'decode'], segment)""",
                    params={"rid": request_id})
