"""Hits: token hit rate per window and group, hit-token sources, block-pool usage, and
the hottest prefixes. All from lookup and step spans."""

from __future__ import annotations

import polars as pl

from kvtrace.store.read._sql import DB, with_run
from kvtrace.store.schema import SPAN_LOOKUP, SPAN_STEP

OVERALL_GROUP = -1  # group_id of the all-groups series in hit_rate_over_time


def hit_rate_over_time(db: DB, run_id: str, window_ns: int | None = None, group: int | None = None) -> pl.DataFrame:
    """Token hit rate per window and cumulative, from lookup spans.

    Rows per (window_start_ns, group_id); group_id -1 is the all-groups series
    (``num_hit_tokens``: the coordinator's fixed point), g >= 0 uses
    ``hit_tokens_per_group[g]``. ``group`` keeps one series. Columns: window_start_ns,
    group_id, lookups, query_tokens, hit_tokens, external_hit_tokens, hit_rate,
    cum_query_tokens, cum_hit_tokens, cum_hit_rate.
    """
    return with_run(db, run_id, f"""
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
            FROM series WHERE $group IS NULL OR group_id = $group GROUP BY ALL
        )
        SELECT window_start_ns, group_id, lookups, query_tokens, hit_tokens, external_hit_tokens,
               hit_tokens / nullif(query_tokens, 0) AS hit_rate,
               sum(query_tokens) OVER c AS cum_query_tokens,
               sum(hit_tokens) OVER c AS cum_hit_tokens,
               sum(hit_tokens) OVER c / nullif(sum(query_tokens) OVER c, 0) AS cum_hit_rate
        FROM per
        WINDOW c AS (PARTITION BY group_id ORDER BY window_start_ns)
        ORDER BY group_id, window_start_ns""",
                     window_ns=window_ns, params={"group": None if group is None else int(group)})


def hit_token_sources(db: DB, run_id: str, window_ns: int | None = None) -> pl.DataFrame:
    """Per window: prompt tokens served from the local cache, the external tier, or
    computed. Columns: window_start_ns, local_tokens, external_tokens, computed_tokens."""
    return with_run(db, run_id, f"""
        SELECT start_ns // $w * $w AS window_start_ns,
               sum(coalesce(num_hit_tokens, 0)) AS local_tokens,
               sum(coalesce(num_external_hit_tokens, 0)) AS external_tokens,
               sum(greatest(coalesce(num_query_tokens, 0) - coalesce(num_hit_tokens, 0)
                            - coalesce(num_external_hit_tokens, 0), 0)) AS computed_tokens
        FROM lookup_spans WHERE run_id = $run_id AND name = '{SPAN_LOOKUP}'
        GROUP BY ALL ORDER BY window_start_ns""", window_ns=window_ns)


def usage_over_time(db: DB, run_id: str, window_ns: int | None = None) -> pl.DataFrame:
    """Per window and KV group: mean and max of the group's share of its block pool (0..1; with
    the shared pool the groups' shares add up to the pool's usage), plus queue depths.
    Columns: window_start_ns, group_id, mean_usage, max_usage, mean_running, mean_waiting."""
    return with_run(db, run_id, f"""
        WITH st AS (
            SELECT start_ns // $w * $w AS window_start_ns, num_running, num_waiting,
                   unnest(range(len(usage))) AS group_id, unnest(usage) AS u
            FROM step_spans WHERE run_id = $run_id AND name = '{SPAN_STEP}'
        )
        SELECT window_start_ns, CAST(group_id AS INTEGER) AS group_id, avg(u) AS mean_usage,
               max(u) AS max_usage, avg(num_running) AS mean_running, avg(num_waiting) AS mean_waiting
        FROM st GROUP BY ALL ORDER BY group_id, window_start_ns""", window_ns=window_ns)


def per_prefix_reuse(db: DB, run_id: str, top: int = 20) -> pl.DataFrame:
    """The ``top`` hottest prefixes (root hash of the first full block) by lookups.
    Columns: root_hash, lookups, hit_lookups, miss_lookups, hit_tokens, query_tokens,
    hit_rate, requests, first_ns, last_ns."""
    return with_run(db, run_id, f"""
        SELECT root_hash, count(*) AS lookups,
               count(*) FILTER (WHERE num_hit_tokens > 0) AS hit_lookups,
               count(*) FILTER (WHERE coalesce(num_hit_tokens, 0) = 0) AS miss_lookups,
               sum(num_hit_tokens) AS hit_tokens, sum(num_query_tokens) AS query_tokens,
               sum(num_hit_tokens) / nullif(sum(num_query_tokens), 0) AS hit_rate,
               count(DISTINCT request_id) AS requests,
               min(start_ns) AS first_ns, max(start_ns) AS last_ns
        FROM lookup_spans WHERE run_id = $run_id AND name = '{SPAN_LOOKUP}' AND root_hash IS NOT NULL
        GROUP BY root_hash ORDER BY lookups DESC, root_hash LIMIT $top""", params={"top": int(top)})
