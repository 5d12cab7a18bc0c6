"""OTLP/gRPC receiver: ``opentelemetry.proto.collector.trace.v1.TraceService/Export``.

gRPC is the OTel SDKs' default OTLP protocol, vLLM's ``--otlp-traces-endpoint`` among
them, so ``kvtrace collect`` serves it next to OTLP/HTTP. The method takes the request
as raw bytes, decodes it with the same ``decode_protobuf`` as the HTTP path and hands
the spans to the ``ingest`` callable it was given (the collector's): the same rows, the
same runs. This module knows nothing of the collector. Status codes follow the OTLP
spec: a malformed request gets INVALID_ARGUMENT and stores nothing; an oversized one
RESOURCE_EXHAUSTED (gRPC's receive limit, set to the body limit); an unusable store
(``ingest`` raising ``KVTraceError``) UNAVAILABLE, which exporters retry.

A busy or unavailable address is found by binding a plain socket to it first
(``kvtrace.process.probe_address``): gRPC's C core would log its own failure to stderr,
and kvtrace reports it as one line instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from kvtrace.errors import KVTraceError
from kvtrace.instrument.otlp.decode import PayloadError, decode_protobuf
from kvtrace.process import probe_address

SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
EXPORT_METHOD = f"/{SERVICE}/Export"
_OK = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
_log = logging.getLogger(__name__)


def grpc_server(ingest: Callable[..., object], host: str, port: int, max_body_bytes: int,
                on_reject: Callable[[], None] = lambda: None) -> tuple[grpc.Server, int]:
    """A bound, not yet started gRPC server whose ``Export`` decodes a request and calls
    ``ingest(spans, wanted=context.is_active)`` (a call cancelled, or past its deadline,
    is not stored); returns it and its port. ``on_reject`` is called once per request
    refused (malformed, or ``ingest`` raised ``KVTraceError``).

    Raises OSError when the address cannot be bound (as the HTTP server does)."""

    def export(request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            ingest(decode_protobuf(request), wanted=context.is_active)
            return _OK
        except PayloadError as err:  # malformed, or a value the store cannot hold
            code, message = grpc.StatusCode.INVALID_ARGUMENT, str(err)
        except KVTraceError as err:  # store busy or unusable: the exporter may retry
            code, message = grpc.StatusCode.UNAVAILABLE, str(err)
        except Exception as err:  # never gRPC's traceback in the server log; nothing was stored
            _log.exception("OTLP/gRPC export failed")
            code, message = grpc.StatusCode.INTERNAL, f"not stored: {type(err).__name__}: {err}"[:300]
        on_reject()
        context.abort(code, message)  # raises: outside the handlers above
        return b""  # not reached

    probe_address(host, port, "OTLP/gRPC")
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
    if not bound:  # taken between the probe and here (gRPC has then logged it too)
        raise OSError(f"cannot listen on {host}:{port} (OTLP/gRPC): address in use or not available")
    return server, bound
