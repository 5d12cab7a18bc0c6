"""Hits: vLLM's hit counters (``kvtrace.metrics``) per window and over a time range, the
per-group hit rates, block-pool usage, and the hottest prefixes."""

from __future__ import annotations

from typing import Any

import polars as pl

from kvtrace import metrics
from kvtrace.store.errors import StoreError
from kvtrace.store.read._api import checked
from kvtrace.store.read._sql import DB, with_run
from kvtrace.store.schema import INFERRED_ATTRIBUTE, SPAN_COLUMN_DEFS, SPAN_LOOKUP, SPAN_REQUEST, SPAN_STEP

# kvtrace.lookup.hit_tokens_per_group
_HIT_TOKENS_PER_GROUP = next(c.attr for c in SPAN_COLUMN_DEFS if c.name == "hit_tokens_per_group")

# Each request once, when it was first scheduled (vLLM counts at admission): engine runs
# read their request spans; a run without request spans (cache-only) has exactly one
# lookup per request, which is that request. An engine run killed before any request
# finished has none either, but its lookups include the retries of requests that waited
# for blocks (and never-admitted ones): it counts no request, as a killed run counts only
# its finished ones. An engine run is known by its mode, or where its record names none (a
# collected run's: 306 "requests" of a 60-request trace, its retries) by step spans with a
# scheduler's state (a cache-only run's steps, one a request, have no running count).
# Columns: t (the first schedule), then the kvtrace.metrics.PER_REQUEST fields.
_LOOKUPS_ARE_REQUESTS = ("NOT EXISTS (SELECT 1 FROM req) AND "
                         "NOT EXISTS (SELECT 1 FROM runs WHERE run_id = $run_id AND mode = 'engine') AND "
                         f"NOT EXISTS (SELECT 1 FROM step_spans WHERE run_id = $run_id AND name = '{SPAN_STEP}' "
                         "AND num_running IS NOT NULL)")
_ADMISSIONS = f"""
    req AS (
        SELECT request_id, coalesce(first_scheduled_ns, arrival_ns, start_ns) AS t,
               num_prompt_tokens AS {metrics.PROMPT}, num_hit_tokens AS {metrics.LOCAL_HIT},
               num_external_hit_tokens AS {metrics.EXTERNAL_HIT},
               num_external_query_tokens AS {metrics.EXTERNAL_QUERY},
               num_preempted_query_tokens AS {metrics.PREEMPTED_QUERY},
               num_preempted_hit_tokens AS {metrics.PREEMPTED_HIT}
        FROM request_spans WHERE run_id = $run_id AND name = '{SPAN_REQUEST}'
    ),
    admissions AS (
        SELECT * FROM req
        UNION ALL
        SELECT request_id, start_ns, num_query_tokens, num_hit_tokens, num_external_hit_tokens, 0, 0, 0
        FROM lookup_spans
        WHERE run_id = $run_id AND name = '{SPAN_LOOKUP}' AND {_LOOKUPS_ARE_REQUESTS}
    )"""
_COUNTERS_SQL = ",\n               ".join(
    f'{expr} AS "{key}"' for key, expr in metrics.counter_sql({f: f for f in metrics.PER_REQUEST}).items())


def _with_rates(frame: pl.DataFrame, prefix: str = "") -> pl.DataFrame:
    """kvtrace.metrics.RATES as columns (``prefix``: "cum_" for the cumulative ones)."""
    return frame.with_columns(
        pl.when(pl.col(prefix + r.denominator) > 0)
        .then(pl.col(prefix + r.numerator) / pl.col(prefix + r.denominator))
        .otherwise(None).cast(pl.Float64).alias(prefix + r.key)
        for r in metrics.RATES)


@checked
def hit_counters_over_time(db: DB, run_id: str, window_ns: int | None = None) -> pl.DataFrame:
    """vLLM's hit counters per window of first-schedule time (``kvtrace.metrics``, the one
    definition): each request once, in the window it was first scheduled in.

    Columns: window_start_ns, requests, every ``metrics.COUNTER_KEYS`` counter
    (``prompt_tokens_by_source.local_compute`` ...), every ``metrics.RATE_KEYS`` rate,
    then ``cum_`` + each counter and rate: their running totals from the run's start.
    """
    frame = with_run(db, run_id, f"""
        WITH {_ADMISSIONS}
        SELECT t // $w * $w AS window_start_ns, count(*) AS requests,
               {_COUNTERS_SQL}
        FROM admissions GROUP BY ALL ORDER BY window_start_ns""", window_ns=window_ns)
    frame = _with_rates(frame)
    frame = frame.with_columns(pl.col(k).cum_sum().alias(f"cum_{k}") for k in ("requests", *metrics.COUNTER_KEYS))
    return _with_rates(frame, "cum_")


@checked
def hit_counters(db: DB, run_id: str, start_ns: int | None = None, end_ns: int | None = None) -> dict[str, Any]:
    """vLLM's hit counters and rates over the requests first scheduled in [start_ns,
    end_ns) (None: open), as one dict: requests, each counter, each rate. The whole run's
    equal the run summary's."""
    frame = with_run(db, run_id, f"""
        WITH {_ADMISSIONS}
        SELECT count(*) AS requests, {_COUNTERS_SQL}
        FROM admissions WHERE ($t0 IS NULL OR t >= $t0) AND ($t1 IS NULL OR t < $t1)""",
                     params={"t0": start_ns, "t1": end_ns})
    row = {k: int(v or 0) for k, v in frame.row(0, named=True).items()}
    negative = [k for k, v in row.items() if v < 0]
    if negative:  # (a request span without its prompt length, or with more hits than prompt, as kvtrace writes none)
        raise StoreError(str(db), f"damaged kvtrace store: run {run_id}'s request spans give {negative[0]} "
                                  f"{row[negative[0]]:,} (more hit tokens than prompt tokens, or a prompt length "
                                  "missing)")
    return {**row, **metrics.hit_rates(row)}


# The lookup that admitted each request (engine runs: its first lookup at or after its
# first schedule, the one vLLM records; earlier ones failed to allocate), with its
# per-group hits; cache-only runs: every lookup (as above). t is the first schedule.
# A lookup whose per-group hits its backend inferred (a ``--backend vllm`` run recorded before
# its adapter asked vLLM for each group's own hit wrote the groups' common hit into every
# group) says nothing of a group alone: it still decides which lookup admitted a request, and
# ``inferred`` leaves it out of every per-group figure (such a run's "attention group hit
# rate" was the request hit rate, 16.3%, where kvtrace's backend on the same hits said 46.4%).
_PER_GROUP_INFERRED = f"extra_attributes['{INFERRED_ATTRIBUTE}'] LIKE '%\"{_HIT_TOKENS_PER_GROUP}\"%'"
_ADMISSION_LOOKUPS = f"""
    req AS (
        SELECT request_id, coalesce(first_scheduled_ns, arrival_ns, start_ns) AS t
        FROM request_spans WHERE run_id = $run_id AND name = '{SPAN_REQUEST}'
    ),
    lk AS (
        SELECT request_id, start_ns, seq, num_query_tokens, hit_tokens_per_group AS g,
               coalesce({_PER_GROUP_INFERRED}, false) AS inferred
        FROM lookup_spans WHERE run_id = $run_id AND name = '{SPAN_LOOKUP}'
    ),
    adm AS (
        SELECT req.t, lk.num_query_tokens AS q, lk.g, lk.inferred FROM lk JOIN req USING (request_id)
        WHERE lk.start_ns >= req.t
        QUALIFY row_number() OVER (PARTITION BY lk.request_id ORDER BY lk.start_ns, lk.seq) = 1
        UNION ALL
        SELECT start_ns, num_query_tokens, g, inferred FROM lk WHERE {_LOOKUPS_ARE_REQUESTS}
    )"""


@checked
def group_hit_rate_over_time(db: DB, run_id: str, window_ns: int | None = None) -> pl.DataFrame:
    """Attention / state *group* hit rate per window (``metrics.GROUP_HIT_RATE_DOC``): for
    each KV group, the hit tokens that group alone found at each request's admission
    lookup, over the same prefix_cache_queries as the request hit rate. Not the request
    hit rate. Columns: window_start_ns, group_id, prefix_cache_queries, group_hit_tokens,
    group_hit_rate, cum_prefix_cache_queries, cum_group_hit_tokens, cum_group_hit_rate."""
    return with_run(db, run_id, f"""
        WITH {_ADMISSION_LOOKUPS},
        per AS (
            SELECT t // $w * $w AS window_start_ns, unnest(range(len(g))) AS group_id, q, unnest(g) AS h
            FROM adm WHERE NOT inferred
        ),
        w AS (
            SELECT window_start_ns, CAST(group_id AS INTEGER) AS group_id,
                   CAST(sum(q) AS BIGINT) AS prefix_cache_queries, CAST(sum(h) AS BIGINT) AS group_hit_tokens
            FROM per GROUP BY ALL
        )
        SELECT window_start_ns, group_id, prefix_cache_queries, group_hit_tokens,
               group_hit_tokens / nullif(prefix_cache_queries, 0) AS group_hit_rate,
               CAST(sum(prefix_cache_queries) OVER c AS BIGINT) AS cum_prefix_cache_queries,
               CAST(sum(group_hit_tokens) OVER c AS BIGINT) AS cum_group_hit_tokens,
               sum(group_hit_tokens) OVER c / nullif(sum(prefix_cache_queries) OVER c, 0) AS cum_group_hit_rate
        FROM w WINDOW c AS (PARTITION BY group_id ORDER BY window_start_ns)
        ORDER BY group_id, window_start_ns""", window_ns=window_ns)


@checked
def group_hit_rates(db: DB, run_id: str) -> dict[int, float | None]:
    """The whole run's group hit rate per KV group (see group_hit_rate_over_time)."""
    frame = with_run(db, run_id, f"""
        WITH {_ADMISSION_LOOKUPS},
        per AS (SELECT unnest(range(len(g))) AS group_id, q, unnest(g) AS h FROM adm WHERE NOT inferred)
        SELECT CAST(group_id AS INTEGER) AS group_id, sum(h) AS hits, sum(q) AS queries
        FROM per GROUP BY group_id ORDER BY group_id""")
    return {int(g): metrics.ratio(h, q) for g, h, q in frame.iter_rows()}


@checked
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


@checked
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


@checked
def prefix_families(db: DB, run_id: str, root_hashes: list[str]) -> pl.DataFrame:
    """What names a prefix family (root hash of the first full block) for a reader: the
    request that first looked it up, its prompt length, and the longest hit any lookup of
    the family got. Columns: root_hash, first_request_id, first_prompt_tokens,
    longest_hit_tokens, lookups."""
    return with_run(db, run_id, f"""
        SELECT root_hash, arg_min(request_id, seq) AS first_request_id,
               arg_min(num_query_tokens, seq) AS first_prompt_tokens,
               max(coalesce(num_hit_tokens, 0)) AS longest_hit_tokens, count(*) AS lookups
        FROM lookup_spans
        WHERE run_id = $run_id AND name = '{SPAN_LOOKUP}' AND list_contains($roots, root_hash)
        GROUP BY root_hash ORDER BY root_hash""", params={"roots": [str(h) for h in root_hashes]})
