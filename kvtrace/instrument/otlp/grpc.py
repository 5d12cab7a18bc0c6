"""OTLP/gRPC receiver: ``opentelemetry.proto.collector.trace.v1.TraceService/Export``.

gRPC is the OTel SDKs' default OTLP protocol, vLLM's ``--otlp-traces-endpoint`` among
them, so ``kvtrace collect`` serves it next to OTLP/HTTP. The method takes the request
as raw bytes, decodes it with the same ``decode_protobuf`` as the HTTP path and hands
the spans to the ``ingest`` callable it was given (the collector's): the same rows, the
same runs. This module knows nothing of the collector. Status codes follow the OTLP
spec: a malformed request gets INVALID_ARGUMENT and stores nothing; an oversized one
RESOURCE_EXHAUSTED (gRPC's receive limit, set to the body limit); an unusable store
(``ingest`` raising ``KVTraceError``) UNAVAILABLE, which exporters retry.

The method is served as a client-streaming one so that the handler, not gRPC, waits for
the request: gRPC's unary handling waits for the message on one of its worker threads
with no time limit, and four callers that opened a call and never sent it held all four
workers, every other exporter timing out behind them. A call whose message (and end) has
not come within the read deadline (``read_timeout_s`` plus the largest body at
MIN_BODY_BYTES_PER_S, the HTTP body's deadline) is cancelled; at most MAX_CONNECTIONS
calls are served at once (more get RESOURCE_EXHAUSTED, which exporters retry), each a
worker, decoding in the ``decode_slots`` HTTP decodes in too. A call of two or more
request messages (a client streaming to a unary method: gRPC answered OK and dropped all
but the first) is INVALID_ARGUMENT, nothing of it stored.

A busy or unavailable address is found by binding a plain socket to it first
(``kvtrace.process.probe_address``): gRPC's C core would log its own failure to stderr,
and kvtrace reports it as one line instead.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from kvtrace.errors import KVTraceError
from kvtrace.instrument.otlp.decode import PayloadError, decode_protobuf
from kvtrace.instrument.otlp.guard import Deadlines
from kvtrace.instrument.otlp.limits import MAX_CONNECTIONS, MIN_BODY_BYTES_PER_S, READ_TIMEOUT_S
from kvtrace.process import bracketed, probe_address

SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
EXPORT_METHOD = f"/{SERVICE}/Export"
GRPC_MAX_MESSAGE_BYTES = (1 << 31) - 1  # grpc.max_receive_message_length, an int32
_OK = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
_log = logging.getLogger(__name__)


class _NotSent(Exception):
    """A call whose request did not come by its deadline (cancelled), or that its client cancelled."""


class GrpcReceiver:
    """The gRPC server and its worker pool: ``stop`` ends both (gRPC's ``stop`` leaves its
    pool's threads, up to MAX_CONNECTIONS of them, alive for good in the process that
    served: every collector stopped in a long-lived process left its workers behind)."""

    def __init__(self, server: grpc.Server, pool: ThreadPoolExecutor):
        self.server, self._pool = server, pool

    def start(self) -> None:
        self.server.start()

    def stop(self, grace: float | None) -> None:
        """Refuse new calls, give those in flight ``grace`` seconds (then cancel them),
        and end the workers once their handlers return."""
        self.server.stop(grace=grace).wait()
        self._pool.shutdown(wait=True)


class _Unserved(grpc.GenericRpcHandler):
    """Every method but ``Export``: UNIMPLEMENTED naming the one served, and counted as a
    refused request (``on_reject``), as OTLP/HTTP's 404 for ``/v1/metrics`` is. gRPC's own
    UNIMPLEMENTED was counted nowhere: an SDK sending its metrics or logs to the traces port
    over gRPC read "0 requests rejected", over HTTP each refusal counted. The request is
    never read."""

    def __init__(self, on_reject: Callable[[], None]):
        self._on_reject = on_reject

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = ascii(handler_call_details.method)[1:-1][:200]  # (the client's text, quoted in its status)

        def refuse(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
            self._on_reject()
            context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{method}: only {EXPORT_METHOD} is served here")
            return b""  # not reached

        return grpc.stream_unary_rpc_method_handler(refuse)


def grpc_server(ingest: Callable[..., object], host: str, port: int, max_body_bytes: int,
                on_reject: Callable[[], None] = lambda: None, read_timeout_s: float = READ_TIMEOUT_S,
                decode_slots: contextlib.AbstractContextManager | None = None,
                deadlines: Deadlines | None = None) -> tuple[GrpcReceiver, int]:
    """A bound, not yet started gRPC server (with its worker pool: a ``GrpcReceiver``)
    whose ``Export`` decodes a request and calls ``ingest(spans, wanted=context.is_active)``
    (a call cancelled, or past its deadline, is not stored); returns it and its port.
    ``on_reject`` is called once per request refused (malformed, not sent by its
    deadline, refused by gRPC itself: too large, a bomb, an unknown grpc-encoding; cancelled
    by its client before it was read; or ``ingest`` raised ``KVTraceError``).
    ``decode_slots``: held while a request is decoded and stored (the collector's, shared
    with OTLP/HTTP). ``deadlines``: the watchdog that cancels a call not sent in time (the
    collector's, closed with it; None: one of its own).

    Raises OSError when the address cannot be bound (as the HTTP server does)."""
    read_s = read_timeout_s + max_body_bytes / MIN_BODY_BYTES_PER_S
    if deadlines is None:
        deadlines = Deadlines(min(1.0, read_timeout_s / 4))
    slots = decode_slots if decode_slots is not None else threading.BoundedSemaphore(4)

    def one_request(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        """The call's one request message, read within ``read_s``; _NotSent when the call
        was cancelled (by the client, or past that: then counted and logged first)."""
        late = threading.Event()

        def cancel() -> None:  # (the watchdog's thread)
            late.set()
            on_reject()
            _log.warning("OTLP/gRPC export from %s dropped: its request did not come within %.0f s", context.peer(),
                         read_s)
            context.cancel()

        deadlines.set(context, read_s, cancel)
        unread, first, extra = False, None, None
        try:
            first = next(requests, None)
            extra = None if first is None else next(requests, None)
        except grpc.RpcError:  # cancelled: by the watchdog (counted), by the client, or by gRPC itself
            unread = True
        finally:
            deadlines.clear(context)
        if late.is_set():  # (it came as the deadline passed: cancelled, counted)
            raise _NotSent
        if unread or first is None:
            # gRPC refuses a message past the receive limit (or past it decompressed: a gzip bomb)
            # or a grpc-encoding it does not know before the handler sees a byte, ending the call:
            # the handler finds an error, or (as a call its client ended without a message) no
            # message. Counted as refused and logged, as HTTP's 413s are (it said "0 requests rejected").
            _log.warning("OTLP/gRPC export from %s refused, nothing stored: no request message could be read "
                         "(larger than %d bytes, whole or decompressed; a compression gRPC does not know; or none "
                         "sent: cancelled or ended by its client)", context.peer() or "a client", max_body_bytes)
            if not unread:  # (no message: answered INVALID_ARGUMENT, and counted, by export)
                raise PayloadError("the call carried no ExportTraceServiceRequest")
            on_reject()
            raise _NotSent
        if extra is not None:
            raise PayloadError("more than one ExportTraceServiceRequest in one call (Export is unary): none stored")
        return first

    def export(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        try:
            request = one_request(requests, context)
            with slots:
                ingest(decode_protobuf(request), wanted=context.is_active)
            return _OK
        except _NotSent:  # nobody to answer
            return b""
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

    probe_address(host, port, "OTLP/gRPC", flag="--grpc-port")
    # No (de)serialisers: the method sees the request's bytes, as the HTTP handler does.
    handler = grpc.method_handlers_generic_handler(SERVICE, {"Export": grpc.stream_unary_rpc_method_handler(export)})
    unserved = _Unserved(on_reject)
    pool = ThreadPoolExecutor(max_workers=MAX_CONNECTIONS, thread_name_prefix="kvtrace-otlp-grpc")
    server = grpc.server(
        pool,
        handlers=[handler, unserved],
        # (gRPC's limit is a C int: --max-body-bytes' largest value, 2^31, was an OverflowError
        # and a traceback at start; a message is 1 byte short of it at most)
        options=[("grpc.max_receive_message_length", min(max_body_bytes, GRPC_MAX_MESSAGE_BYTES)),
                 ("grpc.so_reuseport", 0)],
        maximum_concurrent_rpcs=MAX_CONNECTIONS,
    )
    try:
        bound = server.add_insecure_port(f"{bracketed(host)}:{port}")
    except RuntimeError:  # grpcio raises where older versions returned 0
        bound = 0
    if not bound:  # taken between the probe and here (gRPC has then logged it too)
        pool.shutdown(wait=False)
        raise OSError(f"cannot listen on {bracketed(host)}:{port} (OTLP/gRPC): address in use or not available")
    return GrpcReceiver(server, pool), bound
