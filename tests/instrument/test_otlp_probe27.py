"""The twenty-seventh session's probe of ``kvtrace collect``: every refusal is counted, over
gRPC as over HTTP."""

from __future__ import annotations

import json
import re

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from kvtrace.instrument.otlp import OTLPCollector, PayloadError, decode_json, decode_protobuf
from kvtrace.instrument.otlp.grpc import EXPORT_METHOD
from tests.instrument.helpers import count_spans, post_otlp_json


def _request() -> bytes:
    req = trace_service_pb2.ExportTraceServiceRequest()
    span = req.resource_spans.add().scope_spans.add().spans.add(
        name="op", trace_id=(7).to_bytes(16, "big"), span_id=(9).to_bytes(8, "big"))
    span.start_time_unix_nano, span.end_time_unix_nano = 10, 20
    return req.SerializeToString()


@pytest.mark.parametrize("method", [
    "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export",  # an SDK's metrics, sent to the traces port
    "/opentelemetry.proto.collector.trace.v1.TraceService/Exports",
])
def test_a_grpc_method_other_than_export_is_counted_as_refused_and_names_the_one_served(tmp_path, method):
    """gRPC's own UNIMPLEMENTED was counted nowhere (the collector said "0 requests rejected"),
    where the same request to OTLP/HTTP's /v1/metrics is a 404 counted among the refused."""
    db = tmp_path / "c.duckdb"
    collector = OTLPCollector(db, port=0, grpc_port=0).start()
    try:
        with grpc.insecure_channel(collector.grpc_target) as channel:
            call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.RpcError) as refused:
                call(_request(), timeout=30)
            export = channel.unary_unary(EXPORT_METHOD, request_serializer=None, response_deserializer=None)
            export(_request(), timeout=30)  # (the served method still takes its request)
    finally:
        collector.stop()
    assert refused.value.code() is grpc.StatusCode.UNIMPLEMENTED
    assert refused.value.details() == f"{method}: only {EXPORT_METHOD} is served here"
    assert (collector.requests_rejected, collector.spans_received) == (1, 1)
    assert count_spans(db, "r1") == 1


def test_a_clickhouse_collected_attribute_its_column_cannot_take_is_kept_as_kvtrace_collect_keeps_it(tmp_path):
    """The OTel Collector's ClickHouse path dropped a typed attribute whose value was no such
    number (a token count of ``12.5`` or ``true``: neither its column nor ``extra_attributes``
    held it) and stored a ``kvtrace.source`` kvtrace does not know as the span's source, where
    `kvtrace collect` keeps both as extra attributes and calls the span the receiver's."""
    import pyarrow as pa

    from kvtrace.store import Store
    from kvtrace.store.backend import clickhouse_target
    from kvtrace.store.clickhouse import client

    pytest.importorskip("chdb")
    db = f"chdb:{tmp_path / 'store'}"
    Store.open(db).close()
    attributes = [{"gen_ai.usage.input_tokens": "12.5", "gen_ai.usage.output_tokens": "3"},
                  {"gen_ai.usage.input_tokens": "true", "kvtrace.source": "zzz"},
                  {"gen_ai.usage.input_tokens": "7", "kvtrace.source": "vllm"}]
    n = len(attributes)
    with client.connect(clickhouse_target(db)) as con:
        con.insert_arrow("otel_traces", pa.table({
            "Timestamp": pa.array([1_796_000_000_000_000_000] * n, pa.timestamp("ns")),
            "SpanName": ["llm_request"] * n, "ServiceName": ["vllm"] * n, "TraceId": ["ab" * 16] * n,
            "SpanId": [f"{i + 1:016x}" for i in range(n)],
            "SpanAttributes": pa.array([list(a.items()) for a in attributes], pa.map_(pa.string(), pa.string()))}))
    Store.open(db).close()
    with client.connect(clickhouse_target(db)) as con:
        rows = con.ch_frame("SELECT source, num_prompt_tokens, num_output_tokens, extra_attributes FROM spans_other "
                            "ORDER BY span_id").rows()
    extras = [dict(e.items() if isinstance(e, dict) else e or ()) for *_, e in rows]
    assert [r[:3] for r in rows] == [("otlp", None, 3), ("otlp", None, None), ("vllm", 7, None)]
    assert extras == [{"gen_ai.usage.input_tokens": "12.5"},
                      {"gen_ai.usage.input_tokens": "true", "kvtrace.source": "zzz"}, {}]


def _kv(key: str, value: dict) -> dict:
    return {"key": key, "value": value}


def _doc(span_attributes: list[dict], resource: list[dict] | None = None, **span) -> dict:
    body = {"traceId": "ab" * 16, "spanId": "cd" * 8, "name": "llm_request", "startTimeUnixNano": "1000",
            "endTimeUnixNano": "5000", "attributes": span_attributes, **span}
    return {"resourceSpans": [{"resource": {"attributes": resource or []}, "scopeSpans": [{"spans": [body]}]}]}


def _protobuf(doc: dict) -> bytes:
    """The protobuf of an OTLP/JSON document (its hex ids as proto3 JSON's base64)."""
    import base64
    import copy

    from google.protobuf import json_format

    doc = copy.deepcopy(doc)
    for span in doc["resourceSpans"][0]["scopeSpans"][0]["spans"]:
        for key in ("traceId", "spanId"):
            span[key] = base64.b64encode(bytes.fromhex(span[key])).decode()
    return json_format.ParseDict(doc, trace_service_pb2.ExportTraceServiceRequest()).SerializeToString()


_TWICE = [
    (_doc([_kv("gen_ai.usage.input_tokens", {"intValue": "5"}), _kv("gen_ai.usage.input_tokens", {"intValue": "7"})]),
     "resourceSpans[0].scopeSpans[0].spans[0]: attribute 'gen_ai.usage.input_tokens' given twice, as 5 and 7"),
    (_doc([], resource=[_kv("kvtrace.run.id", {"stringValue": "a"}), _kv("kvtrace.run.id", {"stringValue": "b"})]),
     "resourceSpans[0].resource: attribute 'kvtrace.run.id' given twice, as 'a' and 'b'"),
    (_doc([_kv("n", {"intValue": "1"}), _kv("n", {"doubleValue": 1.0})]),  # (two types: two values)
     "spans[0]: attribute 'n' given twice, as 1 and 1.0"),
    (_doc([], events=[{"timeUnixNano": "2000", "name": "e", "attributes": [_kv("k", {"stringValue": "x"}),
                                                                            _kv("k", {"stringValue": "y"})]}]),
     "spans[0].events[0]: attribute 'k' given twice, as 'x' and 'y'"),
    (_doc([_kv("m", {"kvlistValue": {"values": [_kv("k", {"boolValue": True}), _kv("k", {"boolValue": False})]}})]),
     "attribute 'k' given twice, as true and false"),
]


@pytest.mark.parametrize(("doc", "said"), _TWICE)
def test_an_attribute_key_given_twice_with_two_values_is_refused_naming_it(doc, said):
    """OTLP's attribute keys are unique; one given twice kept its last value and dropped the
    other without a word (5 prompt tokens, then 7: stored 7), in either encoding."""
    for decode, body in ((decode_json, json.dumps(doc).encode()), (decode_protobuf, _protobuf(doc))):
        with pytest.raises(PayloadError, match=re.escape(said)):
            decode(body)


def test_a_request_with_a_key_given_twice_stores_nothing_and_one_value_twice_is_one(tmp_path):
    db = tmp_path / "c.duckdb"
    collector = OTLPCollector(db, port=0).start()
    try:
        same = _kv("gen_ai.usage.input_tokens", {"intValue": "5"})
        assert post_otlp_json(collector.url, _doc([same, same])) == (200, "{}")
        status, said = post_otlp_json(collector.url, _TWICE[0][0] | {})
        assert (status, said.endswith("(an attribute key is unique)")) == (400, True), said
    finally:
        collector.stop()
    assert (collector.spans_received, collector.requests_rejected) == (1, 1)
    assert count_spans(db, "r1") == 1
