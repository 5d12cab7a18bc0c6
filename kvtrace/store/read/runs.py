"""Runs: the runs table with each run's effective status, one run, span counts per name."""

from __future__ import annotations

import json
from typing import Any

import polars as pl

from kvtrace.store.errors import UnknownRunError
from kvtrace.store.liveness import writer_alive
from kvtrace.store.read._sql import DB, connect, derived_relation, query, with_run

_RUNS_SQL = """
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
    ORDER BY r.created DESC NULLS LAST, r.run_id DESC"""


def runs(db: DB) -> pl.DataFrame:
    """All runs, newest first, with effective status (a dead writer's run reads ``incomplete``).

    Columns: run_id, name, created, trace_source, trace_digest, mode, behaviours, status,
    digest, config, summary (the JSON fields as text), writer_pid, num_spans.
    """
    with connect(db) as con:
        frame = query(con, _RUNS_SQL)
    status = [
        "incomplete" if s == "running" and not writer_alive(p, h, t) else s
        for s, p, h, t in zip(frame["status"], frame["writer_pid"], frame["writer_host"], frame["writer_start"])
    ]
    return frame.with_columns(pl.Series("status", status, dtype=pl.String)).drop("writer_host", "writer_start")


def run(db: DB, run_id: str) -> dict[str, Any]:
    """One row of ``runs`` as a dict; ``config``, ``behaviours`` and ``summary`` parsed from JSON."""
    frame = runs(db).filter(pl.col("run_id") == run_id)
    if frame.height == 0:
        raise UnknownRunError(str(db), run_id)
    out = frame.row(0, named=True)
    for key in ("config", "behaviours", "summary"):
        out[key] = json.loads(out[key]) if out[key] is not None else None
    return out


def span_counts(db: DB, run_id: str) -> pl.DataFrame:
    """Per span name: spans and blocks covered (headline counts for the Overview).
    Columns: name, spans, blocks."""
    return with_run(db, run_id, lambda status: f"""
        SELECT name, spans, blocks FROM {derived_relation("span_stats", status)} ORDER BY name""")
