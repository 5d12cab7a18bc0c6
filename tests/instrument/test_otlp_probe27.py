"""The twenty-seventh session's probe of ``kvtrace collect``: every refusal is counted, over
gRPC as over HTTP."""

from __future__ import annotations

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from kvtrace.instrument.otlp import OTLPCollector
from kvtrace.instrument.otlp.grpc import EXPORT_METHOD
from tests.instrument.helpers import count_spans


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
