"""OTLP receiver: ``POST /v1/traces`` (and, with ``grpc_port``, OTLP/gRPC) into the store.

Accepts ``application/x-protobuf`` (``ExportTraceServiceRequest``) and ``application/json``
(the OTLP JSON mapping: hex ids, lowerCamelCase or snake_case keys, 64-bit ints as
strings or numbers), optionally ``Content-Encoding: gzip``. The gRPC transport
(``otlp_grpc``, the SDKs' default protocol) feeds the same decoder and ``ingest``. This is
how a vLLM started with ``--otlp-traces-endpoint`` (or any OTel SDK) is recorded.

Safety: binds 127.0.0.1 by default; a body over ``max_body_bytes`` (before or after
gzip) is refused with 413; a malformed request gets 400 and is never partly stored
(a request is parsed whole before anything is appended); each accepted request is
committed before the response, so what was acknowledged survives a crash.

Runs: spans whose resource carries ``kvtrace.run.id`` go to that run (created with mode
``otlp`` if the store lacks it); all other spans go to one run created on first use.
Attributes with a typed column (``kvtrace.*``, ``gen_ai.usage.*_tokens``) land there;
everything else is kept in ``extra_attributes``.
"""

from __future__ import annotations

import json
import threading
import zlib
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
from google.protobuf.message import DecodeError
from google.rpc import status_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from kvtrace.errors import KVTraceError
from kvtrace.instrument.convert import RUN_ID_RESOURCE_KEY, SpanRowsBuilder
from kvtrace.store.schema import SOURCE_OTLP
from kvtrace.store.writer import Store

TRACES_PATH = "/v1/traces"
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
_KINDS = {0: None, 1: None, 2: "Server", 3: "Client", 4: "Producer", 5: "Consumer"}
_KIND_NAMES = {"SPAN_KIND_UNSPECIFIED": 0, "SPAN_KIND_INTERNAL": 1, "SPAN_KIND_SERVER": 2,
               "SPAN_KIND_CLIENT": 3, "SPAN_KIND_PRODUCER": 4, "SPAN_KIND_CONSUMER": 5}
_STATUS = {1: "Ok", 2: "Error"}  # Unset (0) is stored as NULL, as the schema says
_STATUS_NAMES = {"STATUS_CODE_UNSET": 0, "STATUS_CODE_OK": 1, "STATUS_CODE_ERROR": 2}


class PayloadError(ValueError):
    """A request body that is not a valid OTLP trace export (-> 400)."""


# --- protobuf ------------------------------------------------------------------------------
def _any_value(v) -> Any:
    which = v.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [_any_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _any_value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which)


def _kv(attrs) -> dict[str, Any]:
    return {kv.key: _any_value(kv.value) for kv in attrs}


def _bytes_id(raw: bytes, size: int, what: str, where: str, optional: bool = False) -> int | None:
    """An OTLP id (big-endian bytes) as the int the store keeps; None for an absent parent."""
    if optional and not raw:
        return None
    if len(raw) != size:
        raise PayloadError(f"{where}: {what} must be {size} bytes, got {len(raw)}")
    return int.from_bytes(raw, "big")


def decode_protobuf(body: bytes) -> list[tuple[dict, dict]]:
    """-> [(resource attributes, SpanRowsBuilder.add kwargs)]"""
    req = trace_service_pb2.ExportTraceServiceRequest()
    try:
        req.ParseFromString(body)
    except DecodeError as err:
        raise PayloadError(f"not an ExportTraceServiceRequest: {err}") from None
    out = []
    for ri, rs in enumerate(req.resource_spans):
        resource = _kv(rs.resource.attributes)
        for si, ss in enumerate(rs.scope_spans):
            for pi, sp in enumerate(ss.spans):
                where = f"resourceSpans[{ri}].scopeSpans[{si}].spans[{pi}]"
                out.append((resource, dict(
                    name=sp.name,
                    trace_id=_bytes_id(sp.trace_id, 16, "traceId", where),
                    span_id=_bytes_id(sp.span_id, 8, "spanId", where),
                    parent_span_id=_bytes_id(sp.parent_span_id, 8, "parentSpanId", where, optional=True),
                    trace_state=sp.trace_state or None,
                    span_kind=_KINDS.get(sp.kind),
                    start_ns=sp.start_time_unix_nano,
                    end_ns=sp.end_time_unix_nano,
                    attributes=_kv(sp.attributes),
                    resource=resource,
                    scope_name=ss.scope.name or None,
                    scope_version=ss.scope.version or None,
                    status_code=_STATUS.get(sp.status.code),
                    status_message=sp.status.message or None,
                    events=[(e.time_unix_nano, e.name, _kv(e.attributes)) for e in sp.events],
                    links=[(_bytes_id(lk.trace_id, 16, "links.traceId", where), _bytes_id(lk.span_id, 8, "links.spanId", where),
                            lk.trace_state or None, _kv(lk.attributes)) for lk in sp.links],
                )))
    return out


# --- JSON ------------------------------------------------------------------------------------
def _get(d: dict, camel: str, snake: str | None = None, default: Any = None) -> Any:
    if camel in d:
        return d[camel]
    if snake is not None and snake in d:
        return d[snake]
    return default


def _json_int(v: Any, what: str) -> int:
    if isinstance(v, bool):
        raise PayloadError(f"{what}: expected an integer")
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        try:
            return int(v)
        except ValueError:
            pass
    raise PayloadError(f"{what}: expected an integer, got {v!r}"[:200])


def _json_any(v: Any, where: str) -> Any:
    if not isinstance(v, dict):
        raise PayloadError(f"{where}: AnyValue must be an object")
    for key in ("stringValue", "string_value"):
        if key in v:
            return str(v[key])
    for key in ("boolValue", "bool_value"):
        if key in v:
            return bool(v[key])
    for key in ("intValue", "int_value"):
        if key in v:
            return _json_int(v[key], where)
    for key in ("doubleValue", "double_value"):
        if key in v:
            return float(v[key])
    for key in ("arrayValue", "array_value"):
        if key in v:
            return [_json_any(x, where) for x in (v[key] or {}).get("values", [])]
    for key in ("kvlistValue", "kvlist_value"):
        if key in v:
            return _json_kv((v[key] or {}).get("values", []), where)
    for key in ("bytesValue", "bytes_value"):
        if key in v:
            return str(v[key])  # base64 text, kept as given
    return None


def _json_kv(items: Any, where: str) -> dict[str, Any]:
    if items is None:
        return {}
    if not isinstance(items, list):
        raise PayloadError(f"{where}: attributes must be a list")
    out = {}
    for kv in items:
        if not isinstance(kv, dict) or not isinstance(kv.get("key"), str):
            raise PayloadError(f"{where}: attribute without a string key")
        out[kv["key"]] = _json_any(kv.get("value", {}), f"{where}.{kv['key']}")
    return out


def _json_id(v: Any, size: int, what: str, where: str, optional: bool = False) -> int | None:
    """An OTLP/JSON id (hex, as the OTLP JSON mapping writes it) as an int."""
    if optional and not v:
        return None
    if not isinstance(v, str) or len(v) != 2 * size:
        raise PayloadError(f"{where}: {what} must be {2 * size} hex chars")
    try:
        return int.from_bytes(bytes.fromhex(v), "big")
    except ValueError:
        raise PayloadError(f"{where}: {what} must be hex") from None


def _json_enum(v: Any, names: dict[str, int], what: str) -> int:
    if isinstance(v, str) and v in names:
        return names[v]
    return _json_int(v if v is not None else 0, what)


def decode_json(body: bytes) -> list[tuple[dict, dict]]:
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise PayloadError(f"invalid JSON: {err}") from None
    if not isinstance(doc, dict):
        raise PayloadError("expected a JSON object with resourceSpans")
    out = []
    try:
        for ri, rs in enumerate(_get(doc, "resourceSpans", "resource_spans", []) or []):
            resource = _json_kv((_get(rs, "resource", default={}) or {}).get("attributes"), f"resourceSpans[{ri}].resource")
            for si, ss in enumerate(_get(rs, "scopeSpans", "scope_spans", []) or []):
                scope = _get(ss, "scope", default={}) or {}
                for pi, sp in enumerate(_get(ss, "spans", default=[]) or []):
                    where = f"resourceSpans[{ri}].scopeSpans[{si}].spans[{pi}]"
                    status = _get(sp, "status", default={}) or {}
                    out.append((resource, dict(
                        name=str(_get(sp, "name", default="")),
                        trace_id=_json_id(_get(sp, "traceId", "trace_id"), 16, "traceId", where),
                        span_id=_json_id(_get(sp, "spanId", "span_id"), 8, "spanId", where),
                        parent_span_id=_json_id(_get(sp, "parentSpanId", "parent_span_id"), 8, "parentSpanId", where, True),
                        trace_state=_get(sp, "traceState", "trace_state") or None,
                        span_kind=_KINDS.get(_json_enum(_get(sp, "kind"), _KIND_NAMES, f"{where}.kind")),
                        start_ns=_json_int(_get(sp, "startTimeUnixNano", "start_time_unix_nano", 0), f"{where}.startTimeUnixNano"),
                        end_ns=_json_int(_get(sp, "endTimeUnixNano", "end_time_unix_nano", 0), f"{where}.endTimeUnixNano"),
                        attributes=_json_kv(_get(sp, "attributes"), where),
                        resource=resource,
                        scope_name=scope.get("name") or None,
                        scope_version=scope.get("version") or None,
                        status_code=_STATUS.get(_json_enum(_get(status, "code"), _STATUS_NAMES, f"{where}.status")),
                        status_message=status.get("message") or None,
                        events=[(_json_int(_get(e, "timeUnixNano", "time_unix_nano", 0), f"{where}.events"),
                                 str(e.get("name", "")), _json_kv(e.get("attributes"), f"{where}.events"))
                                for e in _get(sp, "events", default=[]) or []],
                        links=[(_json_id(_get(lk, "traceId", "trace_id"), 16, "links.traceId", where),
                                _json_id(_get(lk, "spanId", "span_id"), 8, "links.spanId", where),
                                _get(lk, "traceState", "trace_state") or None, _json_kv(lk.get("attributes"), f"{where}.links"))
                               for lk in _get(sp, "links", default=[]) or []],
                    )))
    except (AttributeError, TypeError) as err:  # a list where an object belongs, and the like
        raise PayloadError(f"malformed OTLP JSON: {err}") from None
    return out


# --- the collector ---------------------------------------------------------------------------
def _gunzip(body: bytes, limit: int) -> bytes:
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = d.decompress(body, limit + 1)
    except zlib.error as err:
        raise PayloadError(f"bad gzip body: {err}") from None
    if len(out) > limit or d.unconsumed_tail:
        raise OverflowError
    if not d.eof:
        raise PayloadError("truncated gzip body")
    return out


class OTLPCollector:
    """The receiver as an object: ``start()`` serves on a thread, ``stop()`` flushes and closes."""

    def __init__(self, store_path: str | Path, host: str = "127.0.0.1", port: int = 4318,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, run_name: str | None = None,
                 grpc_port: int | None = None):
        """``port``/``grpc_port`` 0: any free port; ``grpc_port`` None: no gRPC. Raises
        KVTraceError when an address cannot be bound."""
        self.store_path = str(store_path)
        self.max_body_bytes = max_body_bytes
        self.store = Store.open(self.store_path)
        self.run_name = run_name
        self._lock = threading.Lock()
        self._default_run: str | None = None
        self._known_runs: set[str] = set()
        self._created_runs: list[str] = []
        self.spans_received = 0
        self.requests_rejected = 0
        try:
            self._server = ThreadingHTTPServer((host, port), _make_handler(self))
        except OSError as err:
            raise KVTraceError(f"cannot listen on {host}:{port} (OTLP/HTTP): {err.strerror or err}") from None
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None
        self._grpc = None
        self.grpc_port: int | None = None
        if grpc_port is not None:
            from kvtrace.instrument.otlp_grpc import grpc_server  # grpcio is loaded only when served

            try:
                self._grpc, self.grpc_port = grpc_server(self, host, grpc_port, max_body_bytes)
            except OSError as err:
                self._server.server_close()
                raise KVTraceError(str(err)) from None

    @property
    def address(self) -> tuple[str, int]:
        return self._server.server_address[:2]

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{host}:{port}{TRACES_PATH}"

    @property
    def grpc_target(self) -> str | None:
        """``host:port`` of the OTLP/gRPC endpoint, or None when not served."""
        return None if self.grpc_port is None else f"{self.address[0]}:{self.grpc_port}"

    def start(self) -> "OTLPCollector":
        if self._grpc is not None:
            self._grpc.start()
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvtrace-otlp", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        if self._grpc is not None:
            self._grpc.start()
        self._server.serve_forever()

    def _close_servers(self) -> None:
        if self._grpc is not None:
            self._grpc.stop(grace=2).wait()  # in-flight exports finish, new ones are refused
        self._server.server_close()

    def stop(self) -> None:
        self._server.shutdown()
        self._close_servers()
        if self._thread is not None:
            self._thread.join()
        self.close_store()

    def close_store(self) -> None:
        """Commit, mark the runs this collector created complete, and close the store."""
        with self._lock:
            for run_id in self._created_runs:
                self.store.finish_run(run_id, status="complete")
            self._created_runs = []
            self.store.close()

    # -- ingest ------------------------------------------------------------------------------
    def ingest(self, spans: list[tuple[dict, dict]]) -> int:
        """Append decoded spans (grouped by run) and commit; returns the count."""
        by_run: dict[str, SpanRowsBuilder] = {}
        with self._lock:
            for resource, kwargs in spans:
                run_id = self._run_for(resource)
                rows = by_run.get(run_id)
                if rows is None:
                    rows = by_run[run_id] = SpanRowsBuilder()
                rows.add(default_source=SOURCE_OTLP, **kwargs)
            tables: list[tuple[str, pa.Table]] = [(r, b.to_table()) for r, b in by_run.items()]
            for run_id, table in tables:
                self.store.append_spans(table, run_id=run_id)
            self.store.flush()
            self.spans_received += len(spans)
        return len(spans)

    def _run_for(self, resource: dict) -> str:
        run_id = resource.get(RUN_ID_RESOURCE_KEY)
        if not isinstance(run_id, str) or not run_id:
            if self._default_run is None:
                host, port = self.address
                self._default_run = self.store.create_run(self.run_name or f"otlp collector {host}:{port}", mode="otlp")
                self._created_runs.append(self._default_run)
            return self._default_run
        if run_id not in self._known_runs:
            if not self.store.has_run(run_id):
                self.store.create_run(f"otlp {run_id}", run_id=run_id, mode="otlp")
                self._created_runs.append(run_id)
            self._known_runs.add(run_id)
        return run_id


def _make_handler(collector: OTLPCollector) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "kvtrace-otlp/0.1"

        def log_message(self, fmt, *args):  # quiet: the CLI reports counts instead
            pass

        def _reply(self, code: int, body: bytes, content_type: str, close: bool = False) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(body)

        def _error(self, code: int, message: str, as_json: bool, close: bool = False) -> None:
            collector.requests_rejected += 1
            grpc_code = 3 if code == 400 else 8 if code == 413 else 2
            if as_json:
                body = json.dumps({"code": grpc_code, "message": message}).encode()
                self._reply(code, body, "application/json", close)
            else:
                body = status_pb2.Status(code=grpc_code, message=message).SerializeToString()
                self._reply(code, body, "application/x-protobuf", close)

        def do_GET(self):
            self._error(HTTPStatus.METHOD_NOT_ALLOWED, "use POST /v1/traces", True)

        def do_POST(self):
            ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
            as_json = ctype == "application/json"
            if self.path.split("?")[0] != TRACES_PATH:
                self._drain_or_close()
                return self._error(HTTPStatus.NOT_FOUND, f"only {TRACES_PATH} is served here", as_json, True)
            length = self.headers.get("Content-Length")
            if length is None or not length.isdigit():
                return self._error(HTTPStatus.LENGTH_REQUIRED, "Content-Length required", as_json, True)
            length = int(length)
            limit = collector.max_body_bytes
            if length > limit:
                return self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                   f"body of {length} bytes exceeds the limit of {limit}", as_json, True)
            body = self.rfile.read(length)
            if ctype not in ("application/x-protobuf", "application/json"):
                return self._error(HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                                   "Content-Type must be application/x-protobuf or application/json", as_json)
            encoding = (self.headers.get("Content-Encoding") or "identity").strip().lower()
            try:
                if encoding == "gzip":
                    body = _gunzip(body, limit)
                elif encoding != "identity":
                    return self._error(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, f"Content-Encoding {encoding} not supported", as_json)
                spans = decode_json(body) if as_json else decode_protobuf(body)
            except OverflowError:
                return self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                   f"decompressed body exceeds the limit of {limit} bytes", as_json)
            except PayloadError as err:
                return self._error(HTTPStatus.BAD_REQUEST, str(err), as_json)
            try:
                collector.ingest(spans)
            except KVTraceError as err:  # store busy or unusable: the client may retry
                return self._error(HTTPStatus.SERVICE_UNAVAILABLE, str(err), as_json)
            if as_json:
                self._reply(HTTPStatus.OK, b"{}", "application/json")
            else:
                self._reply(HTTPStatus.OK, trace_service_pb2.ExportTraceServiceResponse().SerializeToString(),
                            "application/x-protobuf")

        def _drain_or_close(self) -> None:
            self.close_connection = True

    return Handler


def serve_collector(store_path: str | Path, host: str = "127.0.0.1", port: int = 4318,
                    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, grpc_port: int | None = None,
                    on_ready: Callable[[OTLPCollector], None] | None = None) -> OTLPCollector:
    """Serve until interrupted (Ctrl-C), then commit and close the store; returns the collector."""
    collector = OTLPCollector(store_path, host, port, max_body_bytes, grpc_port=grpc_port)
    if on_ready is not None:
        on_ready(collector)
    try:
        collector.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        collector._close_servers()
        collector.close_store()
    return collector
