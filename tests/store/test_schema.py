"""The otel_traces view matches the ClickHouse exporter's columns; the Arrow schema matches DuckDB."""

from __future__ import annotations

import duckdb
import pyarrow as pa

from kvtrace.store import ATTRIBUTE_COLUMNS, SPAN_ARROW_SCHEMA, SPAN_COLUMNS, Store
from kvtrace.store.schema import OTEL_TRACES_COLUMNS, SPAN_TABLES, SPAN_VIEW_COLUMNS


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


def test_tables_store_the_arrow_schema_and_views_show_ids_as_hex(tmp_path):
    path = tmp_path / "s.duckdb"
    Store.open(path)
    stored = _describe(path, "spans_other")  # the table with every column
    assert [n for n, _ in stored] == [*SPAN_COLUMNS, "seq", "num_blocks"]
    con = duckdb.connect(str(path), read_only=True)
    # an empty Arrow table of SPAN_ARROW_SCHEMA and the stored table agree type for type
    con.register("empty_spans", SPAN_ARROW_SCHEMA.empty_table())
    rel = con.sql("SELECT * FROM empty_spans")
    arrow_types = dict(zip(rel.columns, map(str, rel.types)))
    con.close()
    for name, sql_type in stored[: len(SPAN_COLUMNS)]:
        assert arrow_types[name] == sql_type, name
    view = dict(_describe(path, "spans"))
    assert list(view) == [*SPAN_VIEW_COLUMNS, "seq", "num_blocks"]
    assert "trace_id_hi" not in view and view["trace_id"] == view["span_id"] == view["parent_span_id"] == "VARCHAR"
    assert view["links"].startswith("STRUCT(trace_id VARCHAR, span_id VARCHAR, ")
    for name in SPAN_VIEW_COLUMNS:
        if name not in ("trace_id", "span_id", "parent_span_id", "links"):
            assert view[name] == arrow_types[name], name
    assert set(SPAN_TABLES) >= {"spans_cache", "spans_lookup", "spans_request", "spans_other"}


def test_integer_ids_read_back_as_otel_hex(tmp_path):
    path = tmp_path / "s.duckdb"
    top = 2**64 - 1
    with Store.open(path) as store:
        run_id = store.create_run("ids")
        store.append_spans(pa.table({
            "name": ["kvtrace.engine.step", "kvtrace.cache.cow", "x.unknown"],
            "trace_id_hi": pa.array([0, top, 1], pa.uint64()), "trace_id_lo": pa.array([1, 0xAB, top], pa.uint64()),
            "span_id": pa.array([0x10, top, 7], pa.uint64()),
            "parent_span_id": pa.array([None, 0x10, 3], pa.uint64()),
            "start_ns": [1, 2, 3], "end_ns": [1, 2, 3],
            "links": pa.array([None, [{"trace_id_hi": 5, "trace_id_lo": 6, "span_id": 0xFF, "trace_state": None,
                                       "attributes": None}], None], SPAN_ARROW_SCHEMA.field("links").type),
        }), run_id=run_id)
    con = duckdb.connect(str(path), read_only=True)
    rows = con.execute("SELECT trace_id, span_id, parent_span_id, links FROM spans ORDER BY seq").fetchall()
    cow = con.execute('SELECT "TraceId", "SpanId", "ParentSpanId", "Links.TraceId", "Links.SpanId" FROM otel_traces '
                      "WHERE \"SpanName\" = 'kvtrace.cache.cow'").fetchall()
    family = con.execute("SELECT span_id FROM cache_spans").fetchall()
    con.close()
    assert rows[0][:3] == ("0" * 31 + "1", "0" * 14 + "10", None)
    assert rows[1][:3] == ("f" * 16 + "0" * 14 + "ab", "f" * 16, "0" * 14 + "10")
    assert rows[1][3] == [{"trace_id": "0" * 15 + "5" + "0" * 15 + "6", "span_id": "0" * 14 + "ff",
                           "trace_state": None, "attributes": None}]
    assert rows[2][:3] == ("0" * 15 + "1" + "f" * 16, "0" * 15 + "7", "0" * 15 + "3")  # spans_other
    assert cow == [("f" * 16 + "0" * 14 + "ab", "f" * 16, "0" * 14 + "10", ["0" * 15 + "5" + "0" * 15 + "6"],
                    ["0" * 14 + "ff"])]
    assert family == [("f" * 16,)]


def test_attribute_keys_are_unique_and_namespaced():
    assert len(ATTRIBUTE_COLUMNS) == len(set(ATTRIBUTE_COLUMNS.values()))
    assert all(k.startswith(("kvtrace.", "gen_ai.")) for k in ATTRIBUTE_COLUMNS)


def test_span_attributes_assembled_from_typed_columns_and_extras(tmp_path):
    path = tmp_path / "s.duckdb"
    store = Store.open(path)
    run_id = store.create_run("attrs")
    store.append_spans(pa.table({
        "name": ["kvtrace.request", "kvtrace.cache.publish"],
        "trace_id_hi": pa.array([0, 0], pa.uint64()), "trace_id_lo": pa.array([1, 1], pa.uint64()),
        "span_id": pa.array([0xA, 0xB], pa.uint64()),
        "parent_span_id": pa.array([None, 0xA], pa.uint64()),
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


def test_one_list_of_derived_tables_matches_what_is_created_and_computed(scenario_db):
    from kvtrace.store import derived, schema

    assert not hasattr(schema, "DERIVED_TABLES")  # derived.TABLES is the one list
    path, run_id = scenario_db
    con = duckdb.connect(str(path), read_only=True)
    try:
        created = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
        computed = derived.compute(con, run_id)
    finally:
        con.close()
    assert len(derived.TABLES) == len(derived.DDL) == 7
    assert set(derived.TABLES) <= created
    assert set(computed) == set(derived.TABLES)
