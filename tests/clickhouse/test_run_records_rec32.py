"""One rule for a ``kvtrace.run`` record's fields on both collector paths, whatever type a sender
gives them. The ClickHouse exporter writes every attribute as text, so the ClickHouse path reads an
int digest 7 as "7"; `kvtrace collect` refused the same record with a 400 (and a config sent as an
OTLP map, behaviours as an array, a name as an int), and read an empty value as absent where the
ClickHouse path refused it. Both now read the exporter's text of it. A record whose JSON the
store cannot hold (a lone surrogate escape, NaN) or whose created time has no UTC form (year 1,
east of UTC) is refused on both: it was stored, left unfinished, or a 500 on collect and an
OverflowError at every open of the ClickHouse store holding it. A second record of a run its
first one finished finishes nothing on the ClickHouse path, at a later open too."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from kvtrace.instrument.otlp import OTLPCollector
from kvtrace.store import Store, read
from kvtrace.store.backend import clickhouse_target
from kvtrace.store.clickhouse import client
from tests.clickhouse.conftest import empty_chdb_store
from tests.clickhouse.test_ch_probe28 import _doc
from tests.instrument.helpers import post_otlp_json
from tests.instrument.test_otlp_fix27 import _av, _protobuf
from tests.support.collector_rows import collector_rows

pytest.importorskip("chdb")

RECORD = "kvtrace.run"
FIELDS = ["status", "digest", "trace_digest", "summary", "name", "config", "behaviours", "created"]


def _named(run_id: str, spans: list[tuple[str, dict]], first: int) -> dict:
    doc = _doc(spans, first=first)["resourceSpans"][0]
    doc["resource"]["attributes"].append({"key": "kvtrace.run.id", "value": _av(run_id)})
    return doc


def _record(**fields) -> tuple[str, dict]:
    return RECORD, {f"kvtrace.run.{k}": v for k, v in fields.items()}


_DEEP = "[" * 5000 + "]" * 5000
# (case: the record's fields, and whether both paths take it)
_CASES = {
    "an int digest": ({"status": "complete", "digest": 7}, True),
    "a double digest": ({"status": "complete", "digest": 7.0}, True),
    "a bool digest": ({"status": "complete", "digest": True}, True),
    "an int trace digest": ({"status": "complete", "trace_digest": 12}, True),
    "a summary sent as a map": ({"status": "complete", "summary": {"requests": 3}}, True),
    "a config sent as a map": ({"status": "complete", "config": {"block_size": 16}}, True),
    "behaviours sent as an array": ({"status": "complete", "behaviours": ["a", "b"]}, True),
    "an int name": ({"status": "failed", "name": 5}, True),
    "an empty digest": ({"status": "complete", "digest": None}, False),
    "a digest sent as an array": ({"status": "complete", "digest": [1]}, False),
    "a trace digest sent as a map": ({"status": "complete", "trace_digest": {"a": 1}}, False),
    "an empty status": ({"status": None}, False),
    "an int status": ({"status": 2}, False),
    "a lone surrogate in the summary": ({"status": "complete", "summary": '{"x": "\\ud800"}'}, False),
    "a lone surrogate in the config": ({"status": "complete", "config": '{"a": "\\udfff"}'}, False),
    "a lone surrogate in the behaviours": ({"status": "complete", "behaviours": '["\\ud800"]'}, False),
    "a NaN in the config": ({"status": "complete", "config": '{"a": NaN}'}, False),
    "an Infinity in the summary": ({"status": "complete", "summary": '{"x": Infinity}'}, False),
    "a summary nested past Python's reader": ({"status": "complete", "summary": f'{{"x": {_DEEP}}}'}, False),
    "a config nested past Python's reader": ({"status": "complete", "config": f'{{"x": {_DEEP}}}'}, False),
}
_IDS = {case: f"run{i}" for i, case in enumerate(_CASES)}


def _rows(db: str) -> dict[str, dict]:
    return {r.pop("run_id"): r for r in read.runs(db).select(["run_id", *FIELDS]).to_dicts()}


@pytest.fixture(scope="module")
def both(tmp_path_factory, _held_chdb) -> tuple[dict[str, int], dict[str, dict], dict[str, dict]]:
    """Each case's record alone, one request each: (collect's answers, collect's runs, the
    ClickHouse path's runs), one store each for the module."""
    duck = tmp_path_factory.mktemp("rec32") / "c.duckdb"
    docs = {case: {"resourceSpans": [_named(_IDS[case], [_record(**fields)], 10 * i + 1)]}
            for i, (case, (fields, _)) in enumerate(_CASES.items())}
    collector = OTLPCollector(duck, port=0).start()
    try:
        answers = {case: post_otlp_json(collector.url, doc)[0] for case, doc in docs.items()}
    finally:
        collector.stop()
    ch = _held_chdb[0]
    empty_chdb_store(*_held_chdb)
    with client.connect(clickhouse_target(ch)) as con:
        con.insert_arrow("otel_traces", collector_rows([_protobuf(doc) for doc in docs.values()]))
    Store.open(ch).close()
    return answers, _rows(str(duck)), _rows(ch)


@pytest.mark.parametrize("case", list(_CASES))
def test_a_record_reads_the_same_on_both_paths_whatever_its_types(both, case):
    answers, collected, exported = both
    taken = _CASES[case][1]
    assert answers[case] == (200 if taken else 400)
    run_id = _IDS[case]
    assert (run_id in collected, run_id in exported) == (taken, taken)
    if taken:
        got = collected[run_id]
        assert got == exported[run_id] | {"created": got["created"]}  # (each path's time of meeting it)


def test_an_int_digest_is_its_decimal_text_on_both_paths(both):
    _, collected, exported = both
    run_id = _IDS["an int digest"]
    assert collected[run_id]["digest"] == exported[run_id]["digest"] == "7"
    assert json.loads(collected[_IDS["a config sent as a map"]]["config"]) == {"block_size": 16}


def test_a_second_record_finishes_nothing_at_a_later_open(chdb_store):
    """The first record stands, as on `kvtrace collect` (one process or a restarted one)."""
    first = _named("r", [_record(status="failed")], 1)
    with client.connect(clickhouse_target(Store.open(chdb_store).close() or chdb_store)) as con:
        con.insert_arrow("otel_traces", collector_rows([_protobuf({"resourceSpans": [first]})]))
    Store.open(chdb_store).close()
    second = _named("r", [_record(status="complete", digest="d2", summary=json.dumps({"requests": 2}))], 11)
    with client.connect(clickhouse_target(chdb_store)) as con:
        con.insert_arrow("otel_traces", collector_rows([_protobuf({"resourceSpans": [second]})]))
    Store.open(chdb_store).close()
    got = _rows(chdb_store)["r"]
    assert (got["status"], got["digest"], got["summary"]) == ("failed", None, None)


@pytest.mark.parametrize("created", ["0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-01:00"])
def test_a_created_time_without_a_utc_form_is_refused_on_both_paths(tmp_path, chdb_store, created, capfd):
    """Year 1 east of UTC (or 9999 west of it) has no UTC time: collect answered 500 with a traceback
    on its stderr, and every open of a ClickHouse store holding the record failed (OverflowError)."""
    doc = {"resourceSpans": [_named("r", [_record(status="complete", created=created)], 1)]}
    collector = OTLPCollector(tmp_path / "c.duckdb", port=0).start()
    try:
        status, message = post_otlp_json(collector.url, doc)
    finally:
        collector.stop()
    assert status == 400 and "kvtrace.run.created: expected an ISO 8601 time" in message
    assert "Traceback" not in capfd.readouterr().err
    with client.connect(clickhouse_target(chdb_store)) as con:
        con.insert_arrow("otel_traces", collector_rows([_protobuf(doc)]))
    Store.open(chdb_store).close()
    assert _rows(chdb_store) == {}


def test_a_record_key_given_twice_with_two_values_finishes_no_run_on_either_path(tmp_path, chdb_store):
    """collect refuses the request (OTLP's keys are unique); the exporter's map keeps both values,
    and the ClickHouse path took the last one (a record saying complete and failed read failed)."""
    doc = {"resourceSpans": [_named("r", [_record(status="complete", digest="d1")], 1)]}
    doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"].append(
        {"key": "kvtrace.run.status", "value": {"stringValue": "failed"}})
    collector = OTLPCollector(tmp_path / "c.duckdb", port=0).start()
    try:
        status, message = post_otlp_json(collector.url, doc)
    finally:
        collector.stop()
    assert status == 400
    rows = collector_rows([_protobuf({"resourceSpans": [_named("r", [_record(status="complete", digest="d1")], 1)]})])
    pairs = rows.column("SpanAttributes").to_pylist()
    rows = rows.set_column(rows.column_names.index("SpanAttributes"), "SpanAttributes", pa.array(
        [list(pairs[0]) + [("kvtrace.run.status", "failed")]], pa.map_(pa.string(), pa.string())))
    with client.connect(clickhouse_target(chdb_store)) as con:
        con.insert_arrow("otel_traces", rows)
    Store.open(chdb_store).close()
    assert _rows(chdb_store) == {}
    with client.connect(clickhouse_target(chdb_store)) as con:
        reasons = con.ch_frame("SELECT reason FROM otel_refused_spans")["reason"].to_list()
    assert reasons == [message.split(": ", 1)[1]]


def test_two_records_of_a_run_in_one_request_finish_it_with_the_earlier_on_both_paths(tmp_path, chdb_store):
    """The ClickHouse path, which has no arrival order, takes the earliest by time; collect took
    the one sent first in the request (a run complete there, failed here)."""
    doc = {"resourceSpans": [_named("r", [_record(status="complete", digest="x"),
                                          _record(status="failed", digest="y")], 1)]}
    spans = doc["resourceSpans"][0]["scopeSpans"][0]["spans"]
    spans[0]["startTimeUnixNano"], spans[0]["endTimeUnixNano"] = "5000", "6000"  # (the later one, sent first)
    collector = OTLPCollector(tmp_path / "c.duckdb", port=0).start()
    try:
        assert post_otlp_json(collector.url, doc)[0] == 200
    finally:
        collector.stop()
    with client.connect(clickhouse_target(chdb_store)) as con:
        con.insert_arrow("otel_traces", collector_rows([_protobuf(doc)]))
    Store.open(chdb_store).close()
    got = {db: (r["status"], r["digest"]) for db in (str(tmp_path / "c.duckdb"), chdb_store)
           for r in [_rows(db)["r"]]}
    assert set(got.values()) == {("failed", "y")}


_NOT_UTF8 = {  # (span name, run id, attributes) of an exporter's row holding bytes that are no UTF-8 (0xff)
    "a record's name": ("'kvtrace.run'", "'r'", "map('kvtrace.run.status', 'complete', 'kvtrace.run.name', "
                                                "concat('a', unhex('ff')))"),
    "a record's summary": ("'kvtrace.run'", "'r'", "map('kvtrace.run.status', 'complete', 'kvtrace.run.summary', "
                                                   "concat('{\"x\": \"', unhex('ff'), '\"}'))"),
    "a run id": ("'kvtrace.request'", "concat('r', unhex('fe'))", "map('kvtrace.request.id', 'q')"),
    "a span's request id": ("'kvtrace.request'", "'r'", "map('kvtrace.request.id', concat('q', unhex('ff')))"),
}


@pytest.mark.parametrize("case", list(_NOT_UTF8))
def test_bytes_that_are_no_utf8_are_left_out_and_the_store_still_opens(chdb_store, case):
    """collect's decoder refuses a protobuf string that is no UTF-8 (a 400); the exporter, which
    does not check, writes its bytes: every open of the store then failed (a Rust panic in polars
    reading the record or the run id), and a span's failed every read of its run."""
    name, run_id, attrs = _NOT_UTF8[case]
    with client.connect(clickhouse_target(chdb_store)) as con:
        con.command("INSERT INTO otel_traces (Timestamp, TraceId, SpanId, SpanName, ServiceName, ResourceAttributes, "
                    f"SpanAttributes, Duration) VALUES (toDateTime64('2026-01-01 00:00:00', 9), '{'1' * 32}', "
                    f"'{'2' * 16}', {name}, 'svc', map('kvtrace.run.id', {run_id}), {attrs}, 10)")
    Store.open(chdb_store).close()
    assert _rows(chdb_store) == {}
    if name != f"'{RECORD}'":
        with client.connect(clickhouse_target(chdb_store)) as con:
            reasons = con.ch_frame("SELECT reason FROM otel_refused_spans")["reason"].to_list()
        assert reasons == ["a string that is no UTF-8 text: not an ExportTraceServiceRequest"]
