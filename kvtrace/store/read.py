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

import bisect

import polars as pl

from kvtrace.store import derived
from kvtrace.store.connection import fetch_one, read_connection
from kvtrace.store.errors import UnknownRunError
from kvtrace.store.liveness import writer_alive
from kvtrace.store.schema import (
    FAMILIES,
    SPAN_COW,
    SPAN_DIVERGENT,
    SPAN_EVICT,
    SPAN_LOOKUP,
    SPAN_PUBLISH,
    SPAN_REQUEST,
    SPAN_STALE_HASH,
    SPAN_STALE_LEFT,
    SPAN_STEP,
    family_columns,
)

DB = str | Path
DEFAULT_WINDOWS = 200
OVERALL_GROUP = -1  # group_id of the all-groups series in hit_rate_over_time
QUANTILE_GRID = derived.QUANTILE_GRID


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


def _derived(table: str, status: str) -> str:
    """A derived table's rows of $run_id: materialised for finished runs, computed on the
    fly (same SQL) for running ones."""
    if status == "running":
        return f"({derived.live_sql(table)})"
    return f"(SELECT * FROM {table} WHERE run_id = $run_id)"


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
                   coalesce(live.n, stats.n, 0) AS num_spans
            FROM runs r
            LEFT JOIN (SELECT run_id, CAST(sum(spans) AS BIGINT) AS n FROM span_stats GROUP BY run_id) stats
                   USING (run_id)
            LEFT JOIN (SELECT run_id, count(*) AS n FROM spans
                       WHERE run_id IN (SELECT run_id FROM runs WHERE status = 'running')
                       GROUP BY run_id) live USING (run_id)
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
    return _with_run(db, run_id, False, lambda s, w: f"""
        SELECT name, spans, blocks FROM {_derived("span_stats", s)} ORDER BY name""")


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
    """Evicted blocks per window (columns window_start_ns, key, blocks), keyed by eviction
    reason or by the kind of the publish that next took each block (``publish_kind``;
    'none' when no publish took it)."""
    if by in ("reason", "publish_kind"):
        key = "reason" if by == "reason" else "coalesce(publish_kind, 'none')"
        return _with_run(db, run_id, window_ns, lambda s, w: f"""
            SELECT evict_ns // $w * $w AS window_start_ns, {key} AS key, sum(blocks) AS blocks
            FROM {_derived("evict_counts", s)} GROUP BY ALL ORDER BY window_start_ns, key""")
    raise ValueError(f"by must be 'reason' or 'publish_kind', not {by!r}")


def evictions_by_reason(db: DB, run_id: str) -> pl.DataFrame:
    """Total evicted blocks (and spans) per eviction reason, with each reason's share."""
    return _with_run(db, run_id, False, lambda s, w: f"""
        SELECT evict_reason AS reason, sum(num_blocks) AS blocks,
               count(*) AS spans, blocks / sum(blocks) OVER () AS share
        FROM cache_spans WHERE run_id = $run_id AND name = '{SPAN_EVICT}'
        GROUP BY ALL ORDER BY blocks DESC, reason""")


def evictions_by_publish_kind(db: DB, run_id: str) -> pl.DataFrame:
    """Evicted blocks per kind of the publish that took the block next ('none' if none)."""
    return _with_run(db, run_id, False, lambda s, w: f"""
        SELECT coalesce(publish_kind, 'none') AS publish_kind, sum(blocks) AS blocks,
               sum(blocks) / sum(sum(blocks)) OVER () AS share
        FROM {_derived("evict_counts", s)} GROUP BY ALL ORDER BY blocks DESC, publish_kind""")


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
        SELECT miss_seq, miss_ns, miss_request_id, root_hash, missed_hash, missed_index, evict_span_id,
               evict_ns, evict_reason, block_id, age, idle, evict_request_id, publish_span_id, publish_ns,
               publish_kind, publish_request_id
        FROM {_derived("miss_attribution", s)} ORDER BY miss_seq {lim}""")


def eviction_attribution_flows(db: DB, run_id: str, top_prefixes: int = 10) -> pl.DataFrame:
    """Sankey input: (publish_kind, evict_reason, prefix) -> misses, where prefix is one of
    the ``top_prefixes`` root hashes with most attributed misses, or 'other'."""
    return _with_run(db, run_id, False, lambda s, w: f"""
        WITH a AS (SELECT * FROM {_derived("miss_attribution", s)}),
        top AS (SELECT root_hash FROM a GROUP BY root_hash ORDER BY count(*) DESC, root_hash
                LIMIT {int(top_prefixes)})
        SELECT coalesce(publish_kind, 'none') AS publish_kind, evict_reason,
               CASE WHEN root_hash IN (SELECT root_hash FROM top) THEN root_hash ELSE 'other' END AS prefix,
               count(*) AS misses
        FROM a GROUP BY ALL ORDER BY misses DESC, publish_kind, evict_reason, prefix""")


def block_histograms(db: DB, run_id: str, bins: int = 40) -> pl.DataFrame:
    """Histograms (in scheduler steps) of block lifetime at eviction, idle time before
    eviction, and prefix reuse gap (steps between consecutive lookups of a root hash,
    counted at lookups that hit). Integer bins [bin_lo, bin_hi), at most ``bins`` per
    metric. Columns: metric, bin_lo, bin_hi, count."""
    bins = max(1, int(bins))
    return _with_run(db, run_id, False, lambda s, w: f"""
        WITH v AS (SELECT metric, x, n FROM {_derived("block_values", s)}),
        r AS (SELECT metric, min(x) AS lo, greatest(ceil((max(x) - min(x) + 1) / {bins}), 1)::BIGINT AS width
              FROM v GROUP BY metric),
        b AS (SELECT v.metric, r.lo, r.width, (v.x - r.lo) // r.width AS i, v.n FROM v JOIN r USING (metric))
        SELECT metric, lo + i * width AS bin_lo, lo + (i + 1) * width AS bin_hi, sum(n) AS count
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


_CHAIN_COLUMNS = (
    "seq", "start_ns", "step", "name", "request_id", "group_id", "block_ids", "block_hashes", "publish_kind",
    "evict_reason", "copy_reason", "copy_src", "copy_dst", "num_tokens", "num_hit_tokens",
    "expected_fingerprint", "actual_fingerprint", "span_id",
)
_CHAIN_ROLES = {
    SPAN_PUBLISH: "publish", SPAN_STALE_LEFT: "overwrite", SPAN_COW: "cow", SPAN_EVICT: "evict",
    SPAN_STALE_HASH: "stale_hit", SPAN_LOOKUP: "lookup",
}


_COW_COLUMNS = ("seq", "start_ns", "step", "name", "request_id", "group_id", "copy_reason", "copy_src",
                "copy_dst", "span_id")


def _chain_select(view: str, where: str, only: tuple[str, ...] = _CHAIN_COLUMNS) -> str:
    """SELECT of the chain columns from one family view (NULL where the family lacks one,
    and for columns outside ``only``: list columns cost a scan even where filtered out)."""
    table = next(t for t, (v, _, _) in FAMILIES.items() if v == view)
    have = set(family_columns(table)) & set(only)
    cols = ", ".join(c if c in have else f"NULL AS {c}" for c in _CHAIN_COLUMNS)
    return f"SELECT {cols} FROM {view} WHERE run_id = $run_id AND {where}"


def stale_hash_chain(db: DB, run_id: str, block_hash: str, group_id: int | None = None) -> pl.DataFrame:
    """The spans that explain one stale hash, in order: its publishes, the overwrite
    (stale_left, CoW into or out of its block), evictions, lookups naming it, and the stale
    hit. Columns: seq, time_ns, step, name, role, request_id, group_id, block_ids, ..."""
    with read_connection(db) as con:
        status = _run_row(con, db, run_id)[0]
        params = {"run_id": run_id, "h": block_hash}
        # Finished runs index the spans naming each stale hash (derived.stale_chain); the
        # seqs (integers read from the store) go in as literals so zone maps skip the rest.
        by_hash = "list_contains(block_hashes, $h)"
        if status != "running":
            seqs = [int(r[0]) for r in con.execute(
                "SELECT seq FROM stale_chain WHERE run_id = $run_id AND block_hash = $h", params).fetchall()]
            if seqs:
                by_hash = f"seq IN ({', '.join(map(str, seqs))})"
        group = "" if group_id is None else f" AND group_id = {int(group_id)}"
        names = f"name IN ('{SPAN_PUBLISH}', '{SPAN_EVICT}', '{SPAN_STALE_LEFT}')"
        touched = _pl(con, " UNION ALL ".join([
            _chain_select("cache_spans", f"{names}{group} AND {by_hash}"),
            _chain_select("verify_spans", f"{by_hash}{group}"),
            _chain_select("lookup_spans", "(root_hash = $h OR first_miss_hash = $h)"),
        ]), params)
        touched = touched.filter(
            pl.col("block_hashes").is_null() | pl.col("block_hashes").list.contains(block_hash)
        )
        holders = (
            touched.filter(pl.col("block_ids").is_not_null())
            .select("group_id", pl.col("block_ids").list.get(pl.col("block_hashes").list.eval(
                pl.element() == block_hash).list.arg_max()).alias("block_id"))
            .unique().drop_nulls().rows()
        )
        if holders and touched.height:
            lo, hi = int(touched["seq"].min()), int(touched["seq"].max())
            pairs = " OR ".join(
                f"(group_id = {int(g)} AND (copy_dst = {int(b)} OR copy_src = {int(b)}))" for g, b in holders
            )
            cows = _pl(con, _chain_select("cache_spans", f"name = '{SPAN_COW}' AND seq BETWEEN {lo} AND {hi} "
                                                         f"AND ({pairs})", _COW_COLUMNS), {"run_id": run_id})
            touched = pl.concat([touched, cows], how="vertical_relaxed")
    return (
        touched.sort("seq")
        .with_columns(pl.col("name").replace_strict(_CHAIN_ROLES, default="other").alias("role"))
        .rename({"start_ns": "time_ns"})
        .select("seq", "time_ns", "step", "name", "role", "request_id", "group_id", "block_ids", "publish_kind",
                "evict_reason", "copy_reason", "copy_src", "copy_dst", "num_tokens", "num_hit_tokens",
                "expected_fingerprint", "actual_fingerprint", "span_id")
    )


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


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    """Piecewise-linear y(x) through sorted xs (clamped at the ends), like numpy.interp."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 if x1 == x0 else y0 + (x - x0) * (y1 - y0) / (x1 - x0)


def _check_metric(metric: str) -> None:
    if metric not in derived.LATENCY_VALUES:
        raise ValueError(f"metric must be one of {sorted(derived.LATENCY_VALUES)}, not {metric!r}")


def latency_cdf(db: DB, run_id: str, metric: str = "ttft") -> pl.DataFrame:
    """Exact quantiles (quantile_cont) of a latency (ttft | e2e | queue | itl over every
    gap) on a fixed grid: columns q (0..1 in 1/QUANTILE_GRID steps), value_ns, n (samples).
    Empty when the run has no samples."""
    _check_metric(metric)
    with read_connection(db) as con:
        status = _run_row(con, db, run_id)[0]
        if status == "running":
            sql = f"SELECT q, value_ns, n FROM {derived.quantile_grid_sql(metric)} ORDER BY q"
            return _pl(con, sql, {"run_id": run_id})
        return _pl(con, "SELECT q, value_ns, n FROM latency_quantiles WHERE run_id = $run_id AND metric = $m "
                        "ORDER BY q", {"run_id": run_id, "m": metric})


def latency_percentiles(db: DB, run_id: str, metric: str = "ttft", qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> dict[float, float]:
    """Percentiles of one latency metric in ns ({} without samples): exact quantile_cont at
    multiples of 1/QUANTILE_GRID (0.5, 0.9, 0.99 ...), linear between grid points."""
    cdf = latency_cdf(db, run_id, metric)
    if cdf.height == 0:
        return {}
    grid_q, grid_v = cdf["q"].to_list(), cdf["value_ns"].to_list()
    return {q: float(_interp(q, grid_q, grid_v)) for q in qs}


def latency_histogram(db: DB, run_id: str, metric: str = "ttft", bins: int = 50) -> pl.DataFrame:
    """Linear-bin histogram of a latency (ns) from its quantile grid: bin_lo, bin_hi, count
    (samples per bin, interpolated within each 1/QUANTILE_GRID slice, so fractional)."""
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
    counts = [(b - a) * n for a, b in zip(mass, mass[1:])]
    return pl.DataFrame({"bin_lo": edges[:-1], "bin_hi": edges[1:], "count": counts})


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
