"""The otel_traces view matches the ClickHouse exporter's columns; the Arrow schema matches DuckDB."""

from __future__ import annotations

import duckdb
import pyarrow as pa

from kvtrace.store import ATTRIBUTE_COLUMNS, SPAN_ARROW_SCHEMA, SPAN_COLUMNS, Store
from kvtrace.store.schema import OTEL_TRACES_COLUMNS, SPAN_TABLES


def _describe(path, relation):
    con = duckdb.connect(str(path), read_only=True)
    try:
        return [(r[0], r[1]) for r in con.execute(f"DESCRIBE {relation}").fetchall()]
    finally:
        con.close()


def test_otel_traces_columns_and_types(tmp_path):
    path = tmp_path / "s.duckdb"
    Store.open(path)
    cols = _describe(path, "otel_traces")
    # exactly the exporter's columns, in its order, then kvtrace's RunId
    assert cols[: len(OTEL_TRACES_COLUMNS)] == list(OTEL_TRACES_COLUMNS)
    assert cols[len(OTEL_TRACES_COLUMNS):] == [("RunId", "VARCHAR")]


def test_exporter_names_are_the_clickhouse_ones():
    names = [n for n, _ in OTEL_TRACES_COLUMNS]
    assert names[:5] == ["Timestamp", "TraceId", "SpanId", "ParentSpanId", "TraceState"]
    assert {"SpanAttributes", "ResourceAttributes", "Duration", "StatusCode", "Events.Timestamp",
            "Links.Attributes", "ScopeName", "ScopeVersion"} <= set(names)


def test_spans_view_has_every_column_with_schema_types(tmp_path):
    path = tmp_path / "s.duckdb"
    Store.open(path)
    cols = _describe(path, "spans")
    assert [n for n, _ in cols] == [*SPAN_COLUMNS, "seq", "num_blocks"]
    con = duckdb.connect(str(path), read_only=True)
    # an empty Arrow table of SPAN_ARROW_SCHEMA and the view agree type for type
    con.register("empty_spans", SPAN_ARROW_SCHEMA.empty_table())
    rel = con.sql("SELECT * FROM empty_spans")
    arrow_types = dict(zip(rel.columns, map(str, rel.types)))
    con.close()
    view_types = dict(cols)
    for name in SPAN_COLUMNS:
        assert arrow_types[name] == view_types[name], name
    assert set(SPAN_TABLES) >= {"spans_cache", "spans_lookup", "spans_request", "spans_other"}


def test_attribute_keys_are_unique_and_namespaced():
    assert len(ATTRIBUTE_COLUMNS) == len(set(ATTRIBUTE_COLUMNS.values()))
    assert all(k.startswith(("kvtrace.", "gen_ai.")) for k in ATTRIBUTE_COLUMNS)


def test_span_attributes_assembled_from_typed_columns_and_extras(tmp_path):
    path = tmp_path / "s.duckdb"
    store = Store.open(path)
    run_id = store.create_run("attrs")
    store.append_spans(pa.table({
        "name": ["kvtrace.request", "kvtrace.cache.publish"],
        "trace_id": ["0" * 31 + "1", "0" * 31 + "1"],
        "span_id": ["0" * 15 + "a", "0" * 15 + "b"],
        "parent_span_id": [None, "0" * 15 + "a"],
        "start_ns": [1_000, 2_000], "end_ns": [5_000, 2_000],
        "request_id": ["r-1", "r-1"],
        "num_prompt_tokens": [100, None], "num_hit_tokens": [30, None], "num_external_hit_tokens": [10, None],
        "block_ids": [None, [4, 5]], "block_hashes": [None, ["aa", "bb"]],
        "extra_attributes": pa.array([[("http.route", "/v1")], None], pa.map_(pa.string(), pa.string())),
        "events": pa.array([[{"time_ns": 3_000, "name": "first_token", "attributes": [("k", "v")]}], None],
                           SPAN_ARROW_SCHEMA.field("events").type),
    }), run_id=run_id)
    store.finish_run(run_id)
    con = duckdb.connect(str(path), read_only=True)
    rows = con.execute('SELECT "SpanName", "SpanAttributes", "Duration", "ParentSpanId", "Events.Name", '
                       '"Events.Attributes", "ResourceAttributes", "SpanKind", "StatusCode" '
                       'FROM otel_traces ORDER BY "SpanId"').fetchall()
    con.close()
    req, pub = rows
    attrs = req[1]
    assert attrs["kvtrace.request.id"] == "r-1"
    assert attrs["gen_ai.usage.input_tokens"] == "100"
    assert attrs["gen_ai.usage.cache_read.input_tokens"] == "40"
    assert attrs["http.route"] == "/v1"
    assert "kvtrace.block.ids" not in attrs  # NULL typed columns are left out
    assert (req[2], req[3], req[4], req[5]) == (4_000, "", ["first_token"], [{"k": "v"}])
    assert req[6]["kvtrace.run.id"] == run_id
    assert (req[7], req[8]) == ("Internal", "Unset")  # the ClickHouse exporter spelling (traceutil)
    assert pub[1]["kvtrace.block.ids"] == "[4,5]" and pub[1]["kvtrace.block.hashes"] == '["aa","bb"]'
    assert pub[3] == "0" * 15 + "a"
