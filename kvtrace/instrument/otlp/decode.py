"""OTLP trace payloads -> span rows: the protobuf and JSON decoders the receivers share.

``decode_protobuf`` takes an ``ExportTraceServiceRequest`` (the bytes of an OTLP/HTTP
protobuf body or of an OTLP/gRPC ``Export`` call); ``decode_json`` takes the OTLP JSON
mapping (hex ids, lowerCamelCase or snake_case keys, 64-bit ints as strings or
numbers). Both return ``[(resource attributes, SpanRowsBuilder.add kwargs, where)]``
for the whole request (``where``: the span's path, ``resourceSpans[0].scopeSpans[0].spans[3]``)
or raise ``PayloadError`` naming the span and field at fault, so a malformed request is
refused whole and nothing of it is stored. Values OTLP allows but the store cannot hold
(a ``fixed64`` time past 2^63 - 1 ns) are refused here too, naming the field.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from collections.abc import Iterator
from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from kvtrace.errors import KVTraceError
from kvtrace.instrument.otlp.limits import MAX_SPANS_PER_REQUEST
from kvtrace.names import cut_middle, shown_value

_KINDS = {0: None, 1: None, 2: "Server", 3: "Client", 4: "Producer", 5: "Consumer"}
_KIND_NAMES = {"SPAN_KIND_UNSPECIFIED": 0, "SPAN_KIND_INTERNAL": 1, "SPAN_KIND_SERVER": 2,
               "SPAN_KIND_CLIENT": 3, "SPAN_KIND_PRODUCER": 4, "SPAN_KIND_CONSUMER": 5}
_STATUS = {0: None, 1: "Ok", 2: "Error"}  # Unset (0) is stored as NULL, as the schema says
_STATUS_NAMES = {"STATUS_CODE_UNSET": 0, "STATUS_CODE_OK": 1, "STATUS_CODE_ERROR": 2}


# [(resource attributes, SpanRowsBuilder.add keyword arguments, the span's path)], one per span
DecodedSpans = list[tuple[dict, dict, str]]
_MAX_NS = (1 << 63) - 1  # the store's times are BIGINT ns
_I64 = (-(1 << 63), (1 << 63) - 1)  # OTLP intValue
_MESSAGE_CHARS = 300  # a refusal quotes the request, but not all of it


class PayloadError(KVTraceError, ValueError):
    """A request body that is not a valid OTLP trace export, or holds a value the store
    cannot (-> 400 / INVALID_ARGUMENT)."""

    def __init__(self, message: str):
        # (cut in the middle: the end says what is wrong, where a long attribute key in the path took it all)
        super().__init__(cut_middle(message, _MESSAGE_CHARS))


def _enum(v: int, names: dict[int, str | None], what: str) -> str | None:
    """A span kind or status code OTLP defines, as its stored name (None: NULL); another
    value is refused naming the field (kind 99 was stored as Internal, status 7 as Unset)."""
    if v not in names:
        raise PayloadError(f"{what}: {v} is no value OTLP defines ({min(names)} to {max(names)})")
    return names[v]


def _time(v: int, what: str) -> int:
    """An OTLP time (uint64 ns) the store can hold."""
    if not 0 <= v <= _MAX_NS:
        raise PayloadError(f"{what}: {v} ns is beyond what the store holds (0 to 2^63 - 1 ns)")
    return v


def _unique(pairs: Iterator[tuple[str, Any]], where: str) -> dict[str, Any]:
    """Attributes (key, value) as a dict, each put by ``_put_unique``."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        _put_unique(out, key, value, where)
    return out


def _put_unique(out: dict[str, Any], key: str, value: Any, where: str) -> None:
    """``out[key] = value``; a key given twice with two values is a PayloadError naming it
    (OTLP's attribute keys are unique: the last one was kept, the other dropped without a
    word, where a ClickHouse exporter's map may keep the first). Twice one value is one:
    equal maps in another key order, 0.0 and -0.0 (not 1 and 1.0, nor true and 1: two types)."""
    if key in out and not _same(out[key], value):
        raise PayloadError(f"{where}: attribute {key!r} given twice, as {_wire(out[key])} and {_wire(value)} "
                           "(an attribute key is unique)"[:300])
    out[key] = value


def _same(a: Any, b: Any) -> bool:
    """Whether two decoded attribute values are one value: of one type and equal (a map's
    keys in any order; a NaN is the NaN it was sent as)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(v, b[k]) for k, v in a.items())
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return bool(a == b)


def _wire(v: Any) -> str:
    """A decoded attribute value as a refusal quotes it, in OTLP's spellings (true, not
    Python's True; an empty AnyValue as empty), at most some 40 characters."""
    text = _spelled(v)
    return text if len(text) <= 40 else f"{text[:24]}... ({len(text):,} characters)"


def _spelled(v: Any) -> str:
    if v is None:
        return "empty"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    if isinstance(v, bytes):
        return f"bytes {v.hex()}"
    if isinstance(v, list):
        return "[" + ", ".join(map(_spelled, v)) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k!r}: {_spelled(x)}" for k, x in v.items()) + "}"
    return repr(v)


# --- protobuf ------------------------------------------------------------------------------
def _any_value(v, where: str = "", key: str | int | None = None) -> Any:
    """An AnyValue; ``where`` and ``key`` its path (built only for a kvlist or an array, whose
    duplicate key is named from it: ``spans[0].m``, ``spans[0].a[1]``, as the JSON decoder names
    them, where a kvlist's was named by its span alone)."""
    which = v.WhichOneof("value")
    if which is None:
        return None
    if which in _COMPOUND:
        path = where if key is None else f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}"
        if which == "array_value":
            return [_any_value(x, path, i) for i, x in enumerate(v.array_value.values)]
        return _kv(v.kvlist_value.values, path)
    return getattr(v, which)


_COMPOUND = frozenset({"array_value", "kvlist_value"})


def _kv(attrs, where: str = "") -> dict[str, Any]:
    out = {kv.key: _any_value(kv.value, where, kv.key) for kv in attrs}
    if len(out) < len(attrs):  # a key given twice: the same value, or refused (``_put_unique``)
        return _unique(((kv.key, _any_value(kv.value, where, kv.key)) for kv in attrs), where)
    return out


def _bytes_id(raw: bytes, size: int, what: str, where: str, optional: bool = False) -> int | None:
    """An OTLP id (big-endian bytes) as the int the store keeps; None for an absent parent."""
    if optional and not raw:
        return None
    if len(raw) != size:
        raise PayloadError(f"{where}: {what} must be {size} bytes, got {len(raw)}")
    return int.from_bytes(raw, "big")


def _checked_span(span: dict, where: str) -> dict:
    """What OTLP calls invalid, refused naming the field: an all-zero trace or span id
    (INVALID_TRACE_ID, INVALID_SPAN_ID), and an end before the start (stored, it read
    as a negative duration in every view)."""
    if span["trace_id"] == 0:
        raise PayloadError(f"{where}: traceId is all zeros, the invalid trace id")
    if span["span_id"] == 0:
        raise PayloadError(f"{where}: spanId is all zeros, the invalid span id")
    if span["end_ns"] < span["start_ns"]:
        raise PayloadError(f"{where}.endTimeUnixNano: {span['end_ns']} is before startTimeUnixNano "
                           f"{span['start_ns']}")
    return span


def _check_count(n: int) -> None:
    if n > MAX_SPANS_PER_REQUEST:
        raise PayloadError(f"{n:,} spans in one request: more than {MAX_SPANS_PER_REQUEST:,}; send smaller batches")


def decode_protobuf(body: bytes) -> DecodedSpans:
    """An ``ExportTraceServiceRequest`` -> its spans; PayloadError when it is not one."""
    req = trace_service_pb2.ExportTraceServiceRequest()
    try:
        req.ParseFromString(body)
    except DecodeError as err:
        raise PayloadError(f"not an ExportTraceServiceRequest: {err}") from None
    _check_count(sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans))
    out: DecodedSpans = []
    for ri, rs in enumerate(req.resource_spans):
        resource = _kv(rs.resource.attributes, f"resourceSpans[{ri}].resource")
        for si, ss in enumerate(rs.scope_spans):
            for pi, sp in enumerate(ss.spans):
                where = f"resourceSpans[{ri}].scopeSpans[{si}].spans[{pi}]"
                out.append((resource, _checked_span(dict(
                    name=sp.name,
                    trace_id=_bytes_id(sp.trace_id, 16, "traceId", where),
                    span_id=_bytes_id(sp.span_id, 8, "spanId", where),
                    parent_span_id=_bytes_id(sp.parent_span_id, 8, "parentSpanId", where, optional=True),
                    trace_state=sp.trace_state or None,
                    span_kind=_enum(sp.kind, _KINDS, f"{where}.kind"),
                    start_ns=_time(sp.start_time_unix_nano, f"{where}.startTimeUnixNano"),
                    end_ns=_time(sp.end_time_unix_nano, f"{where}.endTimeUnixNano"),
                    attributes=_kv(sp.attributes, where),
                    resource=resource,
                    scope_name=ss.scope.name or None,
                    scope_version=ss.scope.version or None,
                    status_code=_enum(sp.status.code, _STATUS, f"{where}.status.code"),
                    status_message=sp.status.message or None,
                    events=[(_time(e.time_unix_nano, f"{where}.events[{ei}].timeUnixNano"), e.name,
                             _kv(e.attributes, f"{where}.events[{ei}]")) for ei, e in enumerate(sp.events)],
                    links=[(_bytes_id(lk.trace_id, 16, f"links[{li}].traceId", where),
                            _bytes_id(lk.span_id, 8, f"links[{li}].spanId", where),
                            lk.trace_state or None, _kv(lk.attributes, f"{where}.links[{li}]"))
                           for li, lk in enumerate(sp.links)],
                ), where), where))
    return out


# --- JSON ------------------------------------------------------------------------------------
def _get(d: dict, camel: str, snake: str | None = None, default: Any = None) -> Any:
    if camel in d:
        return d[camel]
    if snake is not None and snake in d:
        return d[snake]
    return default


def _json_objects(v: Any, what: str) -> list[dict]:
    """An OTLP/JSON list of objects (absent or null: empty); PayloadError naming ``what``
    otherwise (a string there was read as its characters, and the request stored nothing
    with a 200)."""
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(x, dict) for x in v):
        raise PayloadError(f"{what}: expected a list of objects, got {type(v).__name__}")
    return v


# A 64-bit int written as a string: ASCII decimal digits only (Python's int() would also
# take spaces, underscores and other scripts' digits, which no OTLP encoder writes).
_DECIMAL = re.compile(r"-?[0-9]{1,40}")
_HEX = re.compile(r"[0-9a-fA-F]*")


def _json_int(v: Any, what: str, lo: int = _I64[0], hi: int = _I64[1]) -> int:
    """An OTLP/JSON integer (a number, or a decimal string as 64-bit ints are written) in [lo, hi]."""
    out: int | None = None
    if isinstance(v, int) and not isinstance(v, bool):
        out = v
    elif (isinstance(v, float) and v.is_integer()) or (isinstance(v, str) and _DECIMAL.fullmatch(v)):
        out = int(v)
    if out is None:
        raise PayloadError(f"{what}: expected an integer, got {shown_value(v, 40)}")
    if not lo <= out <= hi:
        # (the value shortened: a refusal is cut at _MESSAGE_CHARS, and 1e300's 301 digits
        # took the rest of it, "is out of range" included)
        raise PayloadError(f"{what}: {shown_value(out, 40)} is out of range ({lo} to {hi})")
    return out


def _json_time(v: Any, what: str) -> int:
    """An OTLP/JSON time: a uint64 in OTLP, of which the store holds up to 2^63 - 1 ns."""
    return _time(_json_int(v, what, 0, (1 << 64) - 1), what)


_SPECIAL_DOUBLES = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
# A double written as a string, as proto3 JSON allows ("1.5", "-2e3"): a JSON number's
# spelling only (Python's float() would also take spaces, underscores and "inf").
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")


def _json_double(v: Any, what: str) -> float:
    """A doubleValue: a JSON number, one of proto3 JSON's "NaN" / "Infinity" / "-Infinity", or
    a number as a string, which proto3 JSON also allows (the OTel Collector takes "1.5"; it
    was a 400, and the exporter's whole request lost)."""
    if isinstance(v, str) and v in _SPECIAL_DOUBLES:
        return _SPECIAL_DOUBLES[v]
    if isinstance(v, str) and len(v) <= 400 and _JSON_NUMBER.fullmatch(v):
        v = float(v)  # (beyond a double's range: inf, as a JSON number that large is read)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        try:
            return float(v)
        except OverflowError:  # an integer literal beyond any double
            pass
    raise PayloadError(f"{what}: expected a number, got {shown_value(v, 40)}")


def _json_str(v: Any, what: str, default: str | None = None) -> str | None:
    if v is None:
        return default
    if not isinstance(v, str):
        raise PayloadError(f"{what}: expected a string, got {v!r}")
    if not v.isascii():
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:  # JSON can escape a lone surrogate ("\ud800"); UTF-8 cannot hold one
            raise PayloadError(f"{what}: not Unicode text (a lone surrogate)") from None
    return v


def _json_bytes(v: Any, what: str) -> bytes:
    """A bytesValue: base64 (standard or URL-safe, padded or not, as proto3 JSON allows),
    decoded, so it is kept as the protobuf decoder keeps the same bytes (hex)."""
    text = _json_str(v, what, "") or ""
    try:
        return base64.b64decode(text.replace("-", "+").replace("_", "/") + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise PayloadError(f"{what}: expected base64, got {text[:40]!r}") from None


def _json_object(v: Any, what: str) -> dict:
    """An OTLP/JSON object (absent or null: empty); PayloadError naming ``what`` otherwise."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise PayloadError(f"{what}: expected an object, got {type(v).__name__}")
    return v


def _json_any(v: Any, where: str) -> Any:
    if not isinstance(v, dict):
        raise PayloadError(f"{where}: AnyValue must be an object")
    for key in ("stringValue", "string_value"):
        if key in v:
            return _json_str(v[key], f"{where}.stringValue", "")
    for key in ("boolValue", "bool_value"):
        if key in v:
            if not isinstance(v[key], bool):
                raise PayloadError(f"{where}.boolValue: expected true or false, got {v[key]!r}")
            return v[key]
    for key in ("intValue", "int_value"):
        if key in v:
            return _json_int(v[key], f"{where}.intValue")
    for key in ("doubleValue", "double_value"):
        if key in v:
            return _json_double(v[key], f"{where}.doubleValue")
    for key in ("arrayValue", "array_value"):
        if key in v:
            values = _json_object(v[key], f"{where}.arrayValue").get("values") or []
            if not isinstance(values, list):
                raise PayloadError(f"{where}.arrayValue: values must be a list")
            return [_json_any(x, f"{where}[{i}]") for i, x in enumerate(values)]
    for key in ("kvlistValue", "kvlist_value"):
        if key in v:
            return _json_kv(_json_object(v[key], f"{where}.kvlistValue").get("values", []), where)
    for key in ("bytesValue", "bytes_value"):
        if key in v:
            return _json_bytes(v[key], f"{where}.bytesValue")
    return None


def _json_kv(items: Any, where: str) -> dict[str, Any]:
    if items is None:
        return {}
    if not isinstance(items, list):
        raise PayloadError(f"{where}: attributes must be a list")
    out: dict[str, Any] = {}
    for kv in items:
        if not isinstance(kv, dict) or not isinstance(kv.get("key"), str):
            raise PayloadError(f"{where}: attribute without a string key")
        key: str = kv["key"]
        _json_str(key, f"{where}: attribute key")
        _put_unique(out, key, _json_any(kv.get("value", {}), f"{where}.{key}"), where)
    return out


def _json_id(v: Any, size: int, what: str, where: str, optional: bool = False) -> int | None:
    """An OTLP/JSON id (hex, as the OTLP JSON mapping writes it) as an int."""
    if optional and not v:
        return None
    if not isinstance(v, str) or len(v) != 2 * size:
        raise PayloadError(f"{where}: {what} must be {2 * size} hex chars")
    if not _HEX.fullmatch(v):  # (bytes.fromhex skips spaces: a shorter id would pass)
        raise PayloadError(f"{where}: {what} must be hex")
    return int(v, 16)


def _json_enum(v: Any, names: dict[str, int], what: str) -> int:
    if isinstance(v, str) and v in names:
        return names[v]
    return _json_int(v if v is not None else 0, what)


def _json_span_count(doc: dict) -> int:
    """The spans a JSON export holds, counted before any is decoded (what is not a list here
    is refused later, naming it)."""
    def items(v: Any) -> list:
        return [x for x in v if isinstance(x, dict)] if isinstance(v, list) else []

    return sum(len(items(_get(ss, "spans")))
               for rs in items(_get(doc, "resourceSpans", "resource_spans"))
               for ss in items(_get(rs, "scopeSpans", "scope_spans")))


def decode_json(body: bytes) -> DecodedSpans:
    """An OTLP/JSON export -> its spans; PayloadError naming what is wrong."""
    try:
        doc = json.loads(body)
    except ValueError as err:  # not UTF-8, not JSON, an integer literal past Python's 4300 digits
        raise PayloadError(f"invalid JSON: {err}") from None
    except RecursionError:
        raise PayloadError("invalid JSON: nested too deeply") from None
    if not isinstance(doc, dict):
        raise PayloadError("expected a JSON object with resourceSpans")
    out: DecodedSpans = []
    try:
        _check_count(_json_span_count(doc))
        for ri, rs in enumerate(_json_objects(_get(doc, "resourceSpans", "resource_spans"), "resourceSpans")):
            resource = _json_kv(_json_object(_get(rs, "resource"), f"resourceSpans[{ri}].resource").get("attributes"),
                                f"resourceSpans[{ri}].resource")
            for si, ss in enumerate(_json_objects(_get(rs, "scopeSpans", "scope_spans"),
                                                  f"resourceSpans[{ri}].scopeSpans")):
                scope = _json_object(_get(ss, "scope"), f"resourceSpans[{ri}].scopeSpans[{si}].scope")
                spans = _json_objects(_get(ss, "spans"), f"resourceSpans[{ri}].scopeSpans[{si}].spans")
                for pi, sp in enumerate(spans):
                    where = f"resourceSpans[{ri}].scopeSpans[{si}].spans[{pi}]"
                    status = _json_object(_get(sp, "status"), f"{where}.status")
                    out.append((resource, _checked_span(dict(
                        name=_json_str(_get(sp, "name"), f"{where}.name", ""),
                        trace_id=_json_id(_get(sp, "traceId", "trace_id"), 16, "traceId", where),
                        span_id=_json_id(_get(sp, "spanId", "span_id"), 8, "spanId", where),
                        parent_span_id=_json_id(_get(sp, "parentSpanId", "parent_span_id"), 8, "parentSpanId", where,
                                                optional=True),
                        trace_state=_json_str(_get(sp, "traceState", "trace_state"), f"{where}.traceState") or None,
                        span_kind=_enum(_json_enum(_get(sp, "kind"), _KIND_NAMES, f"{where}.kind"), _KINDS,
                                        f"{where}.kind"),
                        start_ns=_json_time(_get(sp, "startTimeUnixNano", "start_time_unix_nano", 0),
                                            f"{where}.startTimeUnixNano"),
                        end_ns=_json_time(_get(sp, "endTimeUnixNano", "end_time_unix_nano", 0),
                                          f"{where}.endTimeUnixNano"),
                        attributes=_json_kv(_get(sp, "attributes"), where),
                        resource=resource,
                        scope_name=_json_str(scope.get("name"), f"{where}.scope.name") or None,
                        scope_version=_json_str(scope.get("version"), f"{where}.scope.version") or None,
                        status_code=_enum(_json_enum(_get(status, "code"), _STATUS_NAMES, f"{where}.status.code"),
                                          _STATUS, f"{where}.status.code"),
                        status_message=_json_str(status.get("message"), f"{where}.status.message") or None,
                        events=[(_json_time(_get(e, "timeUnixNano", "time_unix_nano", 0),
                                            f"{where}.events[{ei}].timeUnixNano"),
                                 _json_str(e.get("name"), f"{where}.events[{ei}].name", ""),
                                 _json_kv(e.get("attributes"), f"{where}.events[{ei}]"))
                                for ei, e in enumerate(_json_objects(_get(sp, "events"), f"{where}.events"))],
                        links=[(_json_id(_get(lk, "traceId", "trace_id"), 16, f"links[{li}].traceId", where),
                                _json_id(_get(lk, "spanId", "span_id"), 8, f"links[{li}].spanId", where),
                                _json_str(_get(lk, "traceState", "trace_state"),
                                          f"{where}.links[{li}].traceState") or None,
                                _json_kv(lk.get("attributes"), f"{where}.links[{li}]"))
                               for li, lk in enumerate(_json_objects(_get(sp, "links"), f"{where}.links"))],
                    ), where), where))
    except (AttributeError, TypeError) as err:  # a list where an object belongs, and the like
        raise PayloadError(f"malformed OTLP JSON: {err}") from None
    except RecursionError:
        raise PayloadError("malformed OTLP JSON: attribute values nested too deeply") from None
    return out
