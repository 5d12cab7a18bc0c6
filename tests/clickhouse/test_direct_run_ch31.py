"""Spans an exporter sent naming a run of the store that no collector made (a replay's or a
capture's) are added to nothing, on both collector paths: `kvtrace collect` refuses them (a
400), and the ClickHouse path added them to the replay's run (every view of it counted them:
11 requests of a replay of 10); now its views leave them out, their reason in
``otel_refused_spans``."""

from __future__ import annotations

import pytest

from kvtrace.instrument.otlp import OTLPCollector
from kvtrace.store import Store, read
from kvtrace.store.backend import clickhouse_target
from kvtrace.store.clickhouse import client
from tests.clickhouse.test_ch_probe28 import _protobuf
from tests.clickhouse.test_ch_record_run_reprobe30 import _named
from tests.clickhouse.test_run_record_ch31 import _record, _span
from tests.instrument.helpers import post_otlp_json
from tests.support.collector_rows import collector_rows

pytest.importorskip("chdb")


def _direct(db: str) -> str:
    with Store.open(db) as store:
        run_id = store.create_run("direct", mode="engine")
        store.finish_run(run_id, status="complete", digest="d0")
    return run_id


def test_spans_naming_a_direct_run_are_added_to_nothing_on_either_path(tmp_path, chdb_store):
    duck = str(tmp_path / "c.duckdb")
    for db in (duck, chdb_store):
        assert _direct(db) == "r1"
    doc = {"resourceSpans": [_named("r1", [_span(0), _record(status="failed")], 1)]}
    collector = OTLPCollector(duck, port=0).start()
    try:
        status, message = post_otlp_json(collector.url, doc)
    finally:
        collector.stop()
    assert status == 400 and "no collector made" in message
    with client.connect(clickhouse_target(chdb_store)) as con:
        con.insert_arrow("otel_traces", collector_rows([_protobuf(doc)]))
    Store.open(chdb_store).close()
    for db in (duck, chdb_store):
        (run,) = read.runs(db).select(["run_id", "status", "digest", "num_spans"]).to_dicts()
        assert run == {"run_id": "r1", "status": "complete", "digest": "d0", "num_spans": 0}
        assert read.requests(db, "r1").height == 0
    with client.connect(clickhouse_target(chdb_store)) as con:
        (reason,) = con.ch_frame("SELECT reason FROM otel_refused_spans")["reason"].to_list()
    assert "a run of this store that no collector made" in reason
