"""Per-run derived tables, as SQL shared by finish_run (materialise) and readers (live runs).

``evicted_blocks``: one row per evicted block, with the publish that next took the same
block id (same group) before that block id was evicted again: "the publish that took its
place". Order within a run is ``seq`` (append order), which breaks the ties of spans
sharing one step's virtual timestamp.
"""

from __future__ import annotations

from kvtrace.store.schema import SPAN_EVICT, SPAN_PUBLISH

# $run_id is the only parameter.
EVICTED_BLOCKS_SELECT = f"""
WITH ev AS (
    SELECT run_id, seq AS evict_seq, span_id AS evict_span_id, start_ns AS evict_ns, step,
           coalesce(group_id, 0) AS group_id,
           unnest(block_ids) AS block_id, unnest(block_hashes) AS block_hash,
           evict_reason AS reason, unnest(ages) AS age, unnest(idle) AS idle,
           request_id AS evict_request_id
    FROM cache_spans WHERE run_id = $run_id AND name = '{SPAN_EVICT}'
),
ev_next AS (
    SELECT *, lead(evict_seq) OVER (PARTITION BY group_id, block_id ORDER BY evict_seq) AS next_evict_seq
    FROM ev
),
pub AS (
    SELECT seq AS publish_seq, span_id, start_ns, coalesce(group_id, 0) AS group_id,
           unnest(block_ids) AS block_id, publish_kind, request_id
    FROM cache_spans WHERE run_id = $run_id AND name = '{SPAN_PUBLISH}'
)
SELECT run_id, evict_seq, evict_span_id, evict_ns, step, group_id, block_id, block_hash,
       reason, age, idle, evict_request_id,
       CASE WHEN ok THEN publish_seq END AS next_publish_seq,
       CASE WHEN ok THEN pub_span_id END AS next_publish_span_id,
       CASE WHEN ok THEN pub_ns END AS next_publish_ns,
       CASE WHEN ok THEN publish_kind END AS next_publish_kind,
       CASE WHEN ok THEN pub_request_id END AS next_publish_request_id
FROM (
    SELECT e.*, p.publish_seq, p.span_id AS pub_span_id, p.start_ns AS pub_ns, p.publish_kind,
           p.request_id AS pub_request_id,
           p.publish_seq IS NOT NULL
             AND (e.next_evict_seq IS NULL OR p.publish_seq < e.next_evict_seq) AS ok
    FROM ev_next e
    ASOF LEFT JOIN pub p
      ON e.group_id = p.group_id AND e.block_id = p.block_id AND p.publish_seq > e.evict_seq
)
"""


def materialise(con, run_id: str) -> None:
    """(Re)build the derived rows of one run inside the caller's transaction."""
    con.execute("DELETE FROM evicted_blocks WHERE run_id = $run_id", {"run_id": run_id})
    con.execute(
        f"INSERT INTO evicted_blocks {EVICTED_BLOCKS_SELECT} ORDER BY evict_seq",
        {"run_id": run_id},
    )
