"""Fuzz: the OTLP decoders (protobuf and JSON) and the store rows the collector makes.

Valid ``ExportTraceServiceRequest``s are built with opentelemetry-proto (their attribute
keys include the store's typed columns, so values meet their column types) and then
mutated: bytes flipped, inserted or cut, JSON nodes replaced with hostile values. Each
body goes through ``decode_protobuf`` / ``decode_json`` and then the collector's own
conversion (``unshift`` by the resource's time offset, ``SpanRowsBuilder.add``,
``to_table``). The invariant: a one-line KVTraceError (``PayloadError``,
``UnstorableValue``), never another exception.
"""

from __future__ import annotations

import copy
import json
import math
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList

from kvtrace.errors import KVTraceError
from kvtrace.instrument.convert import RUN_ID_RESOURCE_KEY, SpanRowsBuilder, time_offset, unshift
from kvtrace.instrument.otlp.decode import _KIND_NAMES, _STATUS_NAMES, decode_json, decode_protobuf
from kvtrace.store.schema import ATTRIBUTE_COLUMNS, SOURCE_OTLP, SPAN_RUN, TIME_OFFSET_RESOURCE_KEY
from tests.fuzz.support import Raw, dump, fuzz, one_line_error

U64 = (1 << 64) - 1
KEYS = st.one_of(st.sampled_from(sorted(ATTRIBUTE_COLUMNS)), st.sampled_from([TIME_OFFSET_RESOURCE_KEY,
                 RUN_ID_RESOURCE_KEY, "service.name"]), st.text(max_size=6))
EDGE_INTS = st.sampled_from([0, 1, -1, 2**31, 2**32 - 1, 2**62, 2**63 - 1, -(2**63)])
I64 = st.one_of(EDGE_INTS, st.integers(-(2**63), 2**63 - 1))
TIMES = st.one_of(st.sampled_from([0, 1, 2**63 - 1, 2**63, U64, 1_700_000_000_000_000_000]), st.integers(0, U64))
SCALAR = st.one_of(
    st.builds(lambda v: AnyValue(string_value=v), st.text(max_size=8)),
    st.builds(lambda v: AnyValue(bool_value=v), st.booleans()),
    st.builds(lambda v: AnyValue(int_value=v), I64),
    st.builds(lambda v: AnyValue(double_value=v), st.floats(allow_nan=True, allow_infinity=True)),
    st.builds(lambda v: AnyValue(bytes_value=v), st.binary(max_size=8)),
    st.just(AnyValue()),
)
ANY = st.recursive(SCALAR, lambda inner: st.one_of(
    st.builds(lambda xs: AnyValue(array_value=ArrayValue(values=xs)), st.lists(inner, max_size=4)),
    st.builds(lambda kv: AnyValue(kvlist_value=KeyValueList(values=[KeyValue(key=k, value=v) for k, v in kv])),
              st.lists(st.tuples(st.text(max_size=4), inner), max_size=3)),
), max_leaves=4)
ATTRS = st.lists(st.builds(lambda k, v: KeyValue(key=k, value=v), KEYS, ANY), max_size=3)
IDS = {n: st.one_of(st.binary(min_size=n, max_size=n), st.binary(max_size=n + 2)) for n in (8, 16)}


@st.composite
def export_request(draw) -> ExportTraceServiceRequest:
    req = ExportTraceServiceRequest()
    for _ in range(draw(st.integers(1, 2))):
        rs = req.resource_spans.add()
        rs.resource.attributes.extend(draw(ATTRS))
        for _ in range(1):
            ss = rs.scope_spans.add()
            ss.scope.name, ss.scope.version = draw(st.text(max_size=6)), draw(st.text(max_size=4))
            for _ in range(draw(st.integers(0, 2))):
                sp = ss.spans.add()
                sp.name = draw(st.sampled_from(["kvtrace.cache.lookup", SPAN_RUN, "x"]) | st.text(max_size=6))
                sp.trace_id = draw(IDS[16] if draw(st.integers(0, 9)) else st.binary(max_size=20))
                sp.span_id = draw(IDS[8] if draw(st.integers(0, 9)) else st.binary(max_size=12))
                sp.parent_span_id = draw(st.sampled_from([b""]) | IDS[8])
                sp.trace_state = draw(st.text(max_size=6))
                sp.kind = draw(st.integers(0, 7))
                sp.start_time_unix_nano, sp.end_time_unix_nano = draw(TIMES), draw(TIMES)
                sp.attributes.extend(draw(ATTRS))
                sp.status.code = draw(st.integers(0, 3))
                sp.status.message = draw(st.text(max_size=6))
                for _ in range(draw(st.integers(0, 1))):
                    ev = sp.events.add()
                    ev.time_unix_nano, ev.name = draw(TIMES), draw(st.text(max_size=4))
                    ev.attributes.extend(draw(ATTRS))
                for _ in range(draw(st.integers(0, 1))):
                    lk = sp.links.add()
                    lk.trace_id, lk.span_id = draw(IDS[16]), draw(IDS[8])
                    lk.attributes.extend(draw(ATTRS))
    return req


def store_rows(spans) -> None:
    """The collector's conversion of decoded spans (``OtlpCollector.ingest``, store aside)."""
    rows = SpanRowsBuilder()
    for resource, kwargs, _where in spans:
        if kwargs["name"] == SPAN_RUN:  # the run record: attributes, no row
            continue
        rows.add(default_source=SOURCE_OTLP, **unshift(kwargs, time_offset(resource)))
    rows.to_table()


def check(decode, body: bytes) -> None:
    try:
        store_rows(decode(body))
    except Exception as err:  # the invariant is about every exception
        one_line_error(err)


# -- protobuf -------------------------------------------------------------------------------------------
@fuzz(150)
@given(req=export_request())
def test_valid_protobuf_requests(req):
    check(decode_protobuf, req.SerializeToString())


@fuzz(120)
@given(req=export_request(), data=st.data())
def test_mutated_protobuf_requests(req, data):
    raw = bytearray(req.SerializeToString())
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw)))
        op = data.draw(st.sampled_from(["set", "insert", "cut"]))
        chunk = data.draw(st.binary(min_size=1, max_size=9))
        if op == "set":
            raw[at:at + len(chunk)] = chunk
        elif op == "insert":
            raw[at:at] = chunk
        else:
            del raw[at:at + len(chunk)]
    check(decode_protobuf, bytes(raw))


@fuzz(60)
@given(body=st.binary(max_size=300))
def test_arbitrary_bytes_protobuf_and_json(body):
    check(decode_protobuf, body)
    check(decode_json, body)


# -- JSON -----------------------------------------------------------------------------------------------
def any_json(v: AnyValue):
    which = v.WhichOneof("value")
    if which is None:
        return {}
    if which == "array_value":
        return {"arrayValue": {"values": [any_json(x) for x in v.array_value.values]}}
    if which == "kvlist_value":
        return {"kvlistValue": {"values": [{"key": kv.key, "value": any_json(kv.value)}
                                           for kv in v.kvlist_value.values]}}
    if which == "int_value":
        return {"intValue": str(v.int_value)}  # the OTLP JSON mapping writes 64-bit ints as strings
    if which == "bytes_value":
        import base64

        return {"bytesValue": base64.b64encode(v.bytes_value).decode()}
    if which == "double_value":
        d = v.double_value
        return {"doubleValue": d if math.isfinite(d) else ("NaN" if math.isnan(d) else
                                                           ("Infinity" if d > 0 else "-Infinity"))}
    name = {"string_value": "stringValue", "bool_value": "boolValue"}[which]
    return {name: getattr(v, which)}


def kv_json(attrs) -> list:
    return [{"key": kv.key, "value": any_json(kv.value)} for kv in attrs]


def request_json(req: ExportTraceServiceRequest) -> dict:
    """The OTLP/JSON mapping of ``req`` (hex ids, lowerCamelCase, 64-bit ints as strings)."""
    return {"resourceSpans": [{
        "resource": {"attributes": kv_json(rs.resource.attributes)},
        "scopeSpans": [{
            "scope": {"name": ss.scope.name, "version": ss.scope.version},
            "spans": [{
                "traceId": sp.trace_id.hex(), "spanId": sp.span_id.hex(), "parentSpanId": sp.parent_span_id.hex(),
                "traceState": sp.trace_state, "name": sp.name, "kind": sp.kind,
                "startTimeUnixNano": str(sp.start_time_unix_nano), "endTimeUnixNano": str(sp.end_time_unix_nano),
                "attributes": kv_json(sp.attributes),
                "events": [{"timeUnixNano": str(e.time_unix_nano), "name": e.name, "attributes": kv_json(e.attributes)}
                           for e in sp.events],
                "links": [{"traceId": lk.trace_id.hex(), "spanId": lk.span_id.hex(),
                           "attributes": kv_json(lk.attributes)} for lk in sp.links],
                "status": {"code": sp.status.code, "message": sp.status.message},
            } for sp in ss.spans],
        } for ss in rs.scope_spans],
    } for rs in req.resource_spans]}



HOSTILE_JSON = st.one_of(
    st.sampled_from([2**64, 2**70, -1, 2**63, U64, 1e300, -0.0, 0.5, "abc", "", "-1", "1" * 41, "NaN", "0x10",
                     None, True, [], {}, [1], {"a": 1}, "\ud800", "zz" * 8, "00" * 9]),
    st.sampled_from([Raw("1e400"), Raw("NaN"), Raw("-Infinity"), Raw("1" + "0" * 400)]),
    st.integers(), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
)


def nodes(doc):
    """Every (container, key) of the document, for replacing one node."""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for k, v in items:
        yield doc, k
        yield from nodes(v)


@fuzz(150)
@given(req=export_request(), data=st.data())
def test_json_requests_with_hostile_nodes(req, data):
    doc = request_json(req)
    for _ in range(data.draw(st.integers(0, 3))):
        spots = list(nodes(doc))
        if not spots:
            break
        container, key = data.draw(st.sampled_from(spots))
        container[key] = copy.deepcopy(data.draw(HOSTILE_JSON))  # one object twice would make a cycle
    check(decode_json, dump(doc).encode("utf-8", "surrogatepass"))


@fuzz(60)
@given(req=export_request(), data=st.data())
def test_json_with_bytes_spliced_in(req, data):
    raw = bytearray(dump(request_json(req)).encode())
    at = data.draw(st.integers(0, len(raw)))
    raw[at:at] = data.draw(st.binary(min_size=1, max_size=4))
    check(decode_json, bytes(raw))


@pytest.mark.parametrize("decode", [decode_protobuf, decode_json])
def test_empty_body_is_an_empty_request(decode):
    """Nothing to store is not an error (the collector answers 200 to an empty export)."""
    try:
        spans = decode(b"" if decode is decode_protobuf else b"{}")
    except KVTraceError as err:  # pragma: no cover - the assertion says why
        raise AssertionError(err) from None
    assert spans == []


# -- regressions the fuzzer found ------------------------------------------------------------------
@pytest.mark.parametrize("offset", [AnyValue(double_value=math.inf), AnyValue(double_value=-math.inf),
                                    AnyValue(double_value=math.nan), AnyValue(string_value="1" * 5000),
                                    AnyValue(string_value=" 1_000 "), AnyValue(bool_value=True),
                                    AnyValue(double_value=1e19), AnyValue(double_value=1500.5),
                                    AnyValue(int_value=-5)])
def test_a_hostile_time_offset_resource_attribute_is_refused(offset):
    """A double inf as kvtrace.run.time_offset_ns was an OverflowError in int() (the
    collector answered with a dropped connection); then junk was no offset, while " 1_000 ",
    true and 1e18 went through int() and shifted every time: kvtrace sends an integer, and
    anything else is refused, naming the attribute. (A double that spells an integer below
    2^63, 1e18, is taken: the ClickHouse exporter writes it as that integer's text.)"""
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.append(KeyValue(key=TIME_OFFSET_RESOURCE_KEY, value=offset))
    sp = rs.scope_spans.add().spans.add()
    sp.name, sp.trace_id, sp.span_id = "x", b"\x01" * 16, b"\x02" * 8
    sp.start_time_unix_nano = sp.end_time_unix_nano = 5
    spans = decode_protobuf(req.SerializeToString())
    with pytest.raises(KVTraceError, match=r"kvtrace\.run\.time_offset_ns: expected an integer of ns"):
        time_offset(spans[0][0])
    with pytest.raises(KVTraceError):
        store_rows(spans)


# -- grammar-aware: one request in each encoding, written every way OTLP/JSON allows ----------------------
def _same(v):
    """A decoded value made comparable (NaN equal to NaN)."""
    if isinstance(v, float) and math.isnan(v):
        return "NaN"
    if isinstance(v, dict):
        return {k: _same(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_same(x) for x in v]
    return v


ONEOF = {"values", "value", "key", "stringValue", "bytesValue", "arrayValue", "kvlistValue"}  # (AnyValue's, kept)


def json_variant(req: ExportTraceServiceRequest, draw) -> dict:
    """``request_json(req)`` as another encoder may write it: snake_case keys, 64-bit ints as
    numbers, enums by name, upper-case hex ids, URL-safe or unpadded base64, empty fields left
    out, doubles that are integers written as ints."""
    import base64

    doc = request_json(req)

    def key(camel: str) -> str:
        return re.sub(r"[A-Z]", lambda m: "_" + m.group().lower(), camel) if draw(st.booleans()) else camel

    def walk(v, parent: str | None = None):
        if isinstance(v, list):
            return [walk(x, parent) for x in v]
        if not isinstance(v, dict):
            return v
        out = {}
        for k, x in v.items():
            if k in ("startTimeUnixNano", "endTimeUnixNano", "timeUnixNano", "intValue") and draw(st.booleans()):
                x = int(x)  # (a JSON number: Python's json reads it exactly)
            elif k in ("traceId", "spanId", "parentSpanId") and draw(st.booleans()):
                x = x.upper()
            elif k == "bytesValue":
                raw = base64.b64decode(x)
                x = draw(st.sampled_from([base64.b64encode(raw).decode(), base64.urlsafe_b64encode(raw).decode(),
                                          base64.b64encode(raw).decode().rstrip("=")]))
            elif k == "doubleValue" and isinstance(x, float) and x.is_integer() and abs(x) < 2**53 \
                    and draw(st.booleans()):
                x = int(x)
            elif k == "kind" and draw(st.booleans()):
                x = {v: n for n, v in _KIND_NAMES.items()}.get(x, x)
            elif k == "code" and parent == "status" and draw(st.booleans()):
                x = {v: n for n, v in _STATUS_NAMES.items()}.get(x, x)
            if x in ("", [], {}) and k not in ONEOF and draw(st.booleans()):
                continue  # (proto3 JSON leaves default values out, but a oneof's member set is written)
            out[key(k) if k not in ("key", "value", "values") else k] = walk(x, k)
        return out

    return walk(doc)


@fuzz(100)
@given(req=export_request(), data=st.data())
def test_protobuf_and_json_of_one_request_decode_the_same(req, data):
    """What decode_protobuf makes of a request, decode_json makes of its JSON written any
    way the OTLP JSON mapping allows; a request one refuses the other refuses too."""
    def decoded(decode, body):
        try:
            return _same([(r, {k: v for k, v in kw.items()}, w) for r, kw, w in decode(body)])
        except Exception as err:  # the invariant is about every exception
            one_line_error(err)
            return None

    want = decoded(decode_protobuf, req.SerializeToString())
    body = json.dumps(json_variant(req, data.draw)).encode()
    got = decoded(decode_json, body)
    assert (got is None) == (want is None), f"protobuf {'refused' if want is None else 'read'} it, JSON not: {body!r}"
    assert got == want, f"{body!r}: protobuf {want}, JSON {got}"


@pytest.mark.parametrize("key, value, reason", [
    ("k" * 500, {"intValue": "x"}, "intValue: expected an integer, got 'x'"),
    ("x", {"intValue": Raw("1e300")}, "is out of range (-9223372036854775808 to 9223372036854775807)"),
    ("x", {"intValue": Raw("1" * 400)}, "characters left out) ...111 is out of range"),
])
def test_a_refusal_quoting_a_long_key_or_number_still_says_what_is_wrong(key, value, reason):
    """A refusal is cut at 300 characters, and was cut at its end: a 500-character attribute
    key in its path, or the 301 digits of an intValue 1e300, left no word of what was wrong."""
    doc = {"resourceSpans": [{"scopeSpans": [{"spans": [{
        "traceId": "01" * 16, "spanId": "02" * 8, "startTimeUnixNano": "5", "endTimeUnixNano": "6",
        "attributes": [{"key": key, "value": value}]}]}]}]}
    with pytest.raises(KVTraceError) as info:
        decode_json(dump(doc).encode())
    text = one_line_error(info.value, "resourceSpans[0].scopeSpans[0].spans[0].", reason)
    assert len(text) <= 310, text
