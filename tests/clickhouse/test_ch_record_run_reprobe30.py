"""A run whose export holds its ``kvtrace.run`` record and no stored span (a replay stopped
before its first span sends its 'failed' record alone; spans refused in requests of their own)
is listed by `kvtrace collect`, which makes the run of a record alone, and now by the ClickHouse
collector path too: its collected-runs view took spans other than the record alone, so `runs`
said the run did not exist there (re-probe 30)."""

from __future__ import annotations

import pytest

from kvtrace.store import read
from tests.clickhouse.test_ch_probe28 import REQUEST, _collected, _doc, _exported
from tests.instrument.test_otlp_fix27 import _av

pytest.importorskip("chdb")

RECORD = "kvtrace.run"


def _named(run_id: str, spans: list[tuple[str, dict]], first: int) -> dict:
    doc = _doc(spans, first=first)["resourceSpans"][0]
    doc["resource"]["attributes"].append({"key": "kvtrace.run.id", "value": _av(run_id)})
    return doc


def test_a_run_of_its_record_alone_is_listed_on_both_paths(tmp_path, chdb_store):
    failed = (RECORD, {"kvtrace.run.status": "failed", "kvtrace.run.name": "stopped early"})
    complete = (RECORD, {"kvtrace.run.status": "complete", "kvtrace.run.digest": "abc"})
    good = (REQUEST, {"kvtrace.request.id": "q", "gen_ai.usage.input_tokens": 30})
    docs = [_named("stopped", [failed], 1), _named("whole", [good], 11), _named("whole", [complete], 12)]
    collected = {}
    for i, doc in enumerate(docs):  # (one request each, as a kvtrace export sends its record apart)
        db, status = _collected(tmp_path, {"resourceSpans": [doc]}, f"c{i}") if i < 2 else (None, None)
        assert status in (200, None)
        if db is not None:
            collected.update({r["run_id"]: r["status"] for r in read.runs(db).select(["run_id", "status"]).to_dicts()})
    ch = _exported(chdb_store, {"resourceSpans": docs})
    listed = {r["run_id"]: r["status"] for r in read.runs(ch).select(["run_id", "status"]).to_dicts()}
    assert collected["stopped"] == listed["stopped"] == "failed"
    assert listed["whole"] == "complete" and set(listed) == {"stopped", "whole"}


def test_a_record_whose_envelope_collect_refuses_names_no_run(chdb_store):
    doc = _named("a b", [(RECORD, {"kvtrace.run.status": "complete"})], 1)  # (collect: 400, no run id)
    ch = _exported(chdb_store, {"resourceSpans": [doc]})
    assert read.runs(ch)["run_id"].to_list() == []
