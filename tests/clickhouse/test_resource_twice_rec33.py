"""A resource attribute key given twice with two values, one rule on both collector paths:
`kvtrace collect` refuses the request (400, nothing stored); the OpenTelemetry Collector's
ClickHouse exporter keeps both in its map, and the ClickHouse path filed the spans under the run
their first ``kvtrace.run.id`` named (and its record finished that run). Now its spans and its
record are left out, each with collect's reason in ``otel_refused_spans``. The same value twice
is one value on both."""

from __future__ import annotations

import pyarrow as pa
import pytest

from kvtrace.instrument.otlp import OTLPCollector
from kvtrace.store import Store, read
from kvtrace.store.backend import clickhouse_target
from kvtrace.store.clickhouse import client
from tests.clickhouse.test_run_records_rec32 import _named, _record
from tests.instrument.helpers import post_otlp_json
from tests.instrument.test_collect_records_rec32 import _span
from tests.instrument.test_otlp_fix27 import _protobuf
from tests.support.collector_rows import collector_rows

pytest.importorskip("chdb")

_CASES = {  # (the key given again, its second value, whether both paths take the request)
    "two run ids": ("kvtrace.run.id", "b", False),
    "two offsets": ("kvtrace.run.time_offset_ns", "7", False),
    "another key, two values": ("host.name", "y", False),
    "the run id again, alike": ("kvtrace.run.id", "a", True),
}


def _doc(key: str) -> dict:
    doc = _named("a", [_span(0), _record(status="complete", digest="d")], 1)
    if key != "kvtrace.run.id":  # (first given once, as a sender's resource holds it)
        doc["resource"]["attributes"].append({"key": key, "value": {"stringValue": "0" if "offset" in key else "x"}})
    return doc


def _collected(tmp_path, key: str, again: str) -> tuple[int, str, dict]:
    doc = _doc(key)
    doc["resource"]["attributes"].append({"key": key, "value": {"stringValue": again}})
    db = tmp_path / "c.duckdb"
    collector = OTLPCollector(db, port=0).start()
    try:
        status, message = post_otlp_json(collector.url, {"resourceSpans": [doc]})
    finally:
        collector.stop()
    return status, message, dict(read.runs(db).select("run_id", "status").rows())


def _exported(db: str, key: str, again: str) -> tuple[dict, list[tuple[str, str]]]:
    rows = collector_rows([_protobuf({"resourceSpans": [_doc(key)]})])
    i = rows.column_names.index("ResourceAttributes")
    resources = rows.column(i).to_pylist()  # (the exporter's map keeps a key given twice twice)
    rows = rows.set_column(i, "ResourceAttributes", pa.array([[*r, (key, again)] for r in resources],
                                                                pa.map_(pa.string(), pa.string())))
    Store.open(db).close()
    with client.connect(clickhouse_target(db)) as con:
        con.insert_arrow("otel_traces", rows)
    Store.open(db).close()
    with client.connect(clickhouse_target(db)) as con:
        refused = con.ch_frame("SELECT name, reason FROM otel_refused_spans ORDER BY name").rows()
    return dict(read.runs(db).select("run_id", "status").rows()), refused


@pytest.mark.parametrize("case", list(_CASES))
def test_a_resource_key_given_twice_is_refused_on_both_paths(tmp_path, chdb_store, case):
    key, again, taken = _CASES[case]
    status, message, collected = _collected(tmp_path, key, again)
    exported, refused = _exported(chdb_store, key, again)
    assert collected == exported == ({"a": "complete"} if taken else {})
    if taken:
        assert status == 200 and refused == []
        return
    assert status == 400 and message.startswith("resourceSpans[0].resource: attribute ")
    said = "resource: " + message.split("resource: ", 1)[1]
    assert refused == [("kvtrace.request", said), ("kvtrace.run", said)]
