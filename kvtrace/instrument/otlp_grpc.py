"""OTLP/gRPC receiver: ``opentelemetry.proto.collector.trace.v1.TraceService/Export``.

gRPC is the OTel SDKs' default OTLP protocol, vLLM's ``--otlp-traces-endpoint`` among
them, so ``kvtrace collect`` serves it next to OTLP/HTTP. The method takes the request
as raw bytes and hands them to the same decoder and ``OTLPCollector.ingest`` as the HTTP
path: the same rows, the same runs. Status codes follow the OTLP spec: a malformed
request gets INVALID_ARGUMENT and stores nothing; an oversized one RESOURCE_EXHAUSTED
(gRPC's receive limit, set to the collector's body limit); an unusable store UNAVAILABLE,
which exporters retry.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

# gRPC's C core logs failures (a busy port, say) to stderr itself; kvtrace reports them as
# one line of its own. Set before grpc is first imported; an explicit setting wins.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

import grpc  # noqa: E402
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2  # noqa: E402

from kvtrace.errors import KVTraceError  # noqa: E402
from kvtrace.instrument.receiver import OTLPCollector, PayloadError, decode_protobuf  # noqa: E402

SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
EXPORT_METHOD = f"/{SERVICE}/Export"
_OK = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()


def grpc_server(collector: OTLPCollector, host: str, port: int, max_body_bytes: int) -> tuple[grpc.Server, int]:
    """A bound, not yet started gRPC server for ``collector``; returns it and its port.

    Raises OSError when the address cannot be bound (as the HTTP server does)."""

    def export(request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            spans = decode_protobuf(request)
        except PayloadError as err:
            collector.requests_rejected += 1
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        try:
            collector.ingest(spans)
        except KVTraceError as err:  # store busy or unusable: the exporter may retry
            collector.requests_rejected += 1
            context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        return _OK

    # No (de)serialisers: the method sees the request's bytes, as the HTTP handler does.
    handler = grpc.method_handlers_generic_handler(SERVICE, {"Export": grpc.unary_unary_rpc_method_handler(export)})
    server = grpc.server(
        ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvtrace-otlp-grpc"),
        handlers=[handler],
        options=[("grpc.max_receive_message_length", max_body_bytes), ("grpc.so_reuseport", 0)],
    )
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpcio raises where older versions returned 0
        bound = 0
    if not bound:
        raise OSError(f"cannot listen on {host}:{port} (OTLP/gRPC): address in use or not available")
    return server, bound
