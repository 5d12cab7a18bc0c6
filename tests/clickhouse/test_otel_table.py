"""``?otel_table=NAME`` names the exporter's table by any name the option takes, a
keyword or a non-ASCII one included: kvtrace's views read that one table."""

from __future__ import annotations

import pyarrow as pa
import pytest

from kvtrace.store import Store, read
from kvtrace.store.backend import clickhouse_target
from kvtrace.store.clickhouse import client


@pytest.mark.parametrize("name", ["spans_ü", "select"])
def test_an_otel_table_of_any_accepted_name_is_attached(tmp_path, name):
    db = f"chdb:{tmp_path / 'store'}?otel_table={name}"
    Store.open(db).close()  # the exporter's table, and kvtrace's views from it
    with client.connect(clickhouse_target(db)) as con:
        assert name in con.table_names()
        con.insert_arrow(f"`{name}`", pa.table({
            "Timestamp": pa.array([1_796_000_000_000_000_000], pa.timestamp("ns")),
            "SpanName": ["vllm.request"], "ServiceName": ["vllm"], "TraceId": ["ab" * 16], "SpanId": ["cd" * 8]}))
    Store.open(db).close()  # registers the collected run
    assert read.runs(db)["run_id"].to_list() == ["otlp:vllm"]


def test_a_store_opened_without_its_otel_table_option_names_the_option_not_damage(tmp_path):
    """A whole store written with ?otel_table=NAME, opened without it, was a "damaged kvtrace
    store: table otel_traces is missing" (which may have a good store deleted)."""
    from kvtrace.store.errors import StoreError

    path = tmp_path / "store"
    Store.open(f"chdb:{path}?otel_table=spans_x").close()
    with pytest.raises(StoreError, match="this store's OTel table is spans_x; open it with ") as err:
        read.runs(f"chdb:{path}")
    assert "damaged" not in str(err.value)
    with client.connect(clickhouse_target(f"chdb:{path}?otel_table=spans_x")) as con:
        con.ch_frame("CREATE TABLE aaa_copy AS spans_x")  # (two candidates: not the first one's name alone)
    with pytest.raises(StoreError, match="this store's OTel table is one of aaa_copy, spans_x; open it with "):
        read.runs(f"chdb:{path}")


def test_a_record_the_exporter_took_keeps_nothing_kvtrace_collect_would_refuse(tmp_path):
    """The OTel Collector's ClickHouse exporter takes any run record, and nothing can refuse it:
    a status no run finishes as finished the run `complete`, and a summary of 9 hits in 5
    queries and a digest of two words were stored as given (collect2's finding). A record
    kvtrace collect would refuse now finishes nothing, as collect's 400 does."""
    import json

    db = f"chdb:{tmp_path / 'store'}"
    Store.open(db).close()
    record = {"kvtrace.run.status": "bogus", "kvtrace.run.digest": "two words",
              "kvtrace.run.summary": json.dumps({"prefix_cache_hits": 9, "prefix_cache_queries": 5}),
              "kvtrace.run.name": "sent", "kvtrace.run.trace_digest": "two words", "kvtrace.run.created": "yesterday",
              "kvtrace.run.config": "not json", "kvtrace.run.behaviours": json.dumps({"a": 1}),
              "kvtrace.run.mode": "engine"}
    with client.connect(clickhouse_target(db)) as con:
        con.insert_arrow("otel_traces", pa.table({
            "Timestamp": pa.array([1_796_000_000_000_000_000] * 2, pa.timestamp("ns")),
            "SpanName": ["vllm.request", "kvtrace.run"], "ServiceName": ["vllm", "vllm"],
            "TraceId": ["ab" * 16] * 2, "SpanId": ["cd" * 8, "ef" * 8],
            "ResourceAttributes": pa.array([[("kvtrace.run.id", "x1")]] * 2, pa.map_(pa.string(), pa.string())),
            "SpanAttributes": pa.array([[], list(record.items())], pa.map_(pa.string(), pa.string()))}))
    Store.open(db).close()  # registers the collected run, and finishes it from its record
    (run,) = read.runs(db).iter_rows(named=True)
    # (a record collect refuses names and finishes nothing: d5b3bd6, one rule on both paths)
    assert run["run_id"] == "x1" and run["name"] == "otlp x1"
    assert run["status"] == "running" and run["digest"] is None and run["summary"] is None
    # (re-probe C1: these were kept too, and a config that was no JSON made the run read damaged)
    assert run["trace_digest"] is None and run["created"] != "yesterday" and run["mode"] == "otlp"
    assert read.run(db, "x1")["config"] is None and run["status"] != "damaged"


def test_rows_the_exporter_wrote_before_kvtrace_came_are_copied_once(tmp_path):
    """The collector's table first, holding a request's span; kvtrace's store laid out over it
    later copies what it held (the views carry only rows written after them), and only once:
    an empty table has nothing copied (a new store's), and a second open copies nothing again."""
    from kvtrace.store.clickhouse import collector

    db = f"chdb:{tmp_path / 'store'}"
    target = clickhouse_target(db)
    (tmp_path / "store").mkdir()
    with client.connect(target) as con:
        con.command(collector.otel_traces_ddl("otel_traces"))
        con.insert_arrow("otel_traces", pa.table({
            "Timestamp": pa.array([1_796_000_000_000_000_000], pa.timestamp("ns")),
            "SpanName": ["kvtrace.request"], "ServiceName": ["vllm"], "TraceId": ["ab" * 16], "SpanId": ["cd" * 8],
            "SpanAttributes": pa.array([[("kvtrace.request.id", "before")]], pa.map_(pa.string(), pa.string()))}))
    for _ in range(2):
        Store.open(db).close()
        assert read.runs(db)["run_id"].to_list() == ["otlp:vllm"]
        assert read.requests(db, "otlp:vllm")["request_id"].to_list() == ["before"]
