"""A ``kvtrace.run`` record on the ClickHouse collector path, read from the exporter's table:

- a record of no attributes (an empty map, which reads back as NULL) finishes its run
  ``complete``, as `kvtrace collect` finishes it;
- a record the exporter's table holds no more (its TTL dropped it before any kvtrace writer
  opened the store) still finishes its run from the copy ``otel_run_records`` keeps: the run
  read ``running`` for good."""

from __future__ import annotations

import pytest

from kvtrace.store import Store, read
from kvtrace.store.backend import clickhouse_target
from kvtrace.store.clickhouse import client
from tests.clickhouse.test_ch_probe28 import _exported, _protobuf
from tests.clickhouse.test_ch_record_run_reprobe30 import _named
from tests.clickhouse.test_run_record_ch31 import RECORD, _collect, _listed, _record, _span
from tests.support.collector_rows import collector_rows

pytest.importorskip("chdb")


def test_a_record_of_no_attributes_finishes_its_run_on_both_paths(tmp_path, chdb_store):
    requests = [[_span(0)], [(RECORD, {})]]
    assert _collect(tmp_path / "c.duckdb", requests) == [200, 200]
    expected = {"r": ("complete", None, None)}
    assert _listed(str(tmp_path / "c.duckdb")) == expected
    docs = [_named("r", spans, 1 + 10 * i) for i, spans in enumerate(requests)]
    assert _listed(_exported(chdb_store, {"resourceSpans": docs})) == expected


def test_a_record_the_exporter_table_dropped_still_finishes_its_run(chdb_store):
    _exported(chdb_store, {"resourceSpans": [_named("r", [_span(0)], 1)]})
    assert _listed(chdb_store) == {"r": ("running", None, None)}
    with client.connect(clickhouse_target(chdb_store)) as con:
        con.insert_arrow("otel_traces", collector_rows([_protobuf({"resourceSpans": [
            _named("r", [_record(status="failed", digest="d1")], 11)]})]))  # (copied to otel_run_records)
        con.command("ALTER TABLE otel_traces DELETE WHERE SpanName = 'kvtrace.run' SETTINGS mutations_sync = 2")
    Store.open(chdb_store).close()
    assert _listed(chdb_store) == {"r": ("failed", "d1", None)}
    assert read.runs(chdb_store)["num_spans"].to_list() == [1]
