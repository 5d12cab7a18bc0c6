"""Runs: the runs table with each run's effective status, one run, span counts per name."""

from __future__ import annotations

import json
from typing import Any

import polars as pl

from kvtrace.metrics import summary_problem
from kvtrace.store.backend import is_clickhouse
from kvtrace.store.errors import DAMAGED, StoreError, UnknownRunError
from kvtrace.store.liveness import shown_status
from kvtrace.store.read._api import checked
from kvtrace.store.read._sql import DB, connect, derived_relation, query, with_run

_RUNS_SQL = """
    SELECT r.run_id, r.name, r.created, r.trace_source, r.trace_digest, r.mode,
           CAST(r.behaviours AS VARCHAR) AS behaviours, r.status, r.digest,
           CAST(r.config AS VARCHAR) AS config, CAST(r.summary AS VARCHAR) AS summary,
           r.writer_pid, r.writer_host, r.writer_start,
           coalesce(live.n, stats.n, 0) AS num_spans, coalesce(stats.bad, 0) AS stats_bad,
           stats.run_id IS NOT NULL AS has_stats
    FROM runs r
    LEFT JOIN (SELECT run_id, CAST(sum(spans) AS BIGINT) AS n,
                      -- (what finish_run never writes: check_derived says so for every reader)
                      count(*) FILTER (WHERE name IS NULL OR spans IS NULL OR blocks IS NULL
                                       OR spans < 1 OR blocks < 0) AS bad
               FROM span_stats GROUP BY run_id) stats
           USING (run_id)
    LEFT JOIN (SELECT run_id, count(*) AS n FROM spans
               WHERE run_id IN (SELECT run_id FROM runs WHERE status = 'running')
               GROUP BY run_id) live USING (run_id)"""

# A numbered id's digits (leading zeros read as the number, as ``schema.next_run_id`` counts them)
_RUN_NUMBER = pl.col("run_id").cast(pl.String).str.extract(r"^r([0-9]+)$", 1).str.strip_chars_start("0")


DAMAGED_STATUS = "damaged"  # a run whose record holds values kvtrace never writes (``damage`` says which)


@checked
def runs(db: DB) -> pl.DataFrame:
    """All runs, newest first, with effective status (a dead writer's run reads ``incomplete``).

    Columns: run_id, name, created, trace_source, trace_digest, mode, behaviours, status,
    digest, config, summary (the JSON fields as text, each checked by ``run_json``),
    writer_pid, num_spans, damage. A run whose record fails those checks is listed with
    status ``damaged``, its JSON fields null and ``damage`` the one-line problem (None for
    every other run); ``run`` of it raises that StoreError. One damaged record made every
    run of the store unreadable.
    """
    with connect(db) as con:
        frame = query(con, _RUNS_SQL)
    # Newest first; runs of one second by number, r10 above r9 (SQL's run_id DESC compared
    # text, r9 above r10), compared as digit strings (no integer overflows), then by id: the
    # same order from every backend, sorted here rather than in each one's SQL
    frame = frame.with_columns(_digits=_RUN_NUMBER).with_columns(_length=pl.col("_digits").str.len_chars())
    frame = frame.sort(["created", "_length", "_digits", "run_id"], descending=True, nulls_last=True)
    frame = frame.drop("_digits", "_length")
    status: list[str] = []
    damage: list[str | None] = []
    for row in frame.iter_rows(named=True):
        try:
            for key in JSON_FIELDS:
                run_json(db, row["run_id"], key, row[key])
            shown = shown_status(row["status"], row["writer_pid"], row["writer_host"], row["writer_start"],
                                 db=str(db), run_id=row["run_id"])
            _check_span_stats(db, row)
            status.append(shown)
            damage.append(None)
        except StoreError as err:
            status.append(DAMAGED_STATUS)
            damage.append(str(err))
    frame = frame.with_columns(pl.Series("status", status, dtype=pl.String),
                               pl.Series("damage", damage, dtype=pl.String)).drop("stats_bad", "has_stats")
    if any(damage):
        hurt = pl.col("damage").is_not_null()
        frame = frame.with_columns(*(pl.when(hurt).then(None).otherwise(pl.col(k)).alias(k) for k in JSON_FIELDS),
                                   pl.when(hurt).then(None).otherwise(pl.col("writer_pid")).alias("writer_pid"))
    return frame.drop("writer_host", "writer_start")


def _check_span_stats(db: DB, row: dict[str, Any]) -> None:
    """A finished run's span_stats rows, where ``runs`` reads its span count, as
    ``_sql.check_derived`` checks them for every other reader: no NULL or negative count,
    and rows wherever its stored summary counts spans (``runs`` said 0 spans where ``diff``
    said 1,593): a replay's summary counts the spans it stored (a collected run's, those its
    sender emitted, which a collector may not all have had). DuckDB only, as there."""
    if row["status"] == "running" or is_clickhouse(db):
        return
    summary = run_json(db, row["run_id"], "summary", row["summary"]) or {}
    replayed = row["mode"] in ("engine", "cache-only")
    counted = summary.get("spans") if replayed and isinstance(summary.get("spans"), int) else 0
    if row["stats_bad"]:
        what = "derived table span_stats holds NULL or negative counts"
    elif counted and not row["has_stats"]:
        what = "derived table span_stats holds none of its rows, beside its spans"
    else:
        return
    raise StoreError(str(db), f"{DAMAGED}: run {row['run_id']} ({row['status']}): {what} (finish_run writes them "
                              "from the spans; a store edited since?)")


# The JSON fields of a run record, and what each must decode to: a JSON object (config,
# summary), or the behaviours' names (a list of them; an object keyed by them).
JSON_FIELDS = ("config", "behaviours", "summary")
_SHAPES: dict[str, tuple[tuple[type, ...], str]] = {
    "config": ((dict,), "a JSON object"),
    "behaviours": ((list, dict), "a JSON list of names or an object"),
    "summary": ((dict,), "a JSON object"),
}


@checked
def run_json(db: DB, run_id: str, key: str, text: str | None) -> Any:
    """The decoded JSON field ``key`` (config, behaviours, summary) of a run record: None for
    SQL NULL, else the value, checked to have its shape. Anything else (not JSON, JSON
    ``null``, a number where an object belongs) is a damaged store: StoreError naming ``db``.
    The one place a run's JSON fields read back from a store are decoded."""
    if text is None:
        return None
    kinds, shape = _SHAPES[key]
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        raise StoreError(str(db), f"damaged kvtrace store: run {run_id}'s {key} is not JSON "
                                  f"({_clip(text)})") from None
    except RecursionError:  # (nested deeper than Python's decoder goes: no record kvtrace writes)
        raise StoreError(str(db), f"damaged kvtrace store: run {run_id}'s {key} is nested too deeply") from None
    names = value if key == "behaviours" and isinstance(value, list) else []
    if not isinstance(value, kinds) or not all(isinstance(v, str) for v in names):
        raise StoreError(str(db), f"damaged kvtrace store: run {run_id}'s {key} is {_clip(text)}, "
                                  f"expected {shape}")
    # a count, rate or time kvtrace never writes ("many", Infinity, a rate of 7.5): each view
    # showed it its own way (text, inf%, null) or read the spans instead
    problem = summary_problem(value) if key == "summary" and isinstance(value, dict) else None
    if problem is not None:
        raise StoreError(str(db), f"damaged kvtrace store: run {run_id}'s summary: {problem}")
    return value


def _clip(text: Any, limit: int = 40) -> str:
    shown = repr(text) if not isinstance(text, str) else text
    shown = " ".join(shown.split())  # one line
    return shown if len(shown) <= limit else f"{shown[:limit]}..."


@checked
def run(db: DB, run_id: str) -> dict[str, Any]:
    """One row of ``runs`` as a dict; ``config``, ``behaviours`` and ``summary`` decoded by ``run_json``."""
    frame = runs(db).filter(pl.col("run_id") == run_id)
    if frame.height == 0:
        raise UnknownRunError(str(db), run_id)
    out = frame.row(0, named=True)
    if out["damage"] is not None:  # (its problem, as the check said it)
        raise StoreError(str(db), out["damage"].removeprefix(f"{db}: "))
    for key in JSON_FIELDS:
        out[key] = run_json(db, run_id, key, out[key])
    return out


@checked
def span_counts(db: DB, run_id: str) -> pl.DataFrame:
    """Per span name: spans and blocks covered (headline counts for the Overview).
    Columns: name, spans, blocks."""
    return with_run(db, run_id, lambda status: f"""
        SELECT name, spans, blocks FROM {derived_relation("span_stats", status)} ORDER BY name""")
