"""Requests and latency: per-request rows, inter-token gaps, the latency distributions
of ``kvtrace.metrics`` (TTFT, TPOT, ITL, E2EL, queue: samples, vllm bench serve's
statistics, percentiles, CDF, histogram; every percentile by ``kvtrace.numeric``), ITL
over time, and one request's waterfall. All from request spans (the waterfall also reads
its cache spans). Times are modelled (virtual) for replays."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import polars as pl

from kvtrace import metrics
from kvtrace.names import printable
from kvtrace.numeric import percentiles
from kvtrace.store import derived
from kvtrace.store.errors import StoreError
from kvtrace.store.read._api import BadArgument, checked
from kvtrace.store.read._sql import DB, Connection, open_run, query, with_run
from kvtrace.store.schema import COPY_REASON_EXTERNAL, SPAN_COW, SPAN_EVICT, SPAN_LOOKUP, SPAN_REQUEST

# A request's first token: its time, or (a sender's span that states its TTFT alone) its
# arrival plus that TTFT, which a collector holds equal where both are given (REQUEST_TTFT):
# its gaps had no token times, and ITL over time left out gaps the ITL statistics count
_FIRST_TOKEN = "coalesce(first_token_ns, coalesce(arrival_ns, start_ns) + ttft_ns)"
_REQUEST_COLUMNS = f"""
    request_id, session_id, coalesce(arrival_ns, start_ns) AS arrival_ns, first_scheduled_ns,
    {_FIRST_TOKEN} AS first_token_ns, end_ns AS finish_ns,
    first_scheduled_ns - coalesce(arrival_ns, start_ns) AS queue_ns,
    coalesce(ttft_ns, first_token_ns - coalesce(arrival_ns, start_ns)) AS ttft_ns,
    end_ns - coalesce(arrival_ns, start_ns) AS e2el_ns,
    num_prompt_tokens, num_output_tokens, num_hit_tokens AS num_local_hit_tokens,
    num_external_hit_tokens, num_computed_tokens, num_preemptions, num_divergent_tokens,
    itl_mean_ns, itl_p50_ns, itl_p99_ns, itl_max_ns"""


@checked
def requests(db: DB, run_id: str) -> pl.DataFrame:
    """One row per finished request, by arrival. Columns: request_id, session_id,
    arrival_ns, first_scheduled_ns, first_token_ns, finish_ns, queue_ns, ttft_ns, e2el_ns,
    num_prompt_tokens, num_output_tokens, num_local_hit_tokens, num_external_hit_tokens,
    num_computed_tokens, num_preemptions, num_divergent_tokens, itl_mean_ns, itl_p50_ns,
    itl_p99_ns, itl_max_ns."""
    return with_run(db, run_id, f"""
        SELECT {_REQUEST_COLUMNS} FROM request_spans
        WHERE run_id = $run_id AND name = '{SPAN_REQUEST}' ORDER BY arrival_ns, request_id""")


@checked
def request_extent(db: DB, run_id: str) -> tuple[int | None, int | None, int]:
    """(first arrival ns, last finish ns, finished requests) of a run, as ``requests`` reads
    them (None, None, 0 without any): the time a run's requests span, in one aggregate (the
    dashboard read the whole frame, 0.5 s at 424k requests, for these three numbers)."""
    frame = with_run(db, run_id, f"""
        SELECT min(coalesce(arrival_ns, start_ns)) AS lo, max(end_ns) AS hi, count(*) AS n FROM request_spans
        WHERE run_id = $run_id AND name = '{SPAN_REQUEST}'""")
    lo, hi, n = frame.row(0)
    return lo, hi, int(n)


@checked
def per_request_hits(db: DB, run_id: str) -> pl.DataFrame:
    """Per request (for diffs): columns request_id, num_prompt_tokens,
    num_local_hit_tokens, num_external_hit_tokens, num_cached_tokens (local + external at
    first schedule: vLLM's per-request num_cached_tokens), num_computed_tokens, ttft_ns."""
    frame = with_run(db, run_id, f"""
        SELECT request_id, num_prompt_tokens, coalesce(num_hit_tokens, 0) AS num_local_hit_tokens,
               coalesce(num_external_hit_tokens, 0) AS num_external_hit_tokens,
               coalesce(num_hit_tokens, 0) + coalesce(num_external_hit_tokens, 0) AS num_cached_tokens,
               num_computed_tokens,
               coalesce(ttft_ns, first_token_ns - coalesce(arrival_ns, start_ns)) AS ttft_ns
        FROM request_spans WHERE run_id = $run_id AND name = '{SPAN_REQUEST}' ORDER BY request_id""")
    # (as hit_counters refuses them: a request whose hits exceed its prompt, or are negative,
    # was set against the other run's as "gained" by diff, the store's damage unsaid)
    bad = frame.filter((pl.col("num_cached_tokens") > pl.col("num_prompt_tokens"))
                       | (pl.col("num_local_hit_tokens") < 0) | (pl.col("num_external_hit_tokens") < 0))
    if bad.height:
        row = bad.row(0, named=True)
        raise StoreError(str(db), f"damaged kvtrace store: run {run_id}'s request {printable(row['request_id'])} has "
                                  f"{row['num_local_hit_tokens']:,} local and {row['num_external_hit_tokens']:,} "
                                  f"external hit tokens of a {row['num_prompt_tokens']:,}-token prompt "
                                  f"({bad.height:,} such requests)")
    return frame


@checked
def itl_gaps(db: DB, run_id: str, request_id: str | None = None) -> pl.DataFrame:
    """Inter-token gaps exploded, of one request or all: columns request_id, index (1 =
    the gap after the first token), token_ns (time of the token that ends the gap), gap_ns."""
    return with_run(db, run_id, f"""
        WITH r AS (
            SELECT request_id, {_FIRST_TOKEN} AS first_token_ns, unnest(itl_ns) AS gap_ns,
                   unnest(range(1, len(itl_ns) + 1)) AS index
            FROM request_spans WHERE run_id = $run_id AND name = '{SPAN_REQUEST}'
              AND ($rid IS NULL OR request_id = $rid)
        )
        SELECT request_id, index,
               first_token_ns + sum(gap_ns) OVER (PARTITION BY request_id ORDER BY index) AS token_ns,
               gap_ns
        FROM r ORDER BY request_id, index""", params={"rid": request_id})


def _samples(con: Connection, run_id: str, metric: str) -> np.ndarray:
    return query(con, derived.latency_samples_sql(metric), {"run_id": run_id})["v"].to_numpy()


@checked
def latency_samples(db: DB, run_id: str, metric: str = "ttft") -> np.ndarray:
    """One latency's samples in ns (float64, sorted): ttft | tpot | itl (every gap) |
    e2el | queue, as ``kvtrace.metrics.LATENCIES`` defines them."""
    _check_metric(metric)
    with open_run(db, run_id) as (con, _):
        return _samples(con, run_id, metric)


@checked
def latency_stats(db: DB, run_id: str, metric: str = "ttft",
                  percentiles: Sequence[float] = metrics.DEFAULT_PERCENTILES) -> dict[str, float | None]:
    """``{mean_<metric>_ms, median_…, std_…, p<P>_…}`` (ms) from the samples, by
    ``kvtrace.metrics.latency_stats``: the numbers of the run summary and of vllm bench serve."""
    return metrics.latency_stats(latency_samples(db, run_id, metric), metric, percentiles)


@checked
def latency_summary(db: DB, run_id: str,
                    percentiles: Sequence[float] = metrics.DEFAULT_PERCENTILES) -> dict[str, float | None]:
    """Every latency statistic of every metric (the summary's latency fields)."""
    with open_run(db, run_id) as (con, _):
        samples = {m: _samples(con, run_id, m) for m in derived.LATENCY_VALUES}
    return metrics.latency_summary(samples, percentiles)


@checked
def latency_percentiles(
    db: DB, run_id: str, metric: str = "ttft", qs: Sequence[float] = metrics.DEFAULT_PERCENTILES
) -> dict[float, float]:
    """Percentiles (0..100) of one latency in ns, exact from its samples by
    ``kvtrace.numeric`` ({} without samples)."""
    values = latency_samples(db, run_id, metric)
    if values.size == 0:
        return {}
    return {q: float(v) for q, v in zip(qs, percentiles(values, list(qs)))}  # type: ignore[arg-type]


@checked
def latency_cdf(db: DB, run_id: str, metric: str = "ttft") -> pl.DataFrame:
    """The CDF of a latency: its percentiles at ``derived.CDF_PERCENTILES`` (q in 0..100,
    0.1 apart), each by kvtrace.numeric. Columns q, value_ns, n (samples). Empty when the
    run has no samples. Finished runs read the derived table; running runs compute it."""
    _check_metric(metric)
    with open_run(db, run_id, derived=True) as (con, status):
        if status == "running":
            table = derived.latency_cdf_table(run_id, {metric: _samples(con, run_id, metric)})
            frame = pl.from_arrow(table)
            assert isinstance(frame, pl.DataFrame)
            return frame.select("q", "value_ns", "n")
        return query(con, "SELECT q, value_ns, n FROM latency_cdf WHERE run_id = $run_id AND metric = $m "
                          "ORDER BY q", {"run_id": run_id, "m": metric})


@checked
def latency_histogram(db: DB, run_id: str, metric: str = "ttft", bins: int = 50) -> pl.DataFrame:
    """Linear-bin histogram of a latency (ns), counted exactly from its samples: columns
    bin_lo, bin_hi, count."""
    values = latency_samples(db, run_id, metric)
    if values.size == 0:
        return pl.DataFrame(schema={"bin_lo": pl.Float64, "bin_hi": pl.Float64, "count": pl.Int64})
    try:
        counts, edges = np.histogram(values, bins=max(1, int(bins)))
    except ValueError:  # (a range too narrow for its magnitude to split, latencies near 2^63: one bin)
        counts, edges = np.array([values.size]), np.array([float(values.min()), float(values.max())])
    return pl.DataFrame({"bin_lo": edges[:-1], "bin_hi": edges[1:], "count": counts.astype(np.int64)})


@checked
def itl_over_time(db: DB, run_id: str, window_ns: int | None = None,
                  qs: Sequence[float] = (50, 99)) -> pl.DataFrame:
    """Inter-token gaps per window of the time their token came out: columns
    window_start_ns, gaps, mean_itl_ns, p<Q>_itl_ns for each of ``qs`` (kvtrace.numeric
    over the window's gaps), max_itl_ns."""
    frame = with_run(db, run_id, f"""
        WITH r AS (
            SELECT request_id, {_FIRST_TOKEN} AS first_token_ns, unnest(itl_ns) AS gap_ns,
                   unnest(range(1, len(itl_ns) + 1)) AS index
            FROM request_spans WHERE run_id = $run_id AND name = '{SPAN_REQUEST}' AND {_FIRST_TOKEN} IS NOT NULL
        ),
        t AS (
            SELECT first_token_ns + sum(gap_ns) OVER (PARTITION BY request_id ORDER BY index) AS token_ns, gap_ns
            FROM r
        )
        -- (a NULL gap, which no kvtrace run holds, has no token time: int() of its NaN window failed)
        SELECT token_ns // $w * $w AS window_start_ns, CAST(gap_ns AS DOUBLE) AS gap_ns FROM t
        WHERE token_ns IS NOT NULL AND gap_ns IS NOT NULL
        ORDER BY window_start_ns, gap_ns""", window_ns=window_ns)
    names = [f"p{metrics.percentile_word(q)}_itl_ns" for q in qs]
    rows = []
    if frame.height:
        starts = frame["window_start_ns"].to_numpy()
        gaps = frame["gap_ns"].to_numpy()
        cut = np.flatnonzero(np.diff(starts)) + 1
        for lo, hi in zip(np.r_[0, cut], np.r_[cut, starts.size]):
            part = gaps[lo:hi]  # sorted by the query
            rows.append([int(starts[lo]), int(part.size), float(part.mean()),
                         *percentiles(part, list(qs)), float(part[-1])])
    schema = {"window_start_ns": pl.Int64, "gaps": pl.Int64, "mean_itl_ns": pl.Float64,
              **dict.fromkeys(names, pl.Float64), "max_itl_ns": pl.Float64}
    return pl.DataFrame(rows, schema=schema, orient="row")


def _check_metric(metric: str) -> None:
    if metric not in derived.LATENCY_VALUES:
        raise BadArgument("read", "metric", f"expected one of {sorted(derived.LATENCY_VALUES)}, got {metric!r}")


@checked
def request_span_count(db: DB, run_id: str, request_id: str) -> int:
    """How many spans of ``run_id`` name ``request_id`` (its request span, lookups, cache and
    verification spans): a request still in flight when its run stopped has no request span,
    and is no less in the run."""
    frame = with_run(db, run_id, "SELECT count(*) AS n FROM spans WHERE run_id = $run_id AND request_id = $rid",
                     params={"rid": request_id})
    return int(frame["n"][0])


@checked
def request_waterfall(db: DB, run_id: str, request_id: str) -> pl.DataFrame:
    """Segments of one request in time order: queue, prefill chunks, decode, and point
    marks for the cache lookup that admitted it (cache_hit, one per request), external-tier
    loads (load), CoW copies (cow) and the evictions it caused (evict). Columns: segment,
    start_ns, end_ns, num_tokens, detail."""
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
            SELECT 'decode', {_FIRST_TOKEN}, end_ns, num_output_tokens, NULL FROM req
            UNION ALL
            SELECT 'cache_hit', l.start_ns, l.end_ns, l.num_hit_tokens,
                   printf('%d/%d tokens hit at admission, %d external', coalesce(l.num_hit_tokens, 0),
                          coalesce(l.num_query_tokens, 0), coalesce(req.num_external_hit_tokens, 0))
                   || CASE WHEN l.before > 0 THEN printf(' (after %d lookups that could not allocate)', l.before)
                           ELSE '' END
            FROM (
                SELECT *, count(*) OVER (ORDER BY start_ns, seq ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)
                          AS before
                FROM r WHERE name = '{SPAN_LOOKUP}'
            ) AS l, req
            -- one mark per cache hit: the lookup that admitted the request (the first at or
            -- after its first schedule), not every lookup a waiting request repeated
            WHERE l.start_ns >= coalesce(req.first_scheduled_ns, req.start_ns)
            QUALIFY row_number() OVER (ORDER BY l.start_ns, l.seq) = 1
            UNION ALL
            -- (an external-tier load is a copy span, no copy-on-write: cow_copies leaves it out too)
            SELECT CASE WHEN copy_reason = '{COPY_REASON_EXTERNAL}' THEN 'load' ELSE 'cow' END, start_ns, end_ns, NULL,
                   printf('%s: %d -> %d', copy_reason, copy_src, copy_dst)
            FROM r WHERE name = '{SPAN_COW}'
            UNION ALL
            SELECT 'evict', start_ns, end_ns, len(block_ids), printf('%s: %d blocks', evict_reason, len(block_ids))
            FROM r WHERE name = '{SPAN_EVICT}'
        )
        -- (a collected request span may lack a time: its segment has no extent to show)
        SELECT * FROM segs
        WHERE start_ns IS NOT NULL AND (end_ns IS NOT NULL OR segment IN ('cache_hit', 'load', 'cow', 'evict'))
        ORDER BY start_ns, list_position(['queue', 'cache_hit', 'load', 'prefill', 'cow', 'evict', 'decode'],
                                         segment)""",
                    params={"rid": request_id})
