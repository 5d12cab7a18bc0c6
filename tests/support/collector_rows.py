"""OTLP payloads -> rows of the OpenTelemetry Collector's ClickHouse ``otel_traces``.

There is no collector binary here, so the tests stand in for its ClickHouse exporter:
kvtrace's own OTLP decoder (``decode_protobuf``, the receivers' decoder) reads the
payloads a real SDK OTLP exporter sent, and each span becomes the row the exporter's
``pushTraceData`` writes: ids as lowercase hex ('' for no parent), kind and status as
``traceutil``'s names, ``Duration`` = end - start, service name from the resource, and
every attribute as pdata's ``AsString``: strings as they are, ints in decimal, bools
true/false, floats in Go's shortest form ("7" for 7.0), arrays and maps as Go's JSON.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable
from typing import Any

import pyarrow as pa

from kvtrace.instrument.convert import exporter_text
from kvtrace.instrument.otlp.decode import decode_protobuf

_MAP = pa.map_(pa.string(), pa.string())
_TS = pa.timestamp("ns")
_KIND = {None: "Internal", "Server": "Server", "Client": "Client", "Producer": "Producer", "Consumer": "Consumer"}


def _go_json(v: Any) -> str:
    """Go's ``json.Marshal`` of an attribute's raw value: floats as the exporter spells them
    ("7" for 7.0), a map's keys sorted, <, > and & escaped as \\u003c, \\u003e, \\u0026."""
    if isinstance(v, bool) or v is None:
        return "null" if v is None else ("true" if v else "false")
    if isinstance(v, (int, float)):
        text = exporter_text(v)
        if text is None:
            raise ValueError("NaN or infinity")  # (json.Marshal fails: AsString gives "")
        return text
    if isinstance(v, str):
        quoted = json.dumps(v, ensure_ascii=False)
        return quoted.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    if isinstance(v, bytes):
        return json.dumps(base64.b64encode(v).decode())
    if isinstance(v, dict):
        return "{" + ",".join(f"{_go_json(k)}:{_go_json(v[k])}" for k in sorted(v)) + "}"
    return "[" + ",".join(_go_json(x) for x in v) + "]"


def as_string(v: Any) -> str:
    """pdata's ``Value.AsString``, as the Go exporter stores every attribute (a double's
    shortest form in ES6 style: "7" for 7.0, not Python's "7.0"; bytes in base64)."""
    text = exporter_text(v)
    if text is not None:
        return text
    if isinstance(v, bytes):
        return base64.b64encode(v).decode()
    if isinstance(v, float):  # NaN, infinity: encoding/json's error text
        return f"json: unsupported value: {'NaN' if v != v else ('+Inf' if v > 0 else '-Inf')}"
    try:
        return _go_json(v)
    except ValueError:
        return ""


def _smap(attrs: dict | None) -> list[tuple[str, str]]:
    return [(k, as_string(v)) for k, v in (attrs or {}).items()]


def collector_rows(bodies: Iterable[bytes]) -> pa.Table:
    """The ``otel_traces`` rows of every span in these ExportTraceServiceRequest bodies."""
    cols: dict[str, list] = {k: [] for k in (
        "Timestamp", "TraceId", "SpanId", "ParentSpanId", "TraceState", "SpanName", "SpanKind", "ServiceName",
        "ResourceAttributes", "ScopeName", "ScopeVersion", "SpanAttributes", "Duration", "StatusCode",
        "StatusMessage", "Events.Timestamp", "Events.Name", "Events.Attributes", "Links.TraceId", "Links.SpanId",
        "Links.TraceState", "Links.Attributes")}
    for body in bodies:
        for resource, sp, _where in decode_protobuf(body):
            add = lambda k, v: cols[k].append(v)
            add("Timestamp", sp["start_ns"])
            add("TraceId", f"{sp['trace_id']:032x}")
            add("SpanId", f"{sp['span_id']:016x}")
            add("ParentSpanId", f"{sp['parent_span_id']:016x}" if sp["parent_span_id"] else "")
            add("TraceState", sp["trace_state"] or "")
            add("SpanName", sp["name"])
            add("SpanKind", _KIND[sp["span_kind"]])
            add("ServiceName", as_string(resource.get("service.name", "")))
            add("ResourceAttributes", _smap(resource))
            add("ScopeName", sp["scope_name"] or "")
            add("ScopeVersion", sp["scope_version"] or "")
            add("SpanAttributes", _smap(sp["attributes"]))
            add("Duration", max(0, sp["end_ns"] - sp["start_ns"]))
            add("StatusCode", sp["status_code"] or "Unset")
            add("StatusMessage", sp["status_message"] or "")
            add("Events.Timestamp", [t for t, _, _ in sp["events"]])
            add("Events.Name", [n for _, n, _ in sp["events"]])
            add("Events.Attributes", [_smap(a) for _, _, a in sp["events"]])
            add("Links.TraceId", [f"{t:032x}" for t, _, _, _ in sp["links"]])
            add("Links.SpanId", [f"{s:016x}" for _, s, _, _ in sp["links"]])
            add("Links.TraceState", [st or "" for _, _, st, _ in sp["links"]])
            add("Links.Attributes", [_smap(a) for _, _, _, a in sp["links"]])
    types = {"Timestamp": _TS, "ResourceAttributes": _MAP, "SpanAttributes": _MAP, "Duration": pa.uint64(),
             "Events.Timestamp": pa.list_(_TS), "Events.Name": pa.list_(pa.string()),
             "Events.Attributes": pa.list_(_MAP), "Links.TraceId": pa.list_(pa.string()),
             "Links.SpanId": pa.list_(pa.string()), "Links.TraceState": pa.list_(pa.string()),
             "Links.Attributes": pa.list_(_MAP)}
    return pa.table({k: pa.array(v, types.get(k, pa.string())) for k, v in cols.items()})
