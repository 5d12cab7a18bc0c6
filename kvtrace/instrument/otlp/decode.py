"""OTLP trace payloads -> span rows: the protobuf and JSON decoders the receivers share.

``decode_protobuf`` takes an ``ExportTraceServiceRequest`` (the bytes of an OTLP/HTTP
protobuf body or of an OTLP/gRPC ``Export`` call); ``decode_json`` takes the OTLP JSON
mapping (hex ids, lowerCamelCase or snake_case keys, 64-bit ints as strings or
numbers). Both return ``[(resource attributes, SpanRowsBuilder.add kwargs)]`` for the
whole request or raise ``PayloadError`` naming the span and field at fault, so a
malformed request is refused whole and nothing of it is stored.
"""

from __future__ import annotations

import json
from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

_KINDS = {0: None, 1: None, 2: "Server", 3: "Client", 4: "Producer", 5: "Consumer"}
_KIND_NAMES = {"SPAN_KIND_UNSPECIFIED": 0, "SPAN_KIND_INTERNAL": 1, "SPAN_KIND_SERVER": 2,
               "SPAN_KIND_CLIENT": 3, "SPAN_KIND_PRODUCER": 4, "SPAN_KIND_CONSUMER": 5}
_STATUS = {1: "Ok", 2: "Error"}  # Unset (0) is stored as NULL, as the schema says
_STATUS_NAMES = {"STATUS_CODE_UNSET": 0, "STATUS_CODE_OK": 1, "STATUS_CODE_ERROR": 2}


# [(resource attributes, SpanRowsBuilder.add keyword arguments)], one per span
DecodedSpans = list[tuple[dict, dict]]


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


def decode_protobuf(body: bytes) -> DecodedSpans:
    """An ``ExportTraceServiceRequest`` -> its spans; PayloadError when it is not one."""
    req = trace_service_pb2.ExportTraceServiceRequest()
    try:
        req.ParseFromString(body)
    except DecodeError as err:
        raise PayloadError(f"not an ExportTraceServiceRequest: {err}") from None
    out: DecodedSpans = []
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
                    links=[(_bytes_id(lk.trace_id, 16, "links.traceId", where),
                            _bytes_id(lk.span_id, 8, "links.spanId", where),
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


def decode_json(body: bytes) -> DecodedSpans:
    """An OTLP/JSON export -> its spans; PayloadError naming what is wrong."""
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise PayloadError(f"invalid JSON: {err}") from None
    if not isinstance(doc, dict):
        raise PayloadError("expected a JSON object with resourceSpans")
    out: DecodedSpans = []
    try:
        for ri, rs in enumerate(_get(doc, "resourceSpans", "resource_spans", []) or []):
            resource = _json_kv((_get(rs, "resource", default={}) or {}).get("attributes"),
                                f"resourceSpans[{ri}].resource")
            for si, ss in enumerate(_get(rs, "scopeSpans", "scope_spans", []) or []):
                scope = _get(ss, "scope", default={}) or {}
                for pi, sp in enumerate(_get(ss, "spans", default=[]) or []):
                    where = f"resourceSpans[{ri}].scopeSpans[{si}].spans[{pi}]"
                    status = _get(sp, "status", default={}) or {}
                    out.append((resource, dict(
                        name=str(_get(sp, "name", default="")),
                        trace_id=_json_id(_get(sp, "traceId", "trace_id"), 16, "traceId", where),
                        span_id=_json_id(_get(sp, "spanId", "span_id"), 8, "spanId", where),
                        parent_span_id=_json_id(_get(sp, "parentSpanId", "parent_span_id"), 8, "parentSpanId", where,
                                                optional=True),
                        trace_state=_get(sp, "traceState", "trace_state") or None,
                        span_kind=_KINDS.get(_json_enum(_get(sp, "kind"), _KIND_NAMES, f"{where}.kind")),
                        start_ns=_json_int(_get(sp, "startTimeUnixNano", "start_time_unix_nano", 0),
                                           f"{where}.startTimeUnixNano"),
                        end_ns=_json_int(_get(sp, "endTimeUnixNano", "end_time_unix_nano", 0),
                                         f"{where}.endTimeUnixNano"),
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
                                _get(lk, "traceState", "trace_state") or None,
                                _json_kv(lk.get("attributes"), f"{where}.links"))
                               for lk in _get(sp, "links", default=[]) or []],
                    )))
    except (AttributeError, TypeError) as err:  # a list where an object belongs, and the like
        raise PayloadError(f"malformed OTLP JSON: {err}") from None
    return out
