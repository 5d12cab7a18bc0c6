"""Capacity curves (``kvtrace curve``) and where the store's engine runs sit on them."""

from __future__ import annotations

import polars as pl

from kvtrace.store.read._api import checked
from kvtrace.store.read._sql import DB, connect, query
from kvtrace.store.schema import CURVE_COLUMNS


@checked
def curves(db: DB) -> pl.DataFrame:
    """Every recorded curve point (``CURVE_COLUMNS`` plus prefix_cache_hit_rate), newest curve
    first, each curve's newest recording alone (a ClickHouse store adds a recording before it
    deletes the earlier one: a kill between the two leaves both); empty for a store written
    before curves existed."""
    with connect(db) as con:
        present = query(con, "SELECT count(*) AS n FROM duckdb_tables() WHERE table_name = 'curves'")["n"][0]
        if not present:
            return pl.DataFrame(schema={c: pl.String if t == "VARCHAR" else pl.Int64 for c, t in CURVE_COLUMNS.items()}
                                | {"prefix_cache_hit_rate": pl.Float64})
        return query(con, f"""
            SELECT {', '.join(CURVE_COLUMNS)},
                   CASE WHEN prompt_tokens > 0 THEN hit_tokens / prompt_tokens END AS prefix_cache_hit_rate
            FROM curves
            JOIN (SELECT curve_id AS newest_id, max(coalesce(created, '')) AS newest FROM curves GROUP BY curve_id)
              AS recordings ON curve_id = newest_id AND coalesce(created, '') = newest
            ORDER BY created DESC, curve_id, policy, capacity_blocks NULLS LAST""")


@checked
def capacity_marks(db: DB, trace_digest: str) -> pl.DataFrame:
    """The complete runs of one trace, to mark on its curve: run_id, name, mode, config
    (JSON text: where the capacity is) and prefix_cache_hit_rate."""
    with connect(db) as con:
        return query(con, """
            SELECT run_id, name, mode, CAST(config AS VARCHAR) AS config,
                   TRY_CAST(json_extract(summary, '$.prefix_cache_hit_rate') AS DOUBLE) AS prefix_cache_hit_rate
            FROM runs
            WHERE trace_digest = $digest AND status = 'complete'
            ORDER BY run_id""", {"digest": trace_digest})
