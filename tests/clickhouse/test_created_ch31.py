"""A collected run's ``created`` on both collector paths: `kvtrace collect` gives a run the time
it made it (a record's ``created`` says otherwise), and the ClickHouse path gave none to a run
whose record carries none (a vLLM's spans, a lone 'failed' record): ``runs`` listed it without
a time. Now it is the time kvtrace first met the run (the open that registered it)."""

from __future__ import annotations

import datetime as dt

import pytest

from kvtrace.instrument.otlp import OTLPCollector
from kvtrace.store import read
from tests.clickhouse.test_ch_probe28 import _exported
from tests.clickhouse.test_ch_record_run_reprobe30 import _named
from tests.clickhouse.test_run_record_ch31 import _record, _span
from tests.instrument.helpers import post_otlp_json

pytest.importorskip("chdb")


def test_a_collected_run_has_a_creation_time_on_both_paths(tmp_path, chdb_store):
    requests = {"spans": [_span(0)], "lone": [_record(status="failed")],
                "dated": [_record(status="failed", created="2026-01-01T00:00:00+01:00")]}
    duck = tmp_path / "c.duckdb"
    before = dt.datetime.now(dt.UTC).replace(microsecond=0)
    docs = [_named(run_id, spans, 1 + 10 * i) for i, (run_id, spans) in enumerate(requests.items())]
    collector = OTLPCollector(duck, port=0).start()
    try:
        assert [post_otlp_json(collector.url, {"resourceSpans": [d]})[0] for d in docs] == [200] * 3
    finally:
        collector.stop()
    for db in (str(duck), _exported(chdb_store, {"resourceSpans": docs})):
        created = dict(read.runs(db).select(["run_id", "created"]).rows())
        assert created["dated"] == "2025-12-31T23:00:00+00:00", db
        for run_id in ("spans", "lone"):
            assert created[run_id] is not None and dt.datetime.fromisoformat(created[run_id]) >= before, db
