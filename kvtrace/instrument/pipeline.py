"""Tracer setup: one ``TracerProvider`` feeding the DuckDB store and/or an OTLP collector.

``--otlp-endpoint URL`` uses the SDK's OTLP/HTTP (protobuf) exporter, or its OTLP/gRPC
exporter when ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL`` says
``grpc``. The other standard variables are honoured because the SDK reads them:
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT`` (when no URL is
given), ``..._HEADERS``, ``..._TIMEOUT``, ``..._COMPRESSION``, ``..._CERTIFICATE`` and
friends, plus ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` for the resource.
Without ``..._TIMEOUT``, an export (the SDK's retries included) is bounded at
``EXPORT_TIMEOUT_S``, so a dead collector costs seconds, not a long backoff.

``recording`` keeps the SDK exporters' per-retry log lines off stderr and ends, once the
spans are flushed, with ``SpansNotDelivered`` when a collector refused or never got
some: the caller says so in one line (the store's copy is unaffected).
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlparse

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter

from kvtrace.errors import ConfigError, KVTraceError
from kvtrace.instrument.convert import RUN_ID_RESOURCE_KEY
from kvtrace.instrument.exporter import DuckDBSpanExporter, check_span_sink
from kvtrace.instrument.ids import SeededIdGenerator, check_id_seed
from kvtrace.instrument.instrumentor import DEFAULT_STEP_NS, KVCacheInstrumentor, provider_span_processors
from kvtrace.instrument.processor import BulkSpanProcessor
from kvtrace.names import OTLP_ENDPOINT_VARIABLES, errno_phrase, otlp_requested, shown_value
from kvtrace.store.schema import SPAN_RUN, TIME_OFFSET_RESOURCE_KEY

_ENV_ENDPOINTS = OTLP_ENDPOINT_VARIABLES
_ENV_PROTOCOLS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
_ENV_TIMEOUTS = ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT")
_ENV_COMPRESSIONS = ("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "OTEL_EXPORTER_OTLP_COMPRESSION")
_ENV_HEADERS = ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS")
# What each protocol's SDK exporter takes (its gRPC one raises on anything but gzip; its
# HTTP one logs a line and fails every export)
_COMPRESSIONS = {"http/protobuf": ("gzip", "deflate", "none"), "grpc": ("gzip",)}
# One header of OTEL_EXPORTER_OTLP_HEADERS as the SDK reads it (opentelemetry.util.re's
# liberal key=value; the SDK logs and drops any other)
_HEADER = re.compile(r"[ \t]*[\x21\x23-\x27\x2a\x2b\x2d\x2e\x30-\x39\x41-\x5a\x5e-\x7a\x7c\x7e]+[ \t]*="
                     r"[\x20\x21\x23-\x2b\x2d-\x3a\x3c-\x5b\x5d-\x7e]*")
PROTOCOLS = ("http/protobuf", "grpc")
EXPORT_TIMEOUT_S = 5.0  # one export, retries included, unless the OTEL_* timeout says otherwise
# The longest OTEL_* timeout taken: the SDK adds it to the clock for each export's deadline
# (1e10 s was past time_t: every span failed, 'timestamp out of range for platform time_t')
MAX_EXPORT_TIMEOUT_S = 86_400.0
RESOURCE_VARIABLE = "OTEL_RESOURCE_ATTRIBUTES"
# Where the SDK's exporters (and kvtrace's processor) log each failed try.
_EXPORT_LOGGERS = ("opentelemetry.exporter.otlp.proto.http.trace_exporter",
                   "opentelemetry.exporter.otlp.common.http", "opentelemetry.exporter.otlp.proto.grpc.exporter",
                   "kvtrace.instrument.processor")


class SpansNotDelivered(KVTraceError):
    """Spans an OTLP collector did not take (refused, or unreachable after the retries)."""

    def __init__(self, endpoint: str, failed: int, total: int, reason: str | None, records: int = 0):
        # (the run records travel as spans too: "1,338 of 1,338" beside a run of 1,336 spans, its
        # opening record and its closing one)
        said = [reason] if reason else []
        if records:
            which = f"its {SPAN_RUN} record" if records == 1 else f"its {records:,} {SPAN_RUN} records"
            said.append(f"of the run's {total - records:,} and {which}")
        why = f" ({'; '.join(said)})" if said else ""
        super().__init__(f"{endpoint}: {failed:,} of {total:,} spans were not delivered{why}"[:400])
        self.endpoint, self.failed, self.total = endpoint, failed, total


def otlp_protocol() -> str:
    """The OTLP protocol the standard variables ask for (traces-specific first), else
    http/protobuf; one the SDK cannot send (http/json) is a ConfigError."""
    for key in _ENV_PROTOCOLS:
        value = os.environ.get(key, "").strip().lower()
        if value:
            if value not in PROTOCOLS:
                raise ConfigError(key, value, f"kvtrace sends OTLP as {' or '.join(PROTOCOLS)}")
            return value
    return PROTOCOLS[0]


def traces_url(endpoint: str, where: str = "--otlp-endpoint") -> str:
    """A collector base URL gets the OTLP/HTTP traces path; a full URL is kept. ``where``:
    the flag or variable named when it is malformed."""
    try:
        parsed = urlparse(endpoint)
        parsed.port  # noqa: B018  # a port out of range or not a number raises here
    except ValueError:  # e.g. an unclosed IPv6 bracket
        parsed = None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ConfigError(where, _shown(endpoint), "expected an http(s)://HOST:PORT[/v1/traces] URL")
    # a bare ':' meant port 80 to the SDK, and no connection goes to port 0: both were
    # found out only after the whole replay, as every span not delivered
    if parsed.port == 0 or parsed.netloc.endswith(":"):
        raise ConfigError(where, _shown(endpoint), "expected a port from 1 to 65535 in the http(s)://HOST:PORT URL")
    if parsed.path in ("", "/"):
        # the path goes before a query or fragment: appended after one it was part of it (a 404)
        return parsed._replace(path="/v1/traces").geturl()
    return endpoint


_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(?::([0-9]{1,5}))?")  # (no port: gRPC's 443)


def _grpc_target(text: str, where: str) -> None:
    """An OTLP/gRPC endpoint: an http(s) URL, or HOST[:PORT] (gRPC also names unix: and dns:
    targets, passed as they are); ConfigError naming ``where`` for anything else."""
    scheme = next((p for p in ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:") if text.startswith(p)), None)
    if scheme is not None:
        if not text[len(scheme):].strip("/ "):  # (an empty target: the whole replay, then every span undelivered)
            raise ConfigError(where, _shown(text), f"expected a target after {scheme}")
        return
    if "://" in text:
        traces_url(text, where)
        return
    m = _HOST_PORT.fullmatch(text)
    if m is None or (m.group(2) is not None and not 0 < int(m.group(2)) < 65_536):
        raise ConfigError(where, _shown(text), "expected HOST:PORT or an http(s)://HOST:PORT URL for OTLP/gRPC")


# USER:PASSWORD@ of an endpoint, with a scheme or without one (which the error line's URL
# masking never sees), to the last @: a password may hold an unencoded @, / or space
_PASSWORD = re.compile(r"^((?:[A-Za-z][A-Za-z0-9+.-]*://)?[^@/\s:]*):.*@")


def _shown(endpoint: str) -> str:
    """An endpoint as an error may quote it: its password masked."""
    return _PASSWORD.sub(r"\1:***@", endpoint, count=1)


def check_otlp_settings(endpoint: str | None) -> None:
    """Refuse a malformed ``endpoint`` (or endpoint variable, for OTLP/HTTP), protocol or
    OTEL_* timeout before anything is recorded (the SDK logs and ignores a non-number,
    fails every export on a timeout <= 0, and sends nothing to a URL it cannot parse)."""
    protocol = otlp_protocol()
    if endpoint and protocol == "grpc":
        _grpc_target(endpoint, "--otlp-endpoint")  # as the variables: HOST:PORT or an http(s) URL
    elif endpoint:
        traces_url(endpoint)
    else:
        key = next((k for k in _ENV_ENDPOINTS if os.environ.get(k)), None)
        if key is not None and protocol != "grpc":
            _env_traces_url(key)
        elif key is not None:
            _grpc_target(os.environ[key], key)
    for key in _ENV_TIMEOUTS:
        text = os.environ.get(key)
        if text:
            try:
                ok = math.isfinite(float(text)) and 0 < float(text) <= MAX_EXPORT_TIMEOUT_S
            except ValueError:
                ok = False
            if not ok:
                raise ConfigError(key, shown_value(text), f"expected a positive number of seconds, at most "
                                                          f"{MAX_EXPORT_TIMEOUT_S:,.0f} (a day)")
    for key in _ENV_COMPRESSIONS:
        text = os.environ.get(key)
        allowed = _COMPRESSIONS.get(protocol, _COMPRESSIONS["http/protobuf"])
        if text is not None and text.strip().lower() not in allowed:
            raise ConfigError(key, repr(text), f"expected {' or '.join(allowed)} for OTLP over {protocol}")
    for key in _ENV_HEADERS:
        for header in re.split(r"[ \t]*,[ \t]*", os.environ.get(key) or ""):
            if header and not _HEADER.fullmatch(header):
                raise ConfigError(key, repr(header)[:100], "expected comma-separated NAME=VALUE headers "
                                                           "(values URL-encoded)")


def check_resource_variable() -> None:
    """Refuse an OTEL_RESOURCE_ATTRIBUTES the SDK would log and drop in part, before anything
    is recorded: an item without ``=`` (an empty one too: ``a=1,,b=2``) or with an empty key
    each printed a warning line mid-run, and that pair was left out of every span's resource."""
    text = os.environ.get(RESOURCE_VARIABLE)
    for item in (text or "").split(",") if text else ():
        key, eq, _ = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(RESOURCE_VARIABLE, shown_value(item), "expected comma-separated KEY=VALUE pairs "
                                                                    "(values URL-encoded), no empty one")


def otlp_span_exporter(endpoint: str | None = None) -> SpanExporter:
    """The SDK's OTLP exporter for ``otlp_protocol()``; ``endpoint=None`` leaves the
    address to the OTEL_* variables. For gRPC, ``http://`` means no TLS, and a bare HOST:PORT
    TLS unless OTEL_EXPORTER_OTLP_INSECURE=true (the SDK's reading)."""
    check_otlp_settings(endpoint)
    kw: dict[str, Any] = {}
    if not any(os.environ.get(k) for k in _ENV_TIMEOUTS):
        kw["timeout"] = EXPORT_TIMEOUT_S
    if otlp_protocol() == "grpc":
        # gRPC's C core logs each failed connection attempt on stderr (a TLS handshake a line),
        # beside the one line that says the spans were not delivered; GRPC_VERBOSITY shows them
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter

        if endpoint is not None:
            kw["endpoint"] = endpoint  # (checked above; HOST:PORT is TLS unless OTEL_EXPORTER_OTLP_INSECURE=true)
        return GrpcSpanExporter(**kw)
    if endpoint:
        kw["endpoint"] = traces_url(endpoint)
    else:
        key = next((k for k in _ENV_ENDPOINTS if os.environ.get(k)), None)
        if key is not None:
            kw["endpoint"] = _env_traces_url(key)
    # imported here, as the gRPC one: its protobuf modules cost a replay without an endpoint 80 ms
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(**kw)


def _env_traces_url(key: str) -> str:
    """The traces URL an OTLP/HTTP endpoint variable names, as the OTel spec reads it: the
    traces variable as given, the base one with v1/traces appended to its path, before any
    query (the SDK appended it after one: every span a 404, found out after the run)."""
    value = os.environ[key]
    traces_url(value, where=key)  # (checked as the flag is)
    parsed = urlparse(value)
    if key == _ENV_ENDPOINTS[0]:
        if parsed.path in ("", "/"):  # (the SDK posts to it as given: a collector's 404 for each span)
            raise ConfigError(key, _shown(value), "the traces variable is the whole URL, as the SDK sends to it: "
                                                  "write its path too (http(s)://HOST:PORT/v1/traces)")
        return value
    return parsed._replace(path=parsed.path.rstrip("/") + "/v1/traces").geturl()


def otlp_destination(endpoint: str | None) -> str:
    """What the error line calls the collector: the flag, or the variable, that named it."""
    if endpoint:
        return f"--otlp-endpoint {endpoint}"
    key = next((k for k in _ENV_ENDPOINTS if os.environ.get(k)), _ENV_ENDPOINTS[-1])
    return f"{key}={os.environ.get(key, '')}"


_RETRY_NOTE = re.compile(r",? retrying in [0-9.]+ ?s\.?")


class _FirstFailure(logging.Filter):
    """Keeps a logger's warnings and errors off stderr, remembering the first."""

    def __init__(self) -> None:
        super().__init__()
        self.first: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            if self.first is None:
                text = " ".join(record.getMessage().split())
                errno = errno_phrase(text)  # HTTP: "[Errno 111] Connection refused"
                details = text.partition("Error details: ")[2]  # gRPC: "failed to connect to all addresses; ..."
                # (the SDK's note of its next try: said after the last one, it read as a retry still to come)
                self.first = errno or _RETRY_NOTE.sub("", details or text)[:200]
            return False
        return True


@contextmanager
def _quiet_exporters(active: bool) -> Iterator[_FirstFailure]:
    quiet = _FirstFailure()
    loggers = [logging.getLogger(name) for name in _EXPORT_LOGGERS] if active else []
    for lg in loggers:
        lg.addFilter(quiet)
    try:
        yield quiet
    finally:
        for lg in loggers:
            lg.removeFilter(quiet)


def export_time_offset(time_offset_ns: int | None = None) -> int:
    """The offset an OTLP export adds to a run's virtual times: ``time_offset_ns`` when
    given and non-zero (a ClickHouse store's, so both copies agree), else the wall clock
    now in whole seconds. A collector's ``otel_traces`` has a TTL (180 days by default)
    that drops spans stamped near the epoch at insert; receivers subtract the offset,
    which the resource carries (``TIME_OFFSET_RESOURCE_KEY``). Metadata only: no digest
    and no stored view depends on it."""
    return int(time_offset_ns) if time_offset_ns else time.time_ns() // 1_000_000_000 * 1_000_000_000


def make_resource(run_id: str | None, service_name: str | None = None,
                  attributes: Mapping[str, Any] | None = None, time_offset_ns: int | None = None) -> Resource:
    """SDK resource (reads OTEL_RESOURCE_ATTRIBUTES / OTEL_SERVICE_NAME) plus the run id
    (and, for an OTLP export, its time offset).

    ``service_name`` wins when given; else OTEL_SERVICE_NAME; else ``kvtrace``.
    """
    check_resource_variable()
    attrs: dict[str, Any] = dict(attributes or {})
    if time_offset_ns is not None:
        attrs[TIME_OFFSET_RESOURCE_KEY] = int(time_offset_ns)
    if service_name is not None:
        attrs["service.name"] = service_name
    if run_id is not None:
        attrs[RUN_ID_RESOURCE_KEY] = run_id
    resource = Resource.create(attrs)
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "kvtrace"}))
    return resource


def build_tracer_provider(
    *,
    store=None,
    run_id: str | None = None,
    otlp_endpoint: str | None = None,
    seed: int = 0,
    service_name: str | None = None,
    resource_attributes: Mapping[str, Any] | None = None,
    background: bool = False,
    otlp_batch_size: int = 512,
    time_offset_ns: int | None = None,
    export_run_id: str | None = None,
    export: bool = True,
) -> TracerProvider:
    """A provider with a never-dropping processor per destination.

    ``store`` + ``run_id``: spans go to the DuckDB store (columnar fast path).
    ``otlp_endpoint`` (or the OTEL_EXPORTER_OTLP_* variables): spans also go over OTLP
    (HTTP, or gRPC when the protocol variable says so), their times shifted by
    ``export_time_offset(time_offset_ns)`` and numbered (``kvtrace.seq``).
    ``background``: the DuckDB export runs on a worker thread behind a bounded blocking
    queue (off by default: on 2 busy cores inline measured as fast), which commits the
    store's once-a-second flush on time between hand-overs (``Store.flush_when_idle``); the OTLP export
    always does, so network waits overlap the replay. ``export_run_id``: the run id the
    OTLP export names (``kvtrace.run.id``; default ``run_id``), see ``unique_export_run_id``.
    Call ``provider.force_flush()`` before ``store.finish_run`` and ``shutdown()`` at the end.
    """
    # (what it cannot use, refused before anything starts: a path for the store was an
    # AttributeError at the first hand-over, an int endpoint one inside urllib)
    if store is not None:
        check_span_sink(store, run_id, "build_tracer_provider")
    elif run_id is not None and not isinstance(run_id, str):
        raise ConfigError("build_tracer_provider", "run_id", f"expected a string, got {shown_value(run_id)}")
    for name, text in (("otlp_endpoint", otlp_endpoint), ("service_name", service_name),
                       ("export_run_id", export_run_id)):
        if text is not None and not isinstance(text, str):
            raise ConfigError("build_tracer_provider", name, f"expected a string, got {shown_value(text)}")
    if resource_attributes is not None and not isinstance(resource_attributes, Mapping):
        raise ConfigError("build_tracer_provider", "resource_attributes",
                          f"expected a mapping of attribute names to values, got {shown_value(resource_attributes)}")
    for name, flag in (("background", background), ("export", export)):
        if not isinstance(flag, bool):  # (a numpy array: its truth ValueError; "no": taken as true)
            raise ConfigError("build_tracer_provider", name, f"expected True or False, got {shown_value(flag)}")
    check_id_seed(seed, "build_tracer_provider")
    exporting = export and otlp_requested(otlp_endpoint)  # (export False: never, whatever OTEL_* says)
    offset = export_time_offset(time_offset_ns) if exporting else None
    resource = make_resource(run_id, service_name, resource_attributes, offset)
    provider = TracerProvider(resource=resource, id_generator=SeededIdGenerator(seed))
    if store is not None:
        assert run_id is not None  # (check_span_sink's)
        # background: the export thread also commits what waits once it is due, between
        # hand-overs (a store not of kvtrace.store, a sweep worker's in memory, has no need)
        provider.add_span_processor(
            BulkSpanProcessor(DuckDBSpanExporter(store, run_id), background=background, run_id=run_id,
                              idle_flush=getattr(store, "flush_when_idle", None) if background else None)
        )
    if exporting:
        exported = resource if export_run_id is None else make_resource(export_run_id, service_name,
                                                                        resource_attributes, offset)
        provider.add_span_processor(
            BulkSpanProcessor(otlp_span_exporter(otlp_endpoint), background=True,
                              max_export_batch_size=otlp_batch_size, resource=exported,
                              run_id=export_run_id or run_id, time_offset_ns=offset or 0, number_spans=True)
        )
    return provider


def _give_up(exports: Sequence[BulkSpanProcessor]) -> None:
    """A stopped recording's exports get one export's time for what is queued, then none."""
    for proc in exports:
        proc.give_up_after(EXPORT_TIMEOUT_S)


def unique_export_run_id(local_run_id: str | None) -> str:
    """The run id a replay's OTLP export names: one of its own. A collector keys runs by
    ``kvtrace.run.id``, so every replay without a store (all ``unrecorded``) was one run
    there, as were two stores' ``r1``s. The local id (if any) then a random suffix, as OTel's
    ``service.instance.id`` is a UUID: a label of the export, in no digest and no span id."""
    import uuid

    return f"{local_run_id or 'replay'}-{uuid.uuid4().hex[:12]}"


@contextmanager
def recording(
    *,
    store=None,
    run_id: str | None = None,
    otlp_endpoint: str | None = None,
    seed: int = 0,
    background: bool = False,
    step_ns: int | None = None,
    time_offset_ns: int | None = None,
    resource_attributes: Mapping[str, Any] | None = None,
    export_run_id: str | None = None,
    export: bool = True,
) -> Iterator[KVCacheInstrumentor]:
    """Record one run: yields an instrumentor to pass as a step listener (or to
    ``instrument(manager)``); on exit every pending span is exported and the processors
    are shut down, also when the body raises (Ctrl-C included), so what was emitted
    reaches the store before the caller marks the run finished or failed.

        with store_ctx as store, recording(store=store, run_id=run_id) as inst:
            Engine(preset).run(workload, listeners=[inst])
        store.finish_run(run_id, ...)

    Raises ``SpansNotDelivered`` on exit (after everything is flushed, only when the body
    did not raise) if an OTLP collector did not take every span.
    """
    provider = build_tracer_provider(store=store, run_id=run_id, otlp_endpoint=otlp_endpoint,
                                     seed=seed, background=background, time_offset_ns=time_offset_ns,
                                     resource_attributes=resource_attributes, export_run_id=export_run_id,
                                     export=export)
    inst = KVCacheInstrumentor(provider, run_id=run_id,
                               step_ns=DEFAULT_STEP_NS if step_ns is None else step_ns).instrument()
    otlp = [p for p in provider_span_processors(provider)
            if isinstance(p, BulkSpanProcessor) and not isinstance(p.exporter, DuckDBSpanExporter)]
    with _quiet_exporters(bool(otlp)) as quiet:
        try:
            yield inst
        except BaseException:
            # stopped or failed: the store gets everything; a collector gets what it takes
            # within one export's time (a slow one held a SIGTERM for its whole queue)
            _give_up(otlp)
            raise
        finally:
            try:
                inst.uninstrument()
                provider.force_flush()
            except BaseException:
                # stopped while the queue drained (the body had ended): the same one export's
                # time, not the whole queue's again in the shutdown below (24 s to a slow collector)
                _give_up(otlp)
                raise
            finally:
                provider.shutdown()
    failed, total = sum(p.spans_failed for p in otlp), sum(p.spans_received for p in otlp)
    if failed:
        endpoint = otlp_endpoint or _env_endpoint()
        raise SpansNotDelivered(_masked(otlp_destination(otlp_endpoint), endpoint), failed, total,
                                _plainer(quiet.first, endpoint), records=inst.records_sent * len(otlp))


def _env_endpoint() -> str:
    key = next((k for k in _ENV_ENDPOINTS if os.environ.get(k)), None)
    return os.environ[key] if key is not None else ""


def _passwords(endpoint: str) -> list[str]:
    """The password an endpoint's user part holds, as typed and URL-decoded (gRPC quotes its
    target decoded: ``p%40ss`` as ``p@ss``), read both ways an endpoint may carry one: after a
    scheme's ``//`` to the last ``@`` (``_shown``'s reading), and in the last path segment
    before it (``dns:///user:secret@host``); longest first."""
    from urllib.parse import unquote

    at = endpoint.rfind("@")
    if at < 0:
        return []
    found = set()
    m = _PASSWORD.match(endpoint)
    if m is not None:
        found.add(endpoint[len(m.group(1)) + 1:at])
    tail = endpoint[:at].rsplit("/", 1)[-1]
    if ":" in tail:
        found.add(tail.split(":", 1)[1])
    found |= {unquote(p) for p in found}
    return sorted((p for p in found if p), key=len, reverse=True)


def _masked(text: str, endpoint: str) -> str:
    """``text`` with the endpoint's password, wherever it is quoted, as ***."""
    for secret in _passwords(endpoint):
        text = text.replace(secret, "***")
    return text


def _plainer(reason: str | None, endpoint: str) -> str | None:
    """The exporter's reason, its endpoint's password masked (gRPC quotes its target whole:
    "errors resolving u:secret@host"); gRPC's TLS failure against a plaintext collector as
    what to do, not 300 characters of OpenSSL."""
    if not reason:
        return reason
    reason = _masked(reason, endpoint)
    if "tls handshake failed" in reason.lower():
        return ("TLS handshake failed: the collector speaks no TLS; over gRPC a HOST:PORT or https:// target is TLS "
                "unless OTEL_EXPORTER_OTLP_INSECURE=true, and that variable, when set, decides for http:// too")
    return reason
