"""A collected run on both collector paths, continued (``store/clickhouse/collector.py``):

- spans that come after a run's record finished it are counted: `kvtrace collect` rebuilds the
  run's derived tables as they come, and the ClickHouse path kept the tables its record built
  (``runs`` said 1 span of a complete run holding 3, for good); now the next open rebuilds
  them, as a restarted collect does;
- a record is checked as `kvtrace collect` checks it, its ids, times and run id, not its start
  against the resource's ``kvtrace.run.time_offset_ns`` (collect reads that of spans alone):
  a lone ``failed`` record whose offset was after its start, or no integer, made a run on
  collect and none on the ClickHouse path."""

from __future__ import annotations

import pytest

from kvtrace.instrument.otlp import OTLPCollector
from kvtrace.store import Store, read
from kvtrace.store.backend import clickhouse_target
from kvtrace.store.clickhouse import client
from tests.clickhouse.test_ch_probe28 import _protobuf
from tests.clickhouse.test_ch_record_run_reprobe30 import _named
from tests.clickhouse.test_run_record_ch31 import _collect, _record, _span
from tests.instrument.helpers import post_otlp_json
from tests.instrument.test_otlp_fix27 import _av
from tests.support.collector_rows import collector_rows

pytest.importorskip("chdb")

COLUMNS = ["run_id", "status", "digest", "num_spans"]


def _exported_each(db: str, requests: list[dict]) -> list[dict]:
    """``runs`` of the chdb store ``db`` (empty) after each request's rows, each read at the next open."""
    Store.open(db).close()
    for doc in requests:
        with client.connect(clickhouse_target(db)) as con:
            con.insert_arrow("otel_traces", collector_rows([_protobuf({"resourceSpans": [doc]})]))
        Store.open(db).close()
    return read.runs(db).select(COLUMNS).to_dicts()


def test_spans_after_the_record_are_counted_on_both_paths(tmp_path, chdb_store):
    requests = [[_span(0)], [_record(status="complete", digest="d1")], [_span(1), _span(2)]]
    duck = tmp_path / "c.duckdb"
    for i, spans in enumerate(requests):  # (a restart between: what a rebuild at the start must find)
        assert _collect(duck, [spans], 1 + 10 * i) == [200]
    expected = [{"run_id": "r", "status": "complete", "digest": "d1", "num_spans": 3}]
    assert read.runs(str(duck)).select(COLUMNS).to_dicts() == expected
    docs = [_named("r", spans, 1 + 10 * i) for i, spans in enumerate(requests)]
    assert _exported_each(chdb_store, docs) == expected


@pytest.mark.parametrize("offset", [10**6, " 1_000 "])
def test_a_record_is_not_read_against_the_resource_offset(tmp_path, chdb_store, offset):
    doc = _named("r", [_record(status="failed")], 1)
    doc["resource"]["attributes"].append({"key": "kvtrace.run.time_offset_ns", "value": _av(offset)})
    collector = OTLPCollector(tmp_path / "d.duckdb", port=0).start()
    try:
        assert post_otlp_json(collector.url, {"resourceSpans": [doc]})[0] == 200
    finally:
        collector.stop()
    expected = [{"run_id": "r", "status": "failed", "digest": None, "num_spans": 0}]
    assert read.runs(str(tmp_path / "d.duckdb")).select(COLUMNS).to_dicts() == expected
    assert _exported_each(chdb_store, [doc]) == expected
