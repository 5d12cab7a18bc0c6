"""The twenty-fifth session's probe of ``kvtrace collect``: values out of OTLP's or kvtrace's
range are refused naming the field, where they were stored as something else with a 200."""

from __future__ import annotations

import json
import re

import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from kvtrace.errors import KVTraceError
from kvtrace.instrument.otlp import OTLPCollector, decode_json, decode_protobuf
from kvtrace.store.read import run
from tests.instrument.helpers import count_spans, post_otlp_json

TRACE = "5d1e0a3b7c9f41d2a8b6c4e2f0a1b3c5"
OFFSET_KEY = "kvtrace.run.time_offset_ns"


def _kv(key: str, value: dict) -> dict:
    return {"key": key, "value": value}


def _span(i: int, **fields) -> dict:
    span = {"traceId": TRACE, "spanId": f"{i:016x}", "name": "op",
            "startTimeUnixNano": str(5_000 + i), "endTimeUnixNano": str(6_000 + i)}
    span.update(fields)
    return span


def _doc(spans: list[dict], run_id: str = "probe25", resource: list[dict] | None = None) -> dict:
    attrs = [_kv("kvtrace.run.id", {"stringValue": run_id}), *(resource or [])]
    return {"resourceSpans": [{"resource": {"attributes": attrs}, "scopeSpans": [{"spans": spans}]}]}


def _record(i: int, **attrs: dict) -> dict:
    return _span(i, name="kvtrace.run", attributes=[_kv(f"kvtrace.run.{k}", v) for k, v in attrs.items()])


_post = post_otlp_json


@pytest.fixture()
def collector(tmp_path):
    c = OTLPCollector(tmp_path / "probe25.duckdb", port=0).start()
    yield c
    c.stop()


def _as_protobuf(doc: dict) -> bytes:
    """The protobuf of an OTLP/JSON document (ids hex, as OTLP writes them)."""
    req = trace_service_pb2.ExportTraceServiceRequest()
    for rs in doc["resourceSpans"]:
        out = req.resource_spans.add()
        for ss in rs["scopeSpans"]:
            scope = out.scope_spans.add()
            for sp in ss["spans"]:
                span = scope.spans.add(name=sp["name"], trace_id=bytes.fromhex(sp["traceId"]),
                                       span_id=bytes.fromhex(sp["spanId"]),
                                       start_time_unix_nano=int(sp["startTimeUnixNano"]),
                                       end_time_unix_nano=int(sp["endTimeUnixNano"]), kind=sp.get("kind", 0))
                span.status.code = sp.get("status", {}).get("code", 0)
    return req.SerializeToString()


@pytest.mark.parametrize("fields, field, value", [
    ({"kind": 99}, "kind", "99 is no value OTLP defines (0 to 5)"),
    ({"kind": 6}, "kind", "6 is no value OTLP defines (0 to 5)"),
    ({"status": {"code": 7}}, "status.code", "7 is no value OTLP defines (0 to 2)"),
    ({"status": {"code": 3}}, "status.code", "3 is no value OTLP defines (0 to 2)"),
])
def test_a_span_kind_or_status_code_otlp_does_not_define_is_refused_naming_it(fields, field, value):
    """A kind of 99 was stored as Internal and a status code of 7 as Unset, with a 200: a
    value no OTLP sender writes, read as another one. Both decoders refuse it, naming the field."""
    doc = _doc([_span(1), _span(2, **fields)])
    want = re.escape(f"resourceSpans[0].scopeSpans[0].spans[1].{field}: {value}")
    with pytest.raises(KVTraceError, match=want):
        decode_json(json.dumps(doc).encode())
    with pytest.raises(KVTraceError, match=want):
        decode_protobuf(_as_protobuf(doc))
    # the values OTLP defines are read, by number and (JSON) by name
    spans = decode_protobuf(_as_protobuf(_doc([_span(1, kind=5, status={"code": 2}), _span(2)])))
    assert [(s["span_kind"], s["status_code"]) for _, s, _ in spans] == [("Consumer", "Error"), (None, None)]
    spans = decode_json(json.dumps(_doc([_span(1, kind="SPAN_KIND_SERVER", status={"code": "STATUS_CODE_OK"})]))
                        .encode())
    assert [(s["span_kind"], s["status_code"]) for _, s, _ in spans] == [("Server", "Ok")]


def test_an_undefined_kind_stores_nothing_of_its_request_and_keeps_what_was_stored(collector, tmp_path):
    assert _post(collector.url, _doc([_span(1)]))[0] == 200
    code, message = _post(collector.url, _doc([_span(2), _span(3, kind=42)]))
    assert code == 400 and message.endswith("spans[1].kind: 42 is no value OTLP defines (0 to 5)")
    collector.stop()
    assert count_spans(tmp_path / "probe25.duckdb", "probe25") == 1


# (a "running" record with no digest or summary is a run's opening record, fc4c7dd: tests/clickhouse/
# test_opening_record_start33.py holds what both paths do with it, and refuse of one with either)
@pytest.mark.parametrize("status, shown", [({"stringValue": "bogus"}, "'bogus'"), ({"intValue": "2"}, "'2'"),
                                           ({"stringValue": ""}, "''")])
def test_a_run_records_status_other_than_a_finished_runs_is_refused_whole(collector, tmp_path, status, shown):
    """A record's status other than complete, failed or incomplete finished the run as
    ``complete`` with a 200: a ``FAILED`` or ``error`` run read as a good one."""
    code, message = _post(collector.url, _doc([_span(1), _record(9, status=status)]))
    assert code == 400
    assert message == f"resourceSpans[0].scopeSpans[0].spans[1]: kvtrace.run.status: expected complete, failed " \
                      f"or incomplete, got {shown}"
    # the request is refused whole, and the run's own record still finishes it
    assert _post(collector.url, _doc([_span(1), _record(9, status={"stringValue": "failed"})]))[0] == 200
    collector.stop()
    db = tmp_path / "probe25.duckdb"
    assert count_spans(db, "probe25") == 1 and run(db, "probe25")["status"] == "failed"


def test_a_run_record_without_a_status_still_finishes_its_run_complete(collector, tmp_path):
    assert _post(collector.url, _doc([_span(1), _record(9, digest={"stringValue": "ab12"})]))[0] == 200
    collector.stop()
    got = run(tmp_path / "probe25.duckdb", "probe25")
    assert (got["status"], got["digest"]) == ("complete", "ab12")


@pytest.mark.parametrize("digest", ["a b", "ab\ncd", "x" * 129])
def test_a_record_digest_no_listing_can_show_as_one_word_is_refused(collector, tmp_path, digest):
    """The record's digest (what ``diff`` compares and prints) is held to the trace digest's
    rule: it was stored with a line break or a space in it."""
    code, message = _post(collector.url, _doc([_span(1), _record(9, digest={"stringValue": digest})]))
    assert code == 400 and "kvtrace.run.digest: expected 1 to 128 printable characters without spaces" in message
    collector.stop()
    assert count_spans(tmp_path / "probe25.duckdb", "probe25") == 0


@pytest.mark.parametrize("span, field, value", [
    (_span(1, startTimeUnixNano="900", endTimeUnixNano="20000"), "startTimeUnixNano", 900),
    (_span(1, events=[{"timeUnixNano": "999", "name": "e"}]), "events[0].timeUnixNano", 999),
])
def test_a_time_before_the_exports_offset_is_refused_naming_the_field_and_the_offset(collector, tmp_path, span,
                                                                                     field, value):
    """A kvtrace export's times are shifted by its resource's offset; one before it was
    refused as "start time -100 is not a time the store holds": a time the sender never
    sent, and neither the field nor the offset named."""
    offset = [_kv(OFFSET_KEY, {"intValue": "1000"})]
    assert _post(collector.url, _doc([_span(7, startTimeUnixNano="1500", endTimeUnixNano="1600")],
                                     resource=offset))[0] == 200
    code, message = _post(collector.url, _doc([span], resource=offset))
    assert code == 400
    assert message.startswith(f"resourceSpans[0].scopeSpans[0].spans[0]: {field}: {value} is before the resource's "
                              f"{OFFSET_KEY} 1000")
    collector.stop()
    assert count_spans(tmp_path / "probe25.duckdb", "probe25") == 1  # the earlier span, unshifted


def _lookup(i: int, **tokens: int) -> dict:
    keys = {"query": "kvtrace.lookup.query_tokens", "hit": "kvtrace.hit_tokens",
            "external": "kvtrace.external_hit_tokens"}
    attrs = [_kv(keys[k], {"intValue": str(v)}) for k, v in tokens.items()]
    attrs += [_kv("kvtrace.request.id", {"stringValue": f"q{i}"}), _kv("kvtrace.step", {"intValue": str(i)})]
    return _span(i, name="kvtrace.cache.lookup", attributes=attrs)


@pytest.mark.parametrize("tokens, why", [
    ({"query": 10, "hit": 75}, "kvtrace.hit_tokens + kvtrace.external_hit_tokens 75 exceeds "
                               "kvtrace.lookup.query_tokens 10; hits are counted within it"),
    ({"query": 10, "hit": 6, "external": 5}, "kvtrace.hit_tokens + kvtrace.external_hit_tokens 11 exceeds "
                                             "kvtrace.lookup.query_tokens 10"),
    ({"hit": 4}, "kvtrace.hit_tokens + kvtrace.external_hit_tokens 4 given without kvtrace.lookup.query_tokens"),
])
def test_a_lookup_that_hits_more_than_it_asked_is_refused_not_stored_as_a_damaged_run(collector, tmp_path, tokens,
                                                                                      why):
    """A lookup span whose hit tokens passed its query tokens was stored with a 200, and then
    every reader (``runs``, ``diff``, the dashboard) called the run damaged: a run without
    request spans counts its lookups as its requests ("local_compute -260")."""
    from kvtrace.store.read import summary_from_spans

    assert _post(collector.url, _doc([_lookup(1, query=10, hit=6, external=4), _lookup(2, query=8)]))[0] == 200
    code, message = _post(collector.url, _doc([_lookup(3, query=10, hit=2), _lookup(4, **tokens)]))
    assert code == 400 and message.startswith("resourceSpans[0].scopeSpans[0].spans[1]: ") and why in message
    collector.stop()
    db = tmp_path / "probe25.duckdb"
    assert count_spans(db, "probe25") == 2
    got = summary_from_spans(db, "probe25")  # readable, not damaged: what kvtrace's own lookups always are
    assert (got["prefix_cache_queries"], got["prefix_cache_hits"], got["external_prefix_cache_hits"]) == (18, 6, 4)


def test_an_http_request_whose_client_goes_quiet_mid_body_is_counted_as_refused(tmp_path, caplog):
    """An OTLP/HTTP request whose client stopped sending half-way was logged as dropped but not
    counted: the collector's closing line said "0 requests rejected" of a request it had refused,
    where a gRPC call not sent by its deadline is counted. The count now says so too."""
    import socket

    collector = OTLPCollector(tmp_path / "quiet.duckdb", port=0, read_timeout_s=0.5).start()
    try:
        body = json.dumps(_doc([_span(1)])).encode()
        # declared 4 MiB: the body's deadline (16 s more) is far behind the socket's 0.5 s of silence
        head = (f"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {4 << 20}\r\n\r\n").encode()
        with socket.create_connection(collector.address, timeout=30) as s:
            s.sendall(head + body)  # then nothing: the client keeps the connection open, silent
            assert s.recv(65536) == b""  # the receiver gave up on it and closed it, no reply
        assert _post(collector.url, _doc([_span(2)]))[0] == 200  # a whole request: stored, not counted
    finally:
        collector.stop()
    assert collector.requests_rejected == 1 and collector.spans_received == 1
    assert "dropped, nothing stored" in caplog.text
    assert count_spans(tmp_path / "quiet.duckdb", "probe25") == 1
