"""Read API: polars frames for the dashboard, notebooks and CLI.

Every function takes the database path first and opens a short-lived read-only
connection (retrying while a writer commits), so it works on a store a replay is writing.
User values reach SQL only as bound parameters. Times are integer nanoseconds (virtual
for replays); ``window_ns=None`` picks a window giving about ``DEFAULT_WINDOWS`` windows
over the run. Finished runs read materialised derived tables; running runs compute the
same SQL on the fly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import polars as pl

from kvtrace.store import derived
from kvtrace.store.connection import fetch_one, read_connection
from kvtrace.store.errors import UnknownRunError
from kvtrace.store.liveness import writer_alive
from kvtrace.store.schema import (
    SPAN_COW,
    SPAN_DIVERGENT,
    SPAN_EVICT,
    SPAN_LOOKUP,
    SPAN_PUBLISH,
    SPAN_REQUEST,
    SPAN_STALE_HASH,
    SPAN_STALE_LEFT,
    SPAN_STEP,
)

DB = str | Path
DEFAULT_WINDOWS = 200
OVERALL_GROUP = -1  # group_id of the all-groups series in hit_rate_over_time
QUANTILE_GRID = 1000  # latency quantiles are computed on q = i / QUANTILE_GRID


def _tidy(frame: pl.DataFrame) -> pl.DataFrame:
    """DuckDB sums BIGINTs into HUGEINT (polars Decimal(38, 0)); hand back plain Int64."""
    casts = [
        pl.col(name).cast(pl.Int64)
        for name, dtype in frame.schema.items()
        if isinstance(dtype, pl.Decimal) and dtype.scale == 0
    ]
    return frame.with_columns(casts) if casts else frame


def _pl(con, sql: str, params: dict[str, Any]) -> pl.DataFrame:
    return _tidy(con.sql(sql, params=params).pl())


def _nice_window(span_ns: int, windows: int = DEFAULT_WINDOWS) -> int:
    """A round window (1, 2 or 5 times a power of ten ns) giving about ``windows`` windows."""
    raw = max(1, span_ns // max(1, windows))
    scale = 1
    while scale * 10 <= raw:
        scale *= 10
    for m in (1, 2, 5, 10):
        if m * scale >= raw:
            return m * scale
    return 10 * scale


def _run_row(con, db: DB, run_id: str) -> tuple:
    row = fetch_one(
        con,
        "SELECT status, writer_pid, writer_host, writer_start FROM runs WHERE run_id = ?", [run_id]
    )
    if row is None:
        raise UnknownRunError(str(db), run_id)
    return row


def _window(con, run_id: str, window_ns: int | None) -> int:
    if window_ns is not None:
        if window_ns <= 0:
            raise ValueError(f"window_ns must be positive, got {window_ns}")
        return int(window_ns)
    lo, hi = fetch_one(
        con,
        "SELECT min(start_ns), max(end_ns) FROM spans WHERE run_id = ?", [run_id]
    )
    return _nice_window(0 if lo is None else hi - lo)


def _evicted_blocks_sql(status: str) -> str:
    """Materialised rows for finished runs; the same SELECT on the fly for running ones."""
    if status == "running":
        return f"({derived.EVICTED_BLOCKS_SELECT})"
    return "(SELECT * FROM evicted_blocks WHERE run_id = $run_id)"


def _with_run(db: DB, run_id: str, window_ns: int | None, build) -> pl.DataFrame:
    """Open once, check the run, resolve the window, run ``build(status, window) -> sql``."""
    with read_connection(db) as con:
        status = _run_row(con, db, run_id)[0]
        w = _window(con, run_id, window_ns) if window_ns is not False else 0
        sql = build(status, w)
        params = {"run_id": run_id}
        if "$w" in sql:
            params["w"] = w
        return _pl(con, sql, params)


# --- runs -----------------------------------------------------------------------------
def runs(db: DB) -> pl.DataFrame:
    """All runs, newest first, with effective status (a dead writer's run reads ``incomplete``)."""
    with read_connection(db) as con:
        frame = _pl(con, """
            SELECT r.run_id, r.name, r.created, r.trace_source, r.trace_digest, r.mode,
                   CAST(r.behaviours AS VARCHAR) AS behaviours, r.status, r.digest,
                   CAST(r.config AS VARCHAR) AS config, CAST(r.summary AS VARCHAR) AS summary,
                   r.writer_pid, r.writer_host, r.writer_start,
                   coalesce(c.num_spans, 0) AS num_spans
            FROM runs r
            LEFT JOIN (SELECT run_id, count(*) AS num_spans FROM spans GROUP BY run_id) c USING (run_id)
            ORDER BY r.created DESC NULLS LAST, r.run_id DESC
            """, {})
    status = [
        "incomplete" if s == "running" and not writer_alive(p, h, t) else s
        for s, p, h, t in zip(frame["status"], frame["writer_pid"], frame["writer_host"], frame["writer_start"])
    ]
    return frame.with_columns(pl.Series("status", status, dtype=pl.String)).drop("writer_host", "writer_start")


def run(db: DB, run_id: str) -> dict[str, Any]:
    """One run as a dict; ``config``, ``behaviours`` and ``summary`` parsed from JSON."""
    frame = runs(db).filter(pl.col("run_id") == run_id)
    if frame.height == 0:
        raise UnknownRunError(str(db), run_id)
    out = frame.row(0, named=True)
    for key in ("config", "behaviours", "summary"):
        out[key] = json.loads(out[key]) if out[key] is not None else None
    return out


def span_counts(db: DB, run_id: str) -> pl.DataFrame:
    """Per span name: spans and blocks covered (headline counts for the Overview)."""
    return _with_run(db, run_id, False, lambda s, w: """
        SELECT name, count(*) AS spans,
               sum(coalesce(len(block_ids), len(block_hashes), 0)) AS blocks
        FROM spans WHERE run_id = $run_id GROUP BY name ORDER BY name""")


# --- hit rates ------------------------------------------------------------------------
def hit_rate_over_time(db: DB, run_id: str, window_ns: int | None = None, group: int | None = None) -> pl.DataFrame:
    """Token hit rate per window and cumulative, from lookup spans.

    Rows per (window_start_ns, group_id); group_id -1 is the all-groups series
    (``num_hit_tokens``: the coordinator's fixed point), g >= 0 uses
    ``hit_tokens_per_group[g]``. ``group`` keeps one series. Columns: query_tokens,
    hit_tokens, external_hit_tokens, hit_rate, cum_query_tokens, cum_hit_tokens,
    cum_hit_rate, lookups.
    """
    group_filter = "" if group is None else f"WHERE group_id = {int(group)}"
    return _with_run(db, run_id, window_ns, lambda s, w: f"""
        WITH l AS (
            SELECT start_ns // $w * $w AS window_start_ns, coalesce(num_query_tokens, 0) AS q,
                   coalesce(num_hit_tokens, 0) AS h, coalesce(num_external_hit_tokens, 0) AS x,
                   hit_tokens_per_group AS g
            FROM lookup_spans WHERE run_id = $run_id AND name = '{SPAN_LOOKUP}'
        ),
        series AS (
            SELECT window_start_ns, {OVERALL_GROUP} AS group_id, q, h, x FROM l
            UNION ALL
            SELECT window_start_ns, unnest(range(len(g))) AS group_id, q, unnest(g) AS h, x FROM l
        ),
        per AS (
            SELECT window_start_ns, CAST(group_id AS INTEGER) AS group_id, count(*) AS lookups,
                   sum(q) AS query_tokens, sum(h) AS hit_tokens, sum(x) AS external_hit_tokens
            FROM series {group_filter} GROUP BY ALL
        )
        SELECT window_start_ns, group_id, lookups, query_tokens, hit_tokens, external_hit_tokens,
               hit_tokens / nullif(query_tokens, 0) AS hit_rate,
               sum(query_tokens) OVER c AS cum_query_tokens,
               sum(hit_tokens) OVER c AS cum_hit_tokens,
               sum(hit_tokens) OVER c / nullif(sum(query_tokens) OVER c, 0) AS cum_hit_rate
        FROM per
        WINDOW c AS (PARTITION BY group_id ORDER BY window_start_ns)
        ORDER BY group_id, window_start_ns""")


def hit_token_sources(db: DB, run_id: str, window_ns: int | None = None) -> pl.DataFrame:
    """Per window: prompt tokens served from the local cache, the external tier, or computed."""
    return _with_run(db, run_id, window_ns, lambda s, w: f"""
        SELECT start_ns // $w * $w AS window_start_ns,
               sum(coalesce(num_hit_tokens, 0)) AS local_tokens,
               sum(coalesce(num_external_hit_tokens, 0)) AS external_tokens,
               sum(greatest(coalesce(num_query_tokens, 0) - coalesce(num_hit_tokens, 0)
                            - coalesce(num_external_hit_tokens, 0), 0)) AS computed_tokens
        FROM lookup_spans WHERE run_id = $run_id AND name = '{SPAN_LOOKUP}'
        GROUP BY ALL ORDER BY window_start_ns""")


def usage_over_time(db: DB, run_id: str, window_ns: int | None = None) -> pl.DataFrame:
    """Per window and KV group: mean and max block-pool usage (0..1), plus queue depths."""
    return _with_run(db, run_id, window_ns, lambda s, w: f"""
        WITH st AS (
            SELECT start_ns // $w * $w AS window_start_ns, num_running, num_waiting,
                   unnest(range(len(usage))) AS group_id, unnest(usage) AS u
            FROM step_spans WHERE run_id = $run_id AND name = '{SPAN_STEP}'
        )
        SELECT window_start_ns, CAST(group_id AS INTEGER) AS group_id, avg(u) AS mean_usage,
               max(u) AS max_usage, avg(num_running) AS mean_running, avg(num_waiting) AS mean_waiting
        FROM st GROUP BY ALL ORDER BY group_id, window_start_ns""")


# --- evictions ------------------------------------------------------------------------
def evictions_over_time(db: DB, run_id: str, window_ns: int | None = None, by: str = "reason") -> pl.DataFrame:
    """Evicted blocks per window, keyed by eviction reason or by the kind of the publish
    that next took each block (``publish_kind``; 'none' when no publish took it)."""
    if by == "reason":
        return _with_run(db, run_id, window_ns, lambda s, w: f"""
            SELECT start_ns // $w * $w AS window_start_ns, evict_reason AS key,
                   sum(coalesce(len(block_ids), len(block_hashes), 0)) AS blocks, count(*) AS spans
            FROM cache_spans WHERE run_id = $run_id AND name = '{SPAN_EVICT}'
            GROUP BY ALL ORDER BY window_start_ns, key""")
    if by == "publish_kind":
        return _with_run(db, run_id, window_ns, lambda s, w: f"""
            SELECT evict_ns // $w * $w AS window_start_ns, coalesce(next_publish_kind, 'none') AS key,
                   count(*) AS blocks, count(DISTINCT evict_seq) AS spans
            FROM {_evicted_blocks_sql(s)} GROUP BY ALL ORDER BY window_start_ns, key""")
    raise ValueError(f"by must be 'reason' or 'publish_kind', not {by!r}")


def evictions_by_reason(db: DB, run_id: str) -> pl.DataFrame:
    """Total evicted blocks (and spans) per eviction reason, with each reason's share."""
    return _with_run(db, run_id, False, lambda s, w: f"""
        SELECT evict_reason AS reason, sum(coalesce(len(block_ids), len(block_hashes), 0)) AS blocks,
               count(*) AS spans, blocks / sum(blocks) OVER () AS share
        FROM cache_spans WHERE run_id = $run_id AND name = '{SPAN_EVICT}'
        GROUP BY ALL ORDER BY blocks DESC, reason""")


def evictions_by_publish_kind(db: DB, run_id: str) -> pl.DataFrame:
    """Evicted blocks per kind of the publish that took the block next ('none' if none)."""
    return _with_run(db, run_id, False, lambda s, w: f"""
        SELECT coalesce(next_publish_kind, 'none') AS publish_kind, count(*) AS blocks,
               blocks / sum(blocks) OVER () AS share
        FROM {_evicted_blocks_sql(s)} GROUP BY ALL ORDER BY blocks DESC, publish_kind""")


def eviction_attribution(db: DB, run_id: str, limit: int | None = None) -> pl.DataFrame:
    """For each lookup miss on a block that was cached before: the eviction that removed
    it (the latest eviction of that hash in group 0 before the miss) and the publish that
    took its block id next.

    Columns: miss_seq, miss_ns, miss_request_id, root_hash, missed_hash, missed_index,
    evict_span_id, evict_ns, evict_reason, block_id, age, idle, evict_request_id,
    publish_span_id, publish_ns, publish_kind, publish_request_id.
    """
    lim = "" if limit is None else f"LIMIT {int(limit)}"
    return _with_run(db, run_id, False, lambda s, w: f"""
        WITH m AS (
            SELECT seq AS miss_seq, start_ns AS miss_ns, request_id AS miss_request_id, root_hash,
                   first_miss_hash AS missed_hash, first_miss_index AS missed_index
            FROM lookup_spans WHERE run_id = $run_id AND name = '{SPAN_LOOKUP}' AND first_miss_hash IS NOT NULL
        ),
        eb AS (SELECT * FROM {_evicted_blocks_sql(s)} WHERE group_id = 0 AND block_hash IS NOT NULL)
        SELECT m.*, eb.evict_span_id, eb.evict_ns, eb.reason AS evict_reason, eb.block_id, eb.age,
               eb.idle, eb.evict_request_id, eb.next_publish_span_id AS publish_span_id,
               eb.next_publish_ns AS publish_ns, eb.next_publish_kind AS publish_kind,
               eb.next_publish_request_id AS publish_request_id
        FROM m ASOF JOIN eb ON m.missed_hash = eb.block_hash AND m.miss_seq > eb.evict_seq
        ORDER BY m.miss_seq {lim}""")


def eviction_attribution_flows(db: DB, run_id: str, top_prefixes: int = 10) -> pl.DataFrame:
    """Sankey input: (publish_kind, evict_reason, prefix) -> misses, where prefix is one of
    the ``top_prefixes`` root hashes with most attributed misses, or 'other'."""
    att = eviction_attribution(db, run_id)
    if att.height == 0:
        return pl.DataFrame(schema={"publish_kind": pl.String, "evict_reason": pl.String,
                                    "prefix": pl.String, "misses": pl.UInt32})
    top = (
        att.group_by("root_hash").len().sort(["len", "root_hash"], descending=[True, False])
        .head(top_prefixes)["root_hash"].to_list()
    )
    return (
        att.with_columns(
            pl.col("publish_kind").fill_null("none"),
            pl.when(pl.col("root_hash").is_in(top)).then(pl.col("root_hash")).otherwise(pl.lit("other")).alias("prefix"),
        )
        .group_by("publish_kind", "evict_reason", "prefix").len(name="misses")
        .sort(["misses", "publish_kind", "evict_reason", "prefix"], descending=[True, False, False, False])
    )


def block_histograms(db: DB, run_id: str, bins: int = 40) -> pl.DataFrame:
    """Histograms (in scheduler steps) of block lifetime at eviction, idle time before
    eviction, and prefix reuse gap (steps between consecutive lookups of a root hash,
    counted at lookups that hit). Integer bins [bin_lo, bin_hi), at most ``bins`` per
    metric. Columns: metric, bin_lo, bin_hi, count."""
    bins = max(1, int(bins))
    return _with_run(db, run_id, False, lambda s, w: f"""
        WITH v AS (
            SELECT 'lifetime' AS metric, age AS x FROM {_evicted_blocks_sql(s)} WHERE age IS NOT NULL
            UNION ALL
            SELECT 'idle_before_evict', idle FROM {_evicted_blocks_sql(s)} WHERE idle IS NOT NULL
            UNION ALL
            SELECT 'reuse_gap', gap FROM (
                SELECT step - lag(step) OVER (PARTITION BY root_hash ORDER BY seq) AS gap,
                       num_hit_tokens > 0 AS hit
                FROM lookup_spans WHERE run_id = $run_id AND name = '{SPAN_LOOKUP}' AND root_hash IS NOT NULL
            ) WHERE hit AND gap IS NOT NULL
        ),
        r AS (SELECT metric, min(x) AS lo, greatest(ceil((max(x) - min(x) + 1) / {bins}), 1)::BIGINT AS width
              FROM v GROUP BY metric),
        b AS (SELECT v.metric, r.lo, r.width, (v.x - r.lo) // r.width AS i FROM v JOIN r USING (metric))
        SELECT metric, lo + i * width AS bin_lo, lo + (i + 1) * width AS bin_hi, count(*) AS count
        FROM b GROUP BY metric, lo, width, i ORDER BY metric, bin_lo""")


# --- prefixes -------------------------------------------------------------------------
def per_prefix_reuse(db: DB, run_id: str, top: int = 20) -> pl.DataFrame:
    """Hottest prefixes (root hash of the first full block): lookups, hits and misses."""
    return _with_run(db, run_id, False, lambda s, w: f"""
        SELECT root_hash, count(*) AS lookups,
               count(*) FILTER (WHERE num_hit_tokens > 0) AS hit_lookups,
               count(*) FILTER (WHERE coalesce(num_hit_tokens, 0) = 0) AS miss_lookups,
               sum(num_hit_tokens) AS hit_tokens, sum(num_query_tokens) AS query_tokens,
               sum(num_hit_tokens) / nullif(sum(num_query_tokens), 0) AS hit_rate,
               count(DISTINCT request_id) AS requests,
               min(start_ns) AS first_ns, max(start_ns) AS last_ns
        FROM lookup_spans WHERE run_id = $run_id AND name = '{SPAN_LOOKUP}' AND root_hash IS NOT NULL
        GROUP BY root_hash ORDER BY lookups DESC, root_hash LIMIT {int(top)}""")


# --- correctness ----------------------------------------------------------------------
def stale_hashes_over_time(db: DB, run_id: str, window_ns: int | None = None) -> pl.DataFrame:
    """Per window: stale hashes found by the worker, stale entries left by the cache
    (behaviour off), and divergent outputs."""
    return _with_run(db, run_id, window_ns, lambda s, w: f"""
        SELECT start_ns // $w * $w AS window_start_ns,
               count(*) FILTER (WHERE name = '{SPAN_STALE_HASH}') AS stale_found,
               count(*) FILTER (WHERE name = '{SPAN_STALE_LEFT}') AS stale_left,
               count(*) FILTER (WHERE name = '{SPAN_DIVERGENT}') AS divergent_outputs
        FROM spans WHERE run_id = $run_id
          AND name IN ('{SPAN_STALE_HASH}', '{SPAN_STALE_LEFT}', '{SPAN_DIVERGENT}')
        GROUP BY ALL ORDER BY window_start_ns""")


def stale_hashes(db: DB, run_id: str) -> pl.DataFrame:
    """Every stale hash found: time, request, group, block id, hash, fingerprints."""
    return _with_run(db, run_id, False, lambda s, w: f"""
        SELECT seq, start_ns AS time_ns, step, request_id, group_id, block_ids[1] AS block_id,
               block_hashes[1] AS block_hash, num_tokens, expected_fingerprint, actual_fingerprint
        FROM verify_spans WHERE run_id = $run_id AND name = '{SPAN_STALE_HASH}' ORDER BY seq""")


def stale_hash_chain(db: DB, run_id: str, block_hash: str, group_id: int | None = None) -> pl.DataFrame:
    """The spans that explain one stale hash, in order: its publishes, the overwrite
    (stale_left, CoW into its block), evictions, lookups naming it, and the stale hit."""
    with read_connection(db) as con:
        _run_row(con, db, run_id)
        params = {"run_id": run_id, "h": block_hash, "g": group_id}
        return _pl(con, f"""
            WITH touched AS (
                SELECT * FROM spans
                WHERE run_id = $run_id AND ($g IS NULL OR group_id = $g OR group_id IS NULL)
                  AND (list_contains(block_hashes, $h) OR root_hash = $h OR first_miss_hash = $h)
            ),
            blocks AS (
                SELECT DISTINCT group_id, block_ids[list_position(block_hashes, $h)] AS block_id
                FROM touched WHERE list_contains(block_hashes, $h) AND block_ids IS NOT NULL
            ),
            cows AS (
                SELECT s.* FROM cache_spans s JOIN blocks b
                  ON s.group_id = b.group_id AND (s.copy_dst = b.block_id OR s.copy_src = b.block_id)
                WHERE s.run_id = $run_id AND s.name = '{SPAN_COW}'
                  AND s.seq BETWEEN (SELECT min(seq) FROM touched) AND (SELECT max(seq) FROM touched)
            )
            SELECT seq, start_ns AS time_ns, step, name,
                   CASE name WHEN '{SPAN_PUBLISH}' THEN 'publish'
                             WHEN '{SPAN_STALE_LEFT}' THEN 'overwrite'
                             WHEN '{SPAN_COW}' THEN 'cow'
                             WHEN '{SPAN_EVICT}' THEN 'evict'
                             WHEN '{SPAN_STALE_HASH}' THEN 'stale_hit'
                             WHEN '{SPAN_LOOKUP}' THEN 'lookup'
                             ELSE 'other' END AS role,
                   request_id, group_id, block_ids, publish_kind, evict_reason, copy_reason, copy_src,
                   copy_dst, num_tokens, num_hit_tokens, expected_fingerprint, actual_fingerprint, span_id
            FROM (SELECT * FROM touched UNION ALL BY NAME SELECT * FROM cows)
            ORDER BY seq""", params)


def divergent_outputs(db: DB, run_id: str) -> pl.DataFrame:
    """Every divergent output token: time, request, output position, expected/actual."""
    return _with_run(db, run_id, False, lambda s, w: f"""
        SELECT seq, start_ns AS time_ns, step, request_id, position, expected_token, actual_token
        FROM verify_spans WHERE run_id = $run_id AND name = '{SPAN_DIVERGENT}' ORDER BY seq""")


# --- requests and latency -------------------------------------------------------------
_REQUEST_COLUMNS = f"""
    request_id, session_id, coalesce(arrival_ns, start_ns) AS arrival_ns, first_scheduled_ns,
    first_token_ns, end_ns AS finish_ns,
    first_scheduled_ns - coalesce(arrival_ns, start_ns) AS queue_ns,
    coalesce(ttft_ns, first_token_ns - coalesce(arrival_ns, start_ns)) AS ttft_ns,
    end_ns - coalesce(arrival_ns, start_ns) AS e2e_ns,
    num_prompt_tokens, num_output_tokens, num_hit_tokens AS num_local_hit_tokens,
    num_external_hit_tokens, num_computed_tokens, num_preemptions, num_divergent_tokens,
    itl_mean_ns, itl_p50_ns, itl_p99_ns, itl_max_ns"""


def requests(db: DB, run_id: str) -> pl.DataFrame:
    """One row per finished request: queue, TTFT, E2E, ITL stats, token and hit counts."""
    return _with_run(db, run_id, False, lambda s, w: f"""
        SELECT {_REQUEST_COLUMNS} FROM request_spans
        WHERE run_id = $run_id AND name = '{SPAN_REQUEST}' ORDER BY arrival_ns, request_id""")


def per_request_hits(db: DB, run_id: str) -> pl.DataFrame:
    """Per request: prompt tokens, local/external hit tokens, computed tokens, TTFT (for diffs)."""
    return _with_run(db, run_id, False, lambda s, w: f"""
        SELECT request_id, num_prompt_tokens, coalesce(num_hit_tokens, 0) AS num_local_hit_tokens,
               coalesce(num_external_hit_tokens, 0) AS num_external_hit_tokens,
               coalesce(num_hit_tokens, 0) + coalesce(num_external_hit_tokens, 0) AS num_hit_tokens,
               num_computed_tokens,
               coalesce(ttft_ns, first_token_ns - coalesce(arrival_ns, start_ns)) AS ttft_ns
        FROM request_spans WHERE run_id = $run_id AND name = '{SPAN_REQUEST}' ORDER BY request_id""")


def itl_gaps(db: DB, run_id: str, request_id: str | None = None) -> pl.DataFrame:
    """Inter-token gaps exploded: request_id, index (1 = gap after the first token),
    token_ns (time of the token that ends the gap), gap_ns. One request, or all."""
    with read_connection(db) as con:
        _run_row(con, db, run_id)
        return _pl(con, f"""
            WITH r AS (
                SELECT request_id, first_token_ns, unnest(itl_ns) AS gap_ns,
                       unnest(range(1, len(itl_ns) + 1)) AS index
                FROM request_spans WHERE run_id = $run_id AND name = '{SPAN_REQUEST}'
                  AND ($rid IS NULL OR request_id = $rid)
            )
            SELECT request_id, index,
                   first_token_ns + sum(gap_ns) OVER (PARTITION BY request_id ORDER BY index) AS token_ns,
                   gap_ns
            FROM r ORDER BY request_id, index""", {"run_id": run_id, "rid": request_id})


_LATENCY_VALUES = {
    "ttft": f"SELECT coalesce(ttft_ns, first_token_ns - coalesce(arrival_ns, start_ns)) AS v FROM request_spans "
            f"WHERE run_id = $run_id AND name = '{SPAN_REQUEST}'",
    "e2e": f"SELECT end_ns - coalesce(arrival_ns, start_ns) AS v FROM request_spans "
            f"WHERE run_id = $run_id AND name = '{SPAN_REQUEST}'",
    "queue": f"SELECT first_scheduled_ns - coalesce(arrival_ns, start_ns) AS v FROM request_spans "
            f"WHERE run_id = $run_id AND name = '{SPAN_REQUEST}'",
    "itl": f"SELECT unnest(itl_ns) AS v FROM request_spans WHERE run_id = $run_id AND name = '{SPAN_REQUEST}'",
}


def _check_metric(metric: str) -> None:
    if metric not in _LATENCY_VALUES:
        raise ValueError(f"metric must be one of {sorted(_LATENCY_VALUES)}, not {metric!r}")


def latency_cdf(db: DB, run_id: str, metric: str = "ttft") -> pl.DataFrame:
    """Quantiles of a latency (ttft | e2e | queue | itl over all gaps) on a fixed grid:
    columns q (0..1 in 1/QUANTILE_GRID steps), value_ns, n (sample count)."""
    _check_metric(metric)
    return _with_run(db, run_id, False, lambda s, w: f"""
        WITH v AS ({_LATENCY_VALUES[metric]}),
        agg AS (SELECT quantile_cont(v, [i / {QUANTILE_GRID} for i in range({QUANTILE_GRID} + 1)]) AS qs,
                       count(v) AS n FROM v)
        SELECT unnest(range({QUANTILE_GRID} + 1)) / {QUANTILE_GRID} AS q, unnest(qs) AS value_ns, n
        FROM agg WHERE n > 0""")


def latency_percentiles(db: DB, run_id: str, metric: str = "ttft", qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> dict[float, float]:
    """Selected exact percentiles of one latency metric, in ns ({} when no samples)."""
    _check_metric(metric)
    with read_connection(db) as con:
        _run_row(con, db, run_id)
        row = fetch_one(
        con,
            f"SELECT quantile_cont(v, $qs), count(v) FROM ({_LATENCY_VALUES[metric]})",
            {"run_id": run_id, "qs": list(qs)},
        )
    if not row[1]:
        return {}
    return dict(zip(qs, row[0]))


def latency_histogram(db: DB, run_id: str, metric: str = "ttft", bins: int = 50) -> pl.DataFrame:
    """Linear-bin histogram of a latency (ns): bin_lo, bin_hi, count."""
    _check_metric(metric)
    bins = max(1, int(bins))
    return _with_run(db, run_id, False, lambda s, w: f"""
        WITH v AS ({_LATENCY_VALUES[metric]}),
        r AS (SELECT min(v) AS lo, greatest((max(v) - min(v)) / {bins}, 1e-9) AS width FROM v),
        b AS (SELECT least(floor((v - lo) / width), {bins} - 1) AS i FROM v, r WHERE v IS NOT NULL)
        SELECT r.lo + i * r.width AS bin_lo, r.lo + (i + 1) * r.width AS bin_hi, count(*) AS count
        FROM b, r GROUP BY i, r.lo, r.width ORDER BY i""")


def itl_over_time(db: DB, run_id: str, window_ns: int | None = None) -> pl.DataFrame:
    """Per window of first-token time: requests, gap-weighted mean ITL, median of the
    requests' p50 ITL, max of their p99 and max."""
    return _with_run(db, run_id, window_ns, lambda s, w: f"""
        SELECT first_token_ns // $w * $w AS window_start_ns, count(*) AS requests,
               sum(itl_mean_ns * len(itl_ns)) / nullif(sum(len(itl_ns)), 0) AS mean_itl_ns,
               median(itl_p50_ns) AS p50_itl_ns, max(itl_p99_ns) AS max_p99_itl_ns,
               max(itl_max_ns) AS max_itl_ns
        FROM request_spans WHERE run_id = $run_id AND name = '{SPAN_REQUEST}' AND first_token_ns IS NOT NULL
        GROUP BY ALL ORDER BY window_start_ns""")


def request_waterfall(db: DB, run_id: str, request_id: str) -> pl.DataFrame:
    """Segments of one request in time order: queue, prefill chunks, decode, and point
    marks for its cache lookups (hits), CoW copies and the evictions it caused."""
    with read_connection(db) as con:
        _run_row(con, db, run_id)
        return _pl(con, f"""
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
            {"run_id": run_id, "rid": request_id})
