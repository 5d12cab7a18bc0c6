"""`kvtrace collect` and a run its ``kvtrace.run`` record finished: the store marks it so
(``recorded_runs``), so the first record stands after a restart whatever it said. A record of its
status alone left the run's row as a collector's close leaves it, and a second record, sent to a
restarted collector, finished the run again (its status, digest and summary replaced), on a DuckDB
store and on a chdb store alike. A store made before the mark still opens, and gains it."""

from __future__ import annotations

import json

import duckdb
import pytest

from kvtrace.instrument.otlp import OTLPCollector
from kvtrace.store import Store
from kvtrace.store.backend import clickhouse_target
from kvtrace.store.clickhouse import client
from kvtrace.store.read import run, runs
from tests.instrument.helpers import post_otlp_json
from tests.instrument.test_collect_records_rec32 import _collect, _named, _record, _span

SECOND = {"status": "failed", "digest": "d2", "summary": json.dumps({"requests": 2})}


def _db(tmp_path, kind: str) -> str:
    return str(tmp_path / "c.duckdb") if kind == "duckdb" else f"chdb:{tmp_path / 'ch'}"


# (chdb, slow, takes one case of each status: with spans)
CASES = [(k, s, sp) for k in ("duckdb", "chdb") for s in ("complete", "incomplete") for sp in (True, False)
         if k == "duckdb" or sp]


@pytest.mark.parametrize("kind, status, spans", CASES)
def test_a_record_of_its_status_alone_stands_after_a_restart(tmp_path, kind, status, spans):
    db = _db(tmp_path, kind)
    _collect(db, _named("r", [_span(0)] * spans + [_record(status=status)], 1))
    assert (run(db, "r")["status"], run(db, "r")["digest"]) == (status, None)
    again = _collect(db, _named("r", [_record(**SECOND)], 11))
    got = run(db, "r")
    assert (got["status"], got["digest"], got["summary"], again.runs_recorded) == (status, None, None, 0)


def test_a_run_a_collector_closed_is_still_finished_by_its_record_after_a_restart(tmp_path):
    """(no mark: the run's record had not come)"""
    db = _db(tmp_path, "duckdb")
    _collect(db, _named("r", [_span(0)], 1))
    again = _collect(db, _named("r", [_record(**SECOND)], 11))
    got = run(db, "r")
    assert (got["status"], got["digest"], again.runs_recorded) == ("failed", "d2", 1)
    third = _collect(db, _named("r", [_record(status="complete", digest="d3")], 21))
    assert (run(db, "r")["digest"], third.runs_recorded) == ("d2", 0)


def _tables(db: str) -> set[str]:
    with duckdb.connect(db, read_only=True) as con:
        return {r[0] for r in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()}


def test_a_store_made_before_the_mark_opens_and_gains_it(tmp_path):
    db = _db(tmp_path, "duckdb")
    _collect(db, _named("r", [_span(0), _record(status="failed", digest="d1")], 1))
    _collect(db, _named("s", [_span(0)], 1))
    with duckdb.connect(db) as con:  # (as a store written before recorded_runs holds it)
        con.execute("DROP TABLE IF EXISTS recorded_runs")
    assert "recorded_runs" not in _tables(db)
    assert dict(runs(db).select("run_id", "status").rows()) == {"r": "failed", "s": "complete"}  # (read as whole)
    # a writer adds it; a run recorded before it keeps what its row says (failed, a digest)
    again = _collect(db, _named("r", [_record(**SECOND | {"status": "complete"})], 11),
                     _named("s", [_record(**SECOND)], 11))
    assert "recorded_runs" in _tables(db)
    assert (run(db, "r")["digest"], run(db, "s")["digest"], again.runs_recorded) == ("d1", "d2", 1)
    third = _collect(db, _named("s", [_record(status="complete", digest="d3")], 21))
    assert (run(db, "s")["status"], run(db, "s")["digest"], third.runs_recorded) == ("failed", "d2", 0)


def test_a_chdb_store_made_before_the_mark_opens_and_gains_it(tmp_path):
    db = _db(tmp_path, "chdb")
    _collect(db, _named("s", [_span(0)], 1))
    with client.connect(clickhouse_target(db)) as con:
        con.command("DROP TABLE IF EXISTS recorded_runs")
    assert dict(runs(db).select("run_id", "status").rows()) == {"s": "complete"}
    Store.open(db).close()  # (a process that laid it out before opens it again: the catalog changed since)
    with client.connect(clickhouse_target(db)) as con:
        assert "recorded_runs" in con.table_names()
    _collect(db, _named("s", [_record(status="complete")], 11))
    again = _collect(db, _named("s", [_record(**SECOND)], 21))
    assert (run(db, "s")["status"], run(db, "s")["digest"], again.runs_recorded) == ("complete", None, 0)


def test_a_record_whose_finish_failed_still_finishes_its_run_after_a_restart(tmp_path, monkeypatch):
    """Its name was written before the finish that failed: a restarted collector took the run's row for
    one a record had finished, and the record sent again finished nothing (the run stayed incomplete)."""
    db = _db(tmp_path, "duckdb")
    collector = OTLPCollector(db, port=0).start()
    finish = collector.store._finish

    def fails_for_r(run_id, *args):
        if run_id == "r":
            raise ValueError("derived tables: overflow")
        return finish(run_id, *args)

    monkeypatch.setattr(collector.store, "_finish", fails_for_r)
    doc = _named("r", [_span(0), _record(status="complete", name="mine", digest="d1")], 1)
    try:
        assert post_otlp_json(collector.url, doc)[0] == 200
    finally:
        collector.stop()
    monkeypatch.undo()
    with duckdb.connect(db) as con:  # (what a restarted process's recovery makes of it: its writer is gone)
        con.execute("UPDATE runs SET status = 'incomplete' WHERE run_id = 'r' AND status = 'running'")
    again = _collect(db, _named("r", [_record(status="complete", name="mine", digest="d1")], 11))
    got = run(db, "r")
    assert (got["status"], got["digest"], got["name"], again.runs_recorded) == ("complete", "d1", "mine", 1)


def test_a_chdb_mark_that_cannot_be_written_leaves_the_run_finished_and_described(tmp_path, monkeypatch):
    """chdb has no transaction: the mark is written after the finish, best effort (a failure there
    was told as a finish that failed, the record's name and config dropped and the run not counted)."""
    from kvtrace.store.errors import StoreError

    db = _db(tmp_path, "chdb")
    insert = client.ClickHouseConnection.insert_arrow

    def no_mark(self, table, rows):
        if table == "recorded_runs":
            raise StoreError(db, "ClickHouse refused an insert into recorded_runs: No space left on device")
        return insert(self, table, rows)

    monkeypatch.setattr(client.ClickHouseConnection, "insert_arrow", no_mark)
    got = _collect(db, _named("r", [_span(0), _record(status="complete", name="mine", digest="d1")], 1))
    monkeypatch.undo()
    row = run(db, "r")
    assert (row["status"], row["digest"], row["name"], got.runs_recorded) == ("complete", "d1", "mine", 1)
