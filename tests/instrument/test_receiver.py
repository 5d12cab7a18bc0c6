"""The OTLP/HTTP receiver: JSON, protobuf, gzip, limits and malformed payloads."""

from __future__ import annotations

import gzip
import json
import urllib.error
import urllib.request

import pytest
from google.rpc import status_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from kvtrace.instrument.otlp import OTLPCollector
from tests.instrument.helpers import count_spans, store_rows

TRACE = "5b8efff798038103d269b633813fc60c"


def _json_body(n: int = 2, run_id: str | None = "json-run") -> bytes:
    resource = [{"key": "service.name", "value": {"stringValue": "client"}}]
    if run_id:
        resource.append({"key": "kvtrace.run.id", "value": {"stringValue": run_id}})
    spans = [{
        "traceId": TRACE, "spanId": f"{i + 1:016x}", "parentSpanId": "" if i == 0 else f"{1:016x}",
        "name": "kvtrace.cache.publish", "kind": 1,
        "startTimeUnixNano": str(1000 + i), "endTimeUnixNano": 1000 + i,
        "attributes": [
            {"key": "kvtrace.step", "value": {"intValue": str(7 + i)}},
            {"key": "kvtrace.block.ids", "value": {"arrayValue": {"values": [{"intValue": "1"}, {"intValue": 2}]}}},
            {"key": "kvtrace.block.hashes",
             "value": {"arrayValue": {"values": [{"stringValue": "aa"}, {"stringValue": "bb"}]}}},
            {"key": "kvtrace.publish.kind", "value": {"stringValue": "full"}},
            {"key": "custom.flag", "value": {"boolValue": True}},
            {"key": "custom.map", "value": {"kvlistValue": {"values": [{"key": "a", "value": {"doubleValue": 1.5}}]}}},
        ],
        "events": [{"timeUnixNano": "1001", "name": "note",
                    "attributes": [{"key": "k", "value": {"stringValue": "v"}}]}],
        "links": [{"traceId": TRACE, "spanId": "00000000000000ff"}],
        "status": {"code": 2, "message": "boom"},
    } for i in range(n)]
    scope_spans = [{"scope": {"name": "s", "version": "1"}, "spans": spans}]
    return json.dumps({"resourceSpans": [{"resource": {"attributes": resource}, "scopeSpans": scope_spans}]}).encode()


def _post(url: str, body: bytes, ctype: str = "application/json", encoding: str | None = None):
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": ctype})
    if encoding:
        req.add_header("Content-Encoding", encoding)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read(), resp.headers.get("Content-Type")
    except urllib.error.HTTPError as err:
        return err.code, err.read(), err.headers.get("Content-Type")


@pytest.fixture()
def collector(tmp_path):
    c = OTLPCollector(tmp_path / "rx.duckdb", port=0, max_body_bytes=64 * 1024).start()
    yield c
    c.stop()


def test_binds_loopback_by_default(collector):
    assert collector.address[0] == "127.0.0.1"


def test_json_spans_are_stored_with_typed_columns(tmp_path, collector):
    status, _, ctype = _post(collector.url, _json_body())
    assert (status, ctype) == (200, "application/json")
    collector.stop()
    rows = store_rows(tmp_path / "rx.duckdb", "json-run")
    assert len(rows) == 2
    r = rows[0]
    assert (r["trace_id"], r["span_id"], r["parent_span_id"]) == (TRACE, "0000000000000001", None)  # root: NULL parent
    assert (r["start_ns"], r["end_ns"], r["step"]) == (1000, 1000, 7)
    assert r["block_ids"] == [1, 2] and r["block_hashes"] == ["aa", "bb"]
    assert r["publish_kind"] == "full"
    assert r["extra_attributes"] == {"custom.flag": "true", "custom.map": '{"a":1.5}'}
    assert (r["status_code"], r["status_message"]) == ("Error", "boom")
    assert r["events"] == [{"time_ns": 1001, "name": "note", "attributes": {"k": "v"}}]
    assert r["links"][0]["span_id"] == "00000000000000ff"
    assert (r["service_name"], r["scope_name"], r["scope_version"], r["source"]) == ("client", "s", "1", "otlp")
    assert rows[1]["parent_span_id"] == "0000000000000001"


def test_gzip_protobuf_is_accepted(tmp_path, collector):
    req = trace_service_pb2.ExportTraceServiceRequest()
    span = req.resource_spans.add().scope_spans.add().spans.add()
    span.trace_id, span.span_id, span.name = bytes.fromhex(TRACE), bytes(range(1, 9)), "kvtrace.engine.step"
    span.start_time_unix_nano, span.end_time_unix_nano = 5, 9
    kv = span.attributes.add()
    kv.key, kv.value.int_value = "kvtrace.step", 42
    status, body, ctype = _post(collector.url, gzip.compress(req.SerializeToString()), "application/x-protobuf", "gzip")
    assert status == 200 and ctype == "application/x-protobuf"
    trace_service_pb2.ExportTraceServiceResponse.FromString(body)
    collector.stop()
    rows = store_rows(tmp_path / "rx.duckdb", "r1", "name, step, start_ns, end_ns")
    assert rows == [{"name": "kvtrace.engine.step", "step": 42, "start_ns": 5, "end_ns": 9}]


@pytest.mark.parametrize("body, ctype, what", [
    (b"{not json", "application/json", "invalid JSON"),
    (json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz", "spanId": "00"}]}]}]}).encode(),
     "application/json", "traceId"),
    (json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [
        {"traceId": TRACE, "spanId": "0000000000000001", "startTimeUnixNano": "soon"}]}]}]}).encode(),
     "application/json", "startTimeUnixNano"),
    (b"\xff\xff\xff\xff garbage", "application/x-protobuf", "ExportTraceServiceRequest"),
])
def test_malformed_payload_gets_400_and_keeps_what_is_stored(tmp_path, collector, body, ctype, what):
    assert _post(collector.url, _json_body(3))[0] == 200
    status, reply, reply_type = _post(collector.url, body, ctype)
    assert status == 400
    if reply_type == "application/json":
        assert what in json.loads(reply)["message"]
    else:
        assert what in status_pb2.Status.FromString(reply).message
    assert _post(collector.url, _json_body(2, run_id="after"))[0] == 200  # still serving
    collector.stop()
    assert count_spans(tmp_path / "rx.duckdb", "json-run") == 3
    assert count_spans(tmp_path / "rx.duckdb", "after") == 2


def test_a_bad_span_rejects_the_whole_request(tmp_path, collector):
    doc = json.loads(_json_body(3))
    doc["resourceSpans"][0]["scopeSpans"][0]["spans"][2]["spanId"] = "short"
    assert _post(collector.url, json.dumps(doc).encode())[0] == 400
    collector.stop()
    assert count_spans(tmp_path / "rx.duckdb", "json-run") == 0


def test_body_limits(collector):
    big = b"x" * (65 * 1024)
    assert _post(collector.url, big)[0] == 413
    bomb = gzip.compress(b" " * (1024 * 1024))  # small on the wire, 1 MiB inflated
    assert len(bomb) < 64 * 1024
    assert _post(collector.url, bomb, encoding="gzip")[0] == 413
    assert _post(collector.url, b"{}", "text/plain")[0] == 415
    assert _post(collector.url.replace("/v1/traces", "/v1/logs"), b"{}")[0] == 404
    assert _post(collector.url, b"{}")[0] == 200  # an empty export is fine
