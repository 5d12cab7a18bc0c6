"""`kvtrace collect` and a run's ``kvtrace.run`` records: the first one stands, in one process and
after a restart on the same store (a restarted collector took a run finished by a record of its
status alone for one no record had finished, and a second record finished it again: its status,
digest and summary replaced); and what it prints of a run is true of what the store holds (a run
of its record alone, which holds no span)."""

from __future__ import annotations

import json
import logging

import pytest

from kvtrace.instrument.otlp import OTLPCollector
from kvtrace.store.read import run
from tests.clickhouse.test_ch_probe28 import _doc
from tests.instrument.helpers import post_otlp_json
from tests.instrument.test_otlp_fix27 import _av

SECOND = {"status": "complete", "digest": "d2", "summary": json.dumps({"requests": 2})}


def _named(run_id: str, spans: list[tuple[str, dict]], first: int) -> dict:
    doc = _doc(spans, first=first)["resourceSpans"][0]
    doc["resource"]["attributes"].append({"key": "kvtrace.run.id", "value": _av(run_id)})
    return {"resourceSpans": [doc]}


def _record(**fields) -> tuple[str, dict]:
    return "kvtrace.run", {f"kvtrace.run.{k}": v for k, v in fields.items()}


def _span(seq: int) -> tuple[str, dict]:
    return "kvtrace.request", {"kvtrace.request.id": f"q{seq}", "gen_ai.usage.input_tokens": 30, "kvtrace.seq": seq}


def _collect(db, *docs: dict) -> OTLPCollector:
    collector = OTLPCollector(db, port=0).start()
    try:
        for doc in docs:
            assert post_otlp_json(collector.url, doc)[0] == 200
    finally:
        collector.stop()
    return collector


_FIRST = {  # the first record: it says what only a record says, whatever else it leaves out
    "its status alone, failed": {"status": "failed"},
    "its name and status": {"status": "complete", "name": "stopped early"},
    "a trace digest": {"status": "incomplete", "trace_digest": "t1"},
    "a config": {"status": "complete", "config": json.dumps({"block_size": 16})},
}


@pytest.mark.parametrize("case", list(_FIRST))
@pytest.mark.parametrize("spans", [True, False])
def test_a_second_record_after_a_restart_finishes_nothing(tmp_path, case, spans):
    db = tmp_path / "c.duckdb"
    first = _FIRST[case]
    _collect(db, _named("r", [_span(0)] * spans + [_record(**first)], 1))
    before = run(db, "r")
    assert before["status"] == first["status"]
    again = _collect(db, _named("r", [_record(**SECOND)], 11))  # (one process answers it 200 and keeps the first)
    got = run(db, "r")
    assert (got["status"], got["digest"], got["summary"]) == (before["status"], None, None)
    assert again.runs_recorded == 0


def test_a_record_after_a_restart_still_finishes_a_run_a_collector_closed(tmp_path):
    """(as before: a run no record finished, closed by its collector, is finished by its record)"""
    db = tmp_path / "c.duckdb"
    _collect(db, _named("r", [_span(0)], 1))
    assert run(db, "r")["summary"] is None
    again = _collect(db, _named("r", [_record(**SECOND)], 11))
    got = run(db, "r")
    assert (got["status"], got["digest"], again.runs_recorded) == ("complete", "d2", 1)


def test_a_short_run_of_its_record_alone_is_said_to_hold_none_of_its_spans(tmp_path, caplog):
    caplog.set_level(logging.WARNING, "kvtrace.instrument.otlp.collector")
    db = tmp_path / "c.duckdb"
    _collect(db, _named("r", [_record(status="complete", summary=json.dumps({"spans": 3}))], 1))
    assert run(db, "r")["status"] == "incomplete"
    assert [r.getMessage() for r in caplog.records] == [
        "run r: its sender numbered 3 spans, 0 of them stored: incomplete until the rest come"]


def test_a_record_alone_that_cannot_be_finished_is_said_to_hold_no_span_and_is_not_counted(tmp_path, caplog,
                                                                                           monkeypatch):
    """The store failing to finish it (its derived tables): the log said "its spans are stored" of a
    run that holds none, and the closing line counted it among the runs finished by their records."""
    caplog.set_level(logging.WARNING, "kvtrace.instrument.otlp.collector")
    collector = OTLPCollector(tmp_path / "c.duckdb", port=0).start()
    finish = collector.store._finish

    def fails_for_r(run_id, *args):
        if run_id == "r":
            raise ValueError("derived tables: overflow")
        return finish(run_id, *args)

    monkeypatch.setattr(collector.store, "_finish", fails_for_r)
    try:
        assert post_otlp_json(collector.url, _named("r", [_record(status="failed")], 1))[0] == 200
    finally:
        collector.stop()
    assert collector.runs_recorded == 0
    assert [r.getMessage() for r in caplog.records] == [
        "run r: not finished (ValueError: derived tables: overflow); it holds no span"]
