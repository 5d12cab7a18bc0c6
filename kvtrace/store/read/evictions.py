"""Evictions: blocks evicted per window, reason and the publish that took their place;
miss attribution (which eviction caused a later miss); block lifetime histograms."""

from __future__ import annotations

import polars as pl

from kvtrace.store.read._api import BadArgument, checked
from kvtrace.store.read._sql import DB, derived_relation, with_run
from kvtrace.store.schema import SPAN_EVICT

_EVICTION_KEYS = {"reason": "reason", "publish_kind": "coalesce(publish_kind, 'none')"}


@checked
def evictions_over_time(db: DB, run_id: str, window_ns: int | None = None, by: str = "reason") -> pl.DataFrame:
    """Evicted blocks per window (columns window_start_ns, key, blocks), keyed by eviction
    reason (``by="reason"``) or by the kind of the publish that next took each block
    (``by="publish_kind"``; 'none' when no publish took it)."""
    if by not in _EVICTION_KEYS:
        raise BadArgument("evictions_over_time", "by", f"expected 'reason' or 'publish_kind', got {by!r}")
    return with_run(db, run_id, lambda status: f"""
        SELECT evict_ns // $w * $w AS window_start_ns, {_EVICTION_KEYS[by]} AS key, sum(blocks) AS blocks
        FROM {derived_relation("evict_counts", status)} GROUP BY ALL ORDER BY window_start_ns, key""",
                    window_ns=window_ns)


@checked
def evictions_by_reason(db: DB, run_id: str) -> pl.DataFrame:
    """Total evicted blocks (and spans) per eviction reason, with each reason's share.
    Columns: reason, blocks, spans, share."""
    return with_run(db, run_id, f"""
        SELECT evict_reason AS reason, sum(num_blocks) AS blocks,
               count(*) AS spans, blocks / sum(blocks) OVER () AS share
        FROM cache_spans WHERE run_id = $run_id AND name = '{SPAN_EVICT}'
        GROUP BY ALL ORDER BY blocks DESC, reason""")


@checked
def evictions_by_publish_kind(db: DB, run_id: str) -> pl.DataFrame:
    """Evicted blocks per kind of the publish that took the block next ('none' if none).
    Columns: publish_kind, blocks, share."""
    return with_run(db, run_id, lambda status: f"""
        SELECT coalesce(publish_kind, 'none') AS publish_kind, sum(blocks) AS blocks,
               sum(blocks) / sum(sum(blocks)) OVER () AS share
        FROM {derived_relation("evict_counts", status)} GROUP BY ALL ORDER BY blocks DESC, publish_kind""")


@checked
def eviction_attribution(db: DB, run_id: str, limit: int | None = None) -> pl.DataFrame:
    """For each lookup miss on a block that was cached before: the eviction that removed
    it (the latest eviction of that hash in group 0 before the miss) and the publish that
    took its block id next. The first ``limit`` misses, or all.

    Columns: miss_seq, miss_ns, miss_request_id, root_hash, missed_hash, missed_index,
    evict_span_id, evict_ns, evict_reason, block_id, age, idle, evict_request_id,
    publish_span_id, publish_ns, publish_kind, publish_request_id.
    """
    return with_run(db, run_id, lambda status: f"""
        SELECT miss_seq, miss_ns, miss_request_id, root_hash, missed_hash, missed_index, evict_span_id,
               evict_ns, evict_reason, block_id, age, idle, evict_request_id, publish_span_id, publish_ns,
               publish_kind, publish_request_id
        FROM {derived_relation("miss_attribution", status)} ORDER BY miss_seq LIMIT $limit""",
                    params={"limit": None if limit is None else int(limit)})  # LIMIT NULL: every row


@checked
def eviction_attribution_flows(db: DB, run_id: str, top_prefixes: int = 10) -> pl.DataFrame:
    """Sankey input: (publish_kind, evict_reason, prefix) -> misses, where prefix is one of
    the ``top_prefixes`` root hashes with most attributed misses, or 'other'.
    Columns: publish_kind, evict_reason, prefix, misses."""
    return with_run(db, run_id, lambda status: f"""
        WITH a AS (SELECT * FROM {derived_relation("miss_attribution", status)}),
        top AS (SELECT root_hash FROM a GROUP BY root_hash ORDER BY count(*) DESC, root_hash LIMIT $top)
        SELECT coalesce(publish_kind, 'none') AS publish_kind, evict_reason,
               CASE WHEN root_hash IN (SELECT root_hash FROM top) THEN root_hash ELSE 'other' END AS prefix,
               count(*) AS misses
        FROM a GROUP BY ALL ORDER BY misses DESC, publish_kind, evict_reason, prefix""",
                    params={"top": int(top_prefixes)})


@checked
def block_histograms(db: DB, run_id: str, bins: int = 40) -> pl.DataFrame:
    """Histograms (in scheduler steps) of block lifetime at eviction, idle time before
    eviction, and prefix reuse gap (steps between consecutive requests' first lookups of a
    root hash, counted at the requests whose lookup of it hit). Integer bins [bin_lo, bin_hi), at most ``bins`` per
    metric. Columns: metric, bin_lo, bin_hi, count."""
    return with_run(db, run_id, lambda status: f"""
        WITH v AS (SELECT metric, x, n FROM {derived_relation("block_values", status)}),
        r AS (SELECT metric, min(x) AS lo, greatest(ceil((max(x) - min(x) + 1) / $bins), 1)::BIGINT AS width
              FROM v GROUP BY metric),
        b AS (SELECT v.metric, r.lo, r.width, (v.x - r.lo) // r.width AS i, v.n FROM v JOIN r USING (metric))
        SELECT metric, lo + i * width AS bin_lo, lo + (i + 1) * width AS bin_hi, sum(n) AS count
        FROM b GROUP BY metric, lo, width, i ORDER BY metric, bin_lo""", params={"bins": max(1, int(bins))})
