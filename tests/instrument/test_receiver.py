"""The OTLP/HTTP receiver: JSON, protobuf, gzip, limits and malformed payloads."""

from __future__ import annotations

import gzip
import json
import urllib.error
import urllib.request
import zlib

import polars as pl
import pytest
from google.rpc import status_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from kvtrace.instrument.otlp import OTLPCollector
from tests.instrument.helpers import count_spans, store_rows

TRACE = "5b8efff798038103d269b633813fc60c"


def _json_body(n: int = 2, run_id: str | None = "json-run", trace: str = TRACE) -> bytes:
    resource = [{"key": "service.name", "value": {"stringValue": "client"}}]
    if run_id:
        resource.append({"key": "kvtrace.run.id", "value": {"stringValue": run_id}})
    spans = [{
        "traceId": trace, "spanId": f"{i + 1:016x}", "parentSpanId": "" if i == 0 else f"{1:016x}",
        "name": "kvtrace.cache.publish", "kind": 1,
        "startTimeUnixNano": str(1000 + i), "endTimeUnixNano": 1000 + i,
        "attributes": [
            {"key": "kvtrace.step", "value": {"intValue": str(7 + i)}},
            {"key": "kvtrace.block.ids", "value": {"arrayValue": {"values": [{"intValue": "1"}, {"intValue": 2}]}}},
            {"key": "kvtrace.block.hashes",
             "value": {"arrayValue": {"values": [{"stringValue": "aa"}, {"stringValue": "bb"}]}}},
            {"key": "kvtrace.publish.kind", "value": {"stringValue": "full"}},
            {"key": "custom.flag", "value": {"boolValue": True}},
            {"key": "custom.map", "value": {"kvlistValue": {"values": [{"key": "a", "value": {"doubleValue": 1.5}}]}}},
        ],
        "events": [{"timeUnixNano": "1001", "name": "note",
                    "attributes": [{"key": "k", "value": {"stringValue": "v"}}]}],
        "links": [{"traceId": TRACE, "spanId": "00000000000000ff"}],
        "status": {"code": 2, "message": "boom"},
    } for i in range(n)]
    scope_spans = [{"scope": {"name": "s", "version": "1"}, "spans": spans}]
    return json.dumps({"resourceSpans": [{"resource": {"attributes": resource}, "scopeSpans": scope_spans}]}).encode()


def _pb_span(start: int = 5, end: int = 9, attrs: dict | None = None) -> bytes:
    req = trace_service_pb2.ExportTraceServiceRequest()
    span = req.resource_spans.add().scope_spans.add().spans.add()
    span.trace_id, span.span_id, span.name = bytes.fromhex(TRACE), bytes(range(1, 9)), "kvtrace.engine.step"
    span.start_time_unix_nano, span.end_time_unix_nano = start, end
    for key, v in (attrs or {}).items():
        kv = span.attributes.add()
        kv.key = key
        if isinstance(v, float):
            kv.value.double_value = v
        else:
            kv.value.int_value = v
    return req.SerializeToString()


def _post(url: str, body: bytes, ctype: str = "application/json", encoding: str | None = None):
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": ctype})
    if encoding:
        req.add_header("Content-Encoding", encoding)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read(), resp.headers.get("Content-Type")
    except urllib.error.HTTPError as err:
        return err.code, err.read(), err.headers.get("Content-Type")


@pytest.fixture()
def collector(tmp_path):
    c = OTLPCollector(tmp_path / "rx.duckdb", port=0, max_body_bytes=64 * 1024).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The ``collector`` fixture's collector, one for the module: for the tests that assert only
    the replies to their own requests (a refusal, a limit), never what the store holds."""
    c = OTLPCollector(tmp_path_factory.mktemp("served") / "rx.duckdb", port=0, max_body_bytes=64 * 1024).start()
    yield c
    c.stop()


def test_binds_loopback_by_default(served):
    assert served.address[0] == "127.0.0.1"


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "PATCH", "OPTIONS"])
def test_a_method_other_than_post_gets_405_in_otlp_form(served, method):
    req = urllib.request.Request(served.url, data=b"{}" if method != "GET" else None, method=method,
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 405
    assert json.loads(err.value.read()) == {"code": 2, "message": "use POST /v1/traces"}


def test_json_spans_are_stored_with_typed_columns(tmp_path, collector):
    status, _, ctype = _post(collector.url, _json_body())
    assert (status, ctype) == (200, "application/json")
    collector.stop()
    rows = store_rows(tmp_path / "rx.duckdb", "json-run")
    assert len(rows) == 2
    r = rows[0]
    assert (r["trace_id"], r["span_id"], r["parent_span_id"]) == (TRACE, "0000000000000001", None)  # root: NULL parent
    assert (r["start_ns"], r["end_ns"], r["step"]) == (1000, 1000, 7)
    assert r["block_ids"] == [1, 2] and r["block_hashes"] == ["aa", "bb"]
    assert r["publish_kind"] == "full"
    assert r["extra_attributes"] == {"custom.flag": "true", "custom.map": '{"a":1.5}'}
    assert (r["status_code"], r["status_message"]) == ("Error", "boom")
    assert r["events"] == [{"time_ns": 1001, "name": "note", "attributes": {"k": "v"}}]
    assert r["links"][0]["span_id"] == "00000000000000ff"
    assert (r["service_name"], r["scope_name"], r["scope_version"], r["source"]) == ("client", "s", "1", "otlp")
    assert rows[1]["parent_span_id"] == "0000000000000001"


def test_gzip_protobuf_is_accepted(tmp_path, collector):
    req = trace_service_pb2.ExportTraceServiceRequest()
    span = req.resource_spans.add().scope_spans.add().spans.add()
    span.trace_id, span.span_id, span.name = bytes.fromhex(TRACE), bytes(range(1, 9)), "kvtrace.engine.step"
    span.start_time_unix_nano, span.end_time_unix_nano = 5, 9
    kv = span.attributes.add()
    kv.key, kv.value.int_value = "kvtrace.step", 42
    status, body, ctype = _post(collector.url, gzip.compress(req.SerializeToString()), "application/x-protobuf", "gzip")
    assert status == 200 and ctype == "application/x-protobuf"
    trace_service_pb2.ExportTraceServiceResponse.FromString(body)
    collector.stop()
    rows = store_rows(tmp_path / "rx.duckdb", "r1", "name, step, start_ns, end_ns")
    assert rows == [{"name": "kvtrace.engine.step", "step": 42, "start_ns": 5, "end_ns": 9}]


@pytest.mark.parametrize("body, ctype, what", [
    (b"{not json", "application/json", "invalid JSON"),
    (json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz", "spanId": "00"}]}]}]}).encode(),
     "application/json", "traceId"),
    (json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [
        {"traceId": TRACE, "spanId": "0000000000000001", "startTimeUnixNano": "soon"}]}]}]}).encode(),
     "application/json", "startTimeUnixNano"),
    (b"\xff\xff\xff\xff garbage", "application/x-protobuf", "ExportTraceServiceRequest"),
    # what OTLP calls invalid: stored, an end before the start read as a negative duration
    (json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [
        {"traceId": TRACE, "spanId": "0000000000000001", "startTimeUnixNano": "2000", "endTimeUnixNano": "1000"}]}]}]}
     ).encode(), "application/json", "endTimeUnixNano: 1000 is before startTimeUnixNano 2000"),
    (json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [
        {"traceId": TRACE, "spanId": "0000000000000000"}]}]}]}).encode(), "application/json", "spanId is all zeros"),
    (json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [
        {"traceId": "0" * 32, "spanId": "0000000000000001"}]}]}]}).encode(), "application/json",
     "traceId is all zeros"),
    (_pb_span(start=2000, end=1000), "application/x-protobuf", "endTimeUnixNano: 1000 is before"),
])
def test_malformed_payload_gets_400_and_keeps_what_is_stored(tmp_path, collector, body, ctype, what):
    assert _post(collector.url, _json_body(3))[0] == 200
    status, reply, reply_type = _post(collector.url, body, ctype)
    assert status == 400
    if reply_type == "application/json":
        assert what in json.loads(reply)["message"]
    else:
        assert what in status_pb2.Status.FromString(reply).message
    assert _post(collector.url, _json_body(2, run_id="after"))[0] == 200  # still serving
    collector.stop()
    assert count_spans(tmp_path / "rx.duckdb", "json-run") == 3
    assert count_spans(tmp_path / "rx.duckdb", "after") == 2


def test_a_bad_span_rejects_the_whole_request(tmp_path, collector):
    doc = json.loads(_json_body(3))
    doc["resourceSpans"][0]["scopeSpans"][0]["spans"][2]["spanId"] = "short"
    assert _post(collector.url, json.dumps(doc).encode())[0] == 400
    collector.stop()
    assert count_spans(tmp_path / "rx.duckdb", "json-run") == 0


@pytest.mark.parametrize("wbits", [zlib.MAX_WBITS, -zlib.MAX_WBITS], ids=["zlib", "bare"])
def test_a_deflate_body_is_read_in_either_framing(tmp_path, collector, wbits):
    c = zlib.compressobj(wbits=wbits)
    body = c.compress(_json_body(3)) + c.flush()
    assert _post(collector.url, body, encoding="deflate")[0] == 200
    status, reply, _ = _post(collector.url, body[:-3], encoding="deflate")  # cut: nothing stored
    assert status == 400 and "deflate" in json.loads(reply)["message"]
    assert _post(collector.url, body + b"junk", encoding="deflate")[0] == 400
    collector.stop()
    assert count_spans(tmp_path / "rx.duckdb", "json-run") == 3


def test_body_limits(served):
    big = b"x" * (65 * 1024)
    assert _post(served.url, big)[0] == 413
    bomb = gzip.compress(b" " * (1024 * 1024))  # small on the wire, 1 MiB inflated
    assert len(bomb) < 64 * 1024
    assert _post(served.url, bomb, encoding="gzip")[0] == 413
    assert _post(served.url, zlib.compress(b" " * (1024 * 1024)), encoding="deflate")[0] == 413
    assert _post(served.url, b"{}", "text/plain")[0] == 415
    assert _post(served.url.replace("/v1/traces", "/v1/logs"), b"{}")[0] == 404
    assert _post(served.url, b"{}")[0] == 200  # an empty export is fine


# --- hostile requests: refused whole, named, never a traceback, never poisoning the next --------
def _span_json(**fields) -> bytes:
    span = {"traceId": TRACE, "spanId": "0000000000000001", "name": "kvtrace.engine.step", **fields}
    return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]}).encode()


def _attr(key: str, value: dict) -> list[dict]:
    return [{"key": key, "value": value}]




@pytest.mark.parametrize("body, ctype, needle", [
    (_pb_span(start=2**64 - 1), "application/x-protobuf", "spans[0].startTimeUnixNano: 18446744073709551615"),
    (_span_json(startTimeUnixNano=str(2**70)), "application/json", "spans[0].startTimeUnixNano"),
    (_span_json(endTimeUnixNano=2**63), "application/json", "spans[0].endTimeUnixNano"),
    (_span_json(events=[{"timeUnixNano": "-1", "name": "e"}]), "application/json", "events[0].timeUnixNano"),
    (_span_json(attributes=_attr("k", {"doubleValue": "abc"})), "application/json", "spans[0].k.doubleValue"),
    (_span_json(attributes=_attr("k", {"intValue": str(2**70)})), "application/json", "spans[0].k.intValue"),
    (_span_json(attributes=_attr("k", {"boolValue": "false"})), "application/json", "spans[0].k.boolValue"),
    (_span_json(name=["not", "a", "string"]), "application/json", "spans[0].name"),
    (_span_json(traceState={"a": 1}), "application/json", "spans[0].traceState"),
    # typed columns: kvtrace.group is an INTEGER, kvtrace.step.usage DOUBLE[] (no NaN)
    (_span_json(attributes=_attr("kvtrace.group", {"intValue": str(2**40)})), "application/json",
     "spans[0]: kvtrace.group: 1099511627776 does not fit"),
    (_span_json(attributes=_attr("kvtrace.step.usage", {"arrayValue": {"values": [{"doubleValue": "NaN"}]}})),
     "application/json", "spans[0]: kvtrace.step.usage: NaN"),
    (_pb_span(attrs={"kvtrace.request.itl_mean_ns": float("inf")}), "application/x-protobuf", "itl_mean_ns: NaN"),
    (_span_json(attributes=_attr("k", {"stringValue": "\ud800"})), "application/json", "spans[0]"),
    # counts are never negative (a -1 prompt was stored and summed into every view)
    (_span_json(attributes=_attr("gen_ai.usage.input_tokens", {"intValue": "-1"})), "application/json",
     "spans[0]: gen_ai.usage.input_tokens: -1 does not fit the store's num_prompt_tokens column (0 to"),
    (_span_json(attributes=_attr("kvtrace.lookup.hit_tokens_per_group",
                                 {"arrayValue": {"values": [{"intValue": "3"}, {"intValue": "-2"}]}})),
     "application/json", "kvtrace.lookup.hit_tokens_per_group: -2 does not fit"),
    (_span_json(attributes=_attr("kvtrace.lookup.first_miss_index", {"intValue": "-2"})), "application/json",
     "first_miss_index column (-1 to"),  # (-1: every block hit)
    (b"[" * 60_000, "application/json", "nested too deeply"),
])
def test_values_the_store_cannot_hold_get_400_naming_the_field(tmp_path, collector, capfd, body, ctype, needle):
    status, reply, reply_type = _post(collector.url, body, ctype)
    assert status == 400, reply
    message = json.loads(reply)["message"] if reply_type == "application/json" else \
        status_pb2.Status.FromString(reply).message
    assert needle in message and "\n" not in message
    assert _post(collector.url, _json_body(2, run_id="after"))[0] == 200  # the next request is not poisoned
    collector.stop()
    assert count_spans(tmp_path / "rx.duckdb", "after") == 2
    assert count_spans(tmp_path / "rx.duckdb", "r1") == 0
    assert "Traceback" not in capfd.readouterr().err


def _raw_http(address: tuple[str, int], head: bytes, body: bytes, half_close: bool) -> bytes:
    import socket

    with socket.create_connection(address, timeout=10) as s:
        s.sendall(head + body)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_a_body_shorter_than_its_content_length_is_400_and_not_stored(tmp_path, collector, capfd):
    body = _json_body(3)
    head = (f"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) + 100}\r\n\r\n").encode()
    reply = _raw_http(collector.address, head, body, half_close=True)
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
    assert b"body ended after" in reply
    collector.stop()
    assert count_spans(tmp_path / "rx.duckdb", "json-run") == 0
    assert "Traceback" not in capfd.readouterr().err


def test_a_failed_commit_leaves_nothing_for_the_next_request(tmp_path):
    """A store that refuses the commit (another process holds its file) gets the client a
    503 and drops the request's rows: the next request's commit does not carry them."""
    import duckdb

    c = OTLPCollector(tmp_path / "rx.duckdb", port=0).start()
    try:
        c.store.lock_timeout_s = 0.2
        holder = duckdb.connect(str(tmp_path / "rx.duckdb"))  # a writer elsewhere holds the file
        try:
            status, body, _ = _post(c.url, _json_body(3))
        finally:
            holder.close()
        # UNAVAILABLE in the Status, as gRPC answers the same refusal and the connection cap's 503 says
        assert status == 503 and json.loads(body)["code"] == 14, body
        assert _post(c.url, _json_body(2, run_id="after"))[0] == 200
    finally:
        c.stop()
    assert count_spans(tmp_path / "rx.duckdb", "json-run") == 0
    assert count_spans(tmp_path / "rx.duckdb", "after") == 2
    seqs = [r["seq"] for r in store_rows_with_seq(tmp_path / "rx.duckdb", "after")]
    # (a named run's spans without kvtrace.seq are numbered from 2^62, past any number its sender gives)
    assert seqs == [1 << 62, (1 << 62) + 1]


def store_rows_with_seq(path, run_id: str) -> list[dict]:
    import duckdb

    con = duckdb.connect(str(path), read_only=True)
    try:
        return [{"seq": s} for (s,) in con.execute("SELECT seq FROM spans WHERE run_id = ? ORDER BY seq",
                                                   [run_id]).fetchall()]
    finally:
        con.close()


def _chunked(body: bytes, size: int = 100, tail: bytes = b"0\r\n\r\n") -> bytes:
    out = b"".join(f"{len(body[i:i + size]):x};ext=1\r\n".encode() + body[i:i + size] + b"\r\n"
                   for i in range(0, len(body), size))
    return out + tail


CHUNKED_HEAD = (b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n")


def test_a_chunked_body_is_read_and_stored(tmp_path, collector):
    """HTTP/1.1 clients may stream a body without a Content-Length (RFC 9112 7.1)."""
    reply = _raw_http(collector.address, CHUNKED_HEAD, _chunked(_json_body(3), tail=b"0\r\nX-Trailer: 1\r\n\r\n"),
                      half_close=True)
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
    collector.stop()
    assert count_spans(tmp_path / "rx.duckdb", "json-run") == 3


def test_a_body_framed_both_ways_is_refused_and_not_stored(tmp_path, collector):
    body = _chunked(_json_body(2))
    head = CHUNKED_HEAD.replace(b"\r\n\r\n", f"\r\nContent-Length: {len(body)}\r\n\r\n".encode())
    reply = _raw_http(collector.address, head, body, half_close=True)
    assert reply.startswith(b"HTTP/1.1 400") and b"both Content-Length" in reply, reply[:200]
    collector.stop()
    assert count_spans(tmp_path / "rx.duckdb", "json-run") == 0


@pytest.mark.parametrize("body, status, needle", [
    (b"zz\r\nabc\r\n0\r\n\r\n", b"400", b"not hexadecimal"),
    (b"10\r\nabc", b"400", b"ended inside a chunk"),  # cut inside a chunk, then half-closed
    (b"3\r\nabc\r\n", b"400", b"chunk size line is cut"),  # no last chunk
    (b"3\r\nabcXY0\r\n\r\n", b"400", b"ended inside a chunk"),  # no CRLF after the data
    (f"{70 * 1024:x}\r\n".encode(), b"413", b"exceeds the limit"),  # the fixture's limit is 64 KiB
], ids=["not-hex", "cut-chunk", "no-last-chunk", "no-crlf", "too-large"])
def test_a_malformed_or_oversized_chunked_body_is_refused_and_not_stored(tmp_path, collector, capfd, body,
                                                                         status, needle):
    reply = _raw_http(collector.address, CHUNKED_HEAD, body, half_close=True)
    assert reply.startswith(b"HTTP/1.1 " + status), reply[:200]
    assert needle in reply
    assert _post(collector.url, _json_body(2, run_id="after"))[0] == 200
    collector.stop()
    assert count_spans(tmp_path / "rx.duckdb", "after") == 2
    assert "Traceback" not in capfd.readouterr().err


def _with_run_span(attrs: list[dict]) -> bytes:
    """_json_body's three spans, then a ``kvtrace.run`` record span with ``attrs``."""
    doc = json.loads(_json_body(3))
    doc["resourceSpans"][0]["scopeSpans"][0]["spans"].append(
        {"traceId": TRACE, "spanId": "00000000000000aa", "name": "kvtrace.run", "attributes": attrs})
    return json.dumps(doc).encode()


@pytest.mark.parametrize("attrs, needle", [
    ([{"key": "kvtrace.run.summary", "value": {"stringValue": "not json"}}], "kvtrace.run.summary"),
    ([{"key": "kvtrace.run.summary", "value": {"stringValue": "[1, 2]"}}], "kvtrace.run.summary"),
    # values every view reads as numbers: a rate of 7.5 showed as 750%, a count of "many" as text
    ([{"key": "kvtrace.run.summary", "value": {"stringValue": '{"prefix_cache_hit_rate": 7.5}'}}],
     "kvtrace.run.summary: prefix_cache_hit_rate: expected a rate from 0 to 1, got 7.5"),
    ([{"key": "kvtrace.run.summary", "value": {"stringValue": '{"requests": "many"}'}}],
     "kvtrace.run.summary: requests: expected a count"),
    ([{"key": "kvtrace.run.summary", "value": {"stringValue": '{"evictions": 1e300}'}}], "evictions: expected a count"),
    ([{"key": "kvtrace.run.summary", "value": {"stringValue": '{"block_hit_rate": true}'}}], "block_hit_rate"),
    ([{"key": "kvtrace.run.summary", "value": {"stringValue": '{"p99_ttft_ms": -1}'}}], "p99_ttft_ms: expected a time"),
    # (printed as a 300-digit number by runs and diff)
    ([{"key": "kvtrace.run.summary", "value": {"stringValue": '{"p50_ttft_ms": 1e308}'}}],
     "p50_ttft_ms: expected a time"),
    ([{"key": "kvtrace.run.digest", "value": {"arrayValue": {"values": [{"intValue": "1"}]}}}],
     "kvtrace.run.digest"),
])
def test_a_bad_run_record_refuses_its_request_whole(tmp_path, collector, capfd, attrs, needle):
    """It used to be a 500 with a traceback, after the request's other spans were committed
    (the exporter's retry then stored them twice)."""
    status, reply, _ = _post(collector.url, _with_run_span(attrs))
    assert status == 400 and needle in json.loads(reply)["message"]
    collector.stop()
    assert count_spans(tmp_path / "rx.duckdb", "json-run") == 0
    assert "Traceback" not in capfd.readouterr().err


def _run_spans(db, run_id: str) -> int:
    """The spans ``kvtrace runs`` counts for the run (its derived tables once finished)."""
    from kvtrace.store.read import runs

    return int(runs(db).filter(pl.col("run_id") == run_id)["num_spans"][0])


def test_spans_after_a_runs_record_are_counted_by_runs(tmp_path, collector):
    """They were stored with 200, but the run's derived tables, built when its record came,
    were never rebuilt: ``runs`` said 3 spans while the table held 5."""
    record = [{"key": "kvtrace.run.status", "value": {"stringValue": "complete"}},
              {"key": "kvtrace.run.summary", "value": {"stringValue": '{"requests": 1}'}}]
    assert _post(collector.url, _with_run_span(record))[0] == 200
    assert _post(collector.url, _json_body(2, trace="7" * 32))[0] == 200  # late, for the same run
    collector.stop()
    db = tmp_path / "rx.duckdb"
    assert count_spans(db, "json-run") == _run_spans(db, "json-run") == 5
    from kvtrace.store.read import run

    got = run(db, "json-run")
    assert got["status"] == "complete" and got["summary"]["requests"] == 1  # the record's, kept


def test_a_record_cannot_finish_the_collectors_own_run(tmp_path, collector):
    """A client naming the collector's own run (of spans naming none) finished it as
    ``failed``; spans sent after went on into it, and it was never finished again."""
    assert _post(collector.url, _json_body(2, run_id=None))[0] == 200  # makes the collector's run
    own = collector._default_run
    doc = json.loads(_with_run_span([{"key": "kvtrace.run.status", "value": {"stringValue": "failed"}}]))
    doc["resourceSpans"][0]["resource"]["attributes"][1]["value"]["stringValue"] = own
    status, reply, _ = _post(collector.url, json.dumps(doc).encode())
    assert status == 400 and f"kvtrace.run.id: {own} is this collector's own run" in json.loads(reply)["message"]
    assert _post(collector.url, _json_body(1, run_id=None, trace="7" * 32))[0] == 200
    collector.stop()
    db = tmp_path / "rx.duckdb"
    from kvtrace.store.read import run

    assert run(db, own)["status"] == "complete"
    assert count_spans(db, own) == _run_spans(db, own) == 3


@pytest.mark.parametrize("length", ["\u00b2", "9" * 5000, "-5", "1e3"])
def test_a_content_length_that_is_no_byte_count_is_400(tmp_path, collector, capfd, length):
    body = _json_body(2)
    head = (b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
            + length.encode("latin-1") + b"\r\n\r\n")
    reply = _raw_http(collector.address, head, body, half_close=True)
    assert reply.startswith(b"HTTP/1.1 400") and b"Content-Length" in reply, reply[:300]
    assert _post(collector.url, _json_body(2, run_id="after"))[0] == 200
    collector.stop()
    assert count_spans(tmp_path / "rx.duckdb", "json-run") == 0
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("body, needle", [
    (b'{"resourceSpans": [], "x": ' + b"1" * 5000 + b"}", "invalid JSON"),
    (json.dumps({"resourceSpans": "abc"}).encode(), "resourceSpans: expected a list"),
    (json.dumps({"resourceSpans": {"a": 1}}).encode(), "resourceSpans: expected a list"),
    (json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": ["x"]}]}]}).encode(),
     "resourceSpans[0].scopeSpans[0].spans: expected a list of objects"),
])
def test_json_of_the_wrong_shape_or_size_is_400_naming_it(served, capfd, body, needle):
    status, reply, _ = _post(served.url, body)
    assert status == 400 and needle in json.loads(reply)["message"], reply
    assert "Traceback" not in capfd.readouterr().err


def test_every_member_of_a_gzip_body_is_stored(tmp_path, collector):
    """RFC 1952: concatenated members are one stream. Only the first was stored, with a 200."""
    def pb(first: int) -> bytes:
        req = trace_service_pb2.ExportTraceServiceRequest()
        spans = req.resource_spans.add().scope_spans.add().spans
        for i in range(first, first + 3):
            span = spans.add()
            span.trace_id, span.span_id, span.name = bytes.fromhex(TRACE), (i + 1).to_bytes(8, "big"), f"mm{i}"
        return req.SerializeToString()

    body = gzip.compress(pb(0)) + gzip.compress(pb(3))
    assert _post(collector.url, body, "application/x-protobuf", "gzip")[0] == 200
    status, _, _ = _post(collector.url, gzip.compress(pb(6)) + b"trailing junk", "application/x-protobuf", "gzip")
    assert status == 400
    collector.stop()
    names = sorted(r["name"] for r in store_rows(tmp_path / "rx.duckdb", "r1", "name"))
    assert names == [f"mm{i}" for i in range(6)]


def test_two_different_content_lengths_are_refused(tmp_path, collector, capfd):
    """RFC 9112 6.3: the first was used, and the rest of the body parsed as a new request."""
    body = _json_body(2)
    head = (f"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 5\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    reply = _raw_http(collector.address, head, body, half_close=True)
    assert reply.startswith(b"HTTP/1.1 400") and reply.count(b"HTTP/1.1") == 1, reply[:300]
    assert b"Content-Length given twice" in reply
    collector.stop()
    assert count_spans(tmp_path / "rx.duckdb", "json-run") == 0


# --- a second probe's findings ----------------------------------------------------------------
def _runs(path) -> dict[str, str]:
    import duckdb

    con = duckdb.connect(str(path), read_only=True)
    try:
        return dict(con.execute("SELECT run_id, status FROM runs").fetchall())
    finally:
        con.close()


@pytest.mark.parametrize("attrs, key", [
    (_attr("kvtrace.request.arrival_ns", {"intValue": str(-2**63)}), "kvtrace.request.arrival_ns"),
    (_attr("kvtrace.request.first_token_ns", {"intValue": "-1"}), "kvtrace.request.first_token_ns"),
    (_attr("kvtrace.step", {"intValue": str(-2**63)}), "kvtrace.step"),
    (_attr("kvtrace.request.itl_ns", {"arrayValue": {"values": [{"intValue": "5"}, {"intValue": "-5"}]}}),
     "kvtrace.request.itl_ns"),
])
def test_a_negative_time_or_step_is_refused_so_no_derived_sum_can_overflow(tmp_path, collector, capfd, attrs, key):
    """A request span arriving at -2^63 was stored with a 200; the run's latencies (end minus
    arrival) then overflowed in finish_run: the collector's shutdown died with a traceback and
    left every run it had made 'running'."""
    body = json.dumps({"resourceSpans": [{
        "resource": {"attributes": _attr("kvtrace.run.id", {"stringValue": "poisoned"})},
        "scopeSpans": [{"spans": [{"traceId": TRACE, "spanId": "0000000000000001", "name": "kvtrace.request",
                                   "startTimeUnixNano": "1", "endTimeUnixNano": str(2**62),
                                   "attributes": attrs}]}]}]}).encode()
    status, reply, _ = _post(collector.url, body)
    assert status == 400 and key in json.loads(reply)["message"], reply
    assert _post(collector.url, _json_body(2, run_id="healthy"))[0] == 200
    collector.stop()
    assert _runs(tmp_path / "rx.duckdb") == {"healthy": "complete"}  # the refused request made no run
    assert "Traceback" not in capfd.readouterr().err


def test_a_run_that_cannot_be_finished_is_logged_and_the_others_still_finish(tmp_path, caplog, monkeypatch):
    c = OTLPCollector(tmp_path / "rx.duckdb", port=0).start()
    assert _post(c.url, _json_body(2, run_id="a"))[0] == 200
    assert _post(c.url, _json_body(2, run_id="b"))[0] == 200
    finish = c.store._finish

    def fails_for_a(run_id, *args):  # (the derived tables of run a cannot be built)
        if run_id == "a":
            raise ValueError("derived tables: overflow")
        return finish(run_id, *args)

    monkeypatch.setattr(c.store, "_finish", fails_for_a)
    c.stop()
    assert _runs(tmp_path / "rx.duckdb") == {"a": "running", "b": "complete"}  # (readers: incomplete)
    assert [r.getMessage() for r in caplog.records] == [
        "run a: not finished (ValueError: derived tables: overflow); its spans are stored"]


def test_a_run_record_that_cannot_be_finished_still_answers_200_once_stored(tmp_path, collector, monkeypatch):
    """The spans were committed, then finishing the run failed: a 500 made the client send
    them again, and they were stored twice."""
    monkeypatch.setattr(collector.store, "finish_run", lambda *a, **k: (_ for _ in ()).throw(ValueError("boom")))
    body = _with_run_span([{"key": "kvtrace.run.status", "value": {"stringValue": "complete"}}])
    assert _post(collector.url, body)[0] == 200
    monkeypatch.undo()
    collector.stop()
    assert count_spans(tmp_path / "rx.duckdb", "json-run") == 3  # once


def test_a_body_sent_with_a_refused_method_is_never_read_as_a_request(tmp_path, collector):
    """A GET's body was left on the connection and parsed as the next request: a POST
    smuggled inside it was stored."""
    inner_body = _json_body(1, run_id="smuggled")
    inner = (f"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             f"Content-Length: {len(inner_body)}\r\n\r\n").encode() + inner_body
    for method in ("GET", "PUT"):
        head = f"{method} /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Length: {len(inner)}\r\n\r\n".encode()
        reply = _raw_http(collector.address, head, inner, half_close=False)
        assert reply.startswith(b"HTTP/1.1 405") and reply.count(b"HTTP/1.1 ") == 1, reply[:300]
    collector.stop()
    assert "smuggled" not in _runs(tmp_path / "rx.duckdb")


def test_http_servers_own_refusals_are_otlp_status_json_not_html(served):
    reply = _raw_http(served.address, b"BREW /v1/traces HTTP/1.1\r\nHost: x\r\n\r\n", b"", half_close=False)
    assert reply.startswith(b"HTTP/1.1 501"), reply[:200]
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["message"].startswith("Unsupported method")
    head = _raw_http(served.address, b"HEAD /v1/traces HTTP/1.1\r\nHost: x\r\n\r\n", b"", half_close=False)
    assert head.startswith(b"HTTP/1.1 405") and head.endswith(b"\r\n\r\n")  # no body after a HEAD's headers


def test_an_absolute_form_target_names_the_traces_path(tmp_path, collector):
    body = _json_body(2)
    head = (f"POST http://{collector.address[0]}/v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    assert _raw_http(collector.address, head, body, half_close=False).startswith(b"HTTP/1.1 200")
    collector.stop()
    assert count_spans(tmp_path / "rx.duckdb", "json-run") == 2


def test_a_gzip_body_of_many_members_is_refused(served):
    """Each member copied the rest of the body: 750k empty members took minutes of CPU."""
    status, reply, _ = _post(served.url, gzip.compress(b"") * 3_000, "application/json", "gzip")
    assert status == 400 and "more than 64 members" in json.loads(reply)["message"]
    assert _post(served.url, gzip.compress(b"") * 63 + gzip.compress(b"{}"), "application/json", "gzip")[0] == 200


@pytest.mark.parametrize("field, value, needle", [
    ("traceId", " " * 30 + "ab", "traceId must be hex"),
    ("spanId", "01 02 03 04 0506", "spanId must be hex"),
    ("status", "code", "spans[0].status: expected an object"),
    ("startTimeUnixNano", " 1_000 ", "startTimeUnixNano: expected an integer"),
    ("startTimeUnixNano", "\u0661\u0662", "startTimeUnixNano: expected an integer"),
])
def test_json_ids_and_integers_are_read_strictly(served, field, value, needle):
    span = {"traceId": TRACE, "spanId": "0000000000000001", "name": "n", field: value}
    body = json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]}).encode()
    status, reply, _ = _post(served.url, body)
    assert status == 400 and needle in json.loads(reply)["message"], reply


def test_empty_and_bytes_values_are_kept_alike_from_json_and_protobuf(tmp_path, collector):
    """An empty AnyValue was stored as the text "None"; JSON bytes as their base64 text
    while protobuf's were hex."""
    attrs = [{"key": "empty"}, {"key": "raw", "value": {"bytesValue": "AQI="}}]
    assert _post(collector.url, _span_json(attributes=attrs))[0] == 200
    req = trace_service_pb2.ExportTraceServiceRequest()
    span = req.resource_spans.add().scope_spans.add().spans.add()
    span.trace_id, span.span_id, span.name = bytes.fromhex(TRACE), bytes(range(1, 9)), "pb"
    span.attributes.add().key = "empty"
    raw = span.attributes.add()
    raw.key, raw.value.bytes_value = "raw", b"\x01\x02"
    assert _post(collector.url, req.SerializeToString(), "application/x-protobuf")[0] == 200
    status, reply, _ = _post(collector.url, _span_json(attributes=_attr("raw", {"bytesValue": "!!"})))
    assert status == 400 and "spans[0].raw.bytesValue: expected base64" in json.loads(reply)["message"]
    collector.stop()
    rows = store_rows(tmp_path / "rx.duckdb", "r1", "name, extra_attributes")
    assert [dict(r["extra_attributes"]) for r in rows] == [{"empty": "", "raw": "0102"}] * 2


def test_a_request_of_too_many_spans_is_refused_before_they_are_decoded(tmp_path):
    """500k tiny spans in a 15 MB body took 1.4 GB to decode."""
    from kvtrace.instrument.otlp.limits import MAX_SPANS_PER_REQUEST

    c = OTLPCollector(tmp_path / "rx.duckdb", port=0).start()
    try:
        req = trace_service_pb2.ExportTraceServiceRequest()
        spans = req.resource_spans.add().scope_spans.add().spans
        for i in range(MAX_SPANS_PER_REQUEST + 1):
            span = spans.add()
            span.trace_id, span.span_id = bytes.fromhex(TRACE), (i + 1).to_bytes(8, "big")
        status, reply, _ = _post(c.url, req.SerializeToString(), "application/x-protobuf")
        assert status == 400 and b"65,537 spans in one request" in reply
        one = {"traceId": TRACE, "spanId": "0000000000000001", "name": "n"}
        body = json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [one] * (MAX_SPANS_PER_REQUEST + 1)}]}]})
        status, reply, _ = _post(c.url, body.encode())
        assert status == 400 and "65,537 spans in one request" in json.loads(reply)["message"]
    finally:
        c.stop()
    assert count_spans(tmp_path / "rx.duckdb", "r1") == 0


# --- an eleventh-session probe's findings -------------------------------------------------------
def test_a_sender_numbered_run_id_beyond_bigint_does_not_block_later_runs(tmp_path, collector):
    """``r9223372036854775807`` overflowed the next id's BIGINT ``+ 1``: every later request
    got 500 and no later replay could create a run in the store."""
    assert _post(collector.url, _json_body(1, run_id="r9223372036854775807"))[0] == 200
    assert _post(collector.url, _json_body(1, run_id=None))[0] == 200  # the collector's own run
    collector.stop()
    assert _runs(tmp_path / "rx.duckdb").keys() == {"r9223372036854775807", "r9223372036854775808"}
    assert count_spans(tmp_path / "rx.duckdb", "r9223372036854775808") == 1


@pytest.mark.parametrize("run_id, needle", [
    ("x" * 129, "expected 1 to 128 characters, got 129"),
    ("a\nb", "'a\\nb': expected printable characters without spaces"),
    ("a\x1b[31mb", "expected printable characters"),
    ("a b", "expected printable characters"),
])
def test_a_run_id_no_listing_can_show_is_400_naming_the_key(tmp_path, collector, run_id, needle):
    status, reply, _ = _post(collector.url, _json_body(1, run_id=run_id))
    message = json.loads(reply)["message"]
    assert status == 400 and "kvtrace.run.id" in message and needle in message, message
    collector.stop()
    assert _runs(tmp_path / "rx.duckdb") == {}


@pytest.mark.parametrize("value, stored", [
    ({"intValue": "3"}, "otlp"),  # a wrong type once stored NULL, which reads as a replay span
    ({"stringValue": "banana"}, "otlp"),
    ({"stringValue": "vllm"}, "vllm"),  # a known source is the sender's to name (a kvtrace export's)
])
def test_a_span_source_is_a_known_one_or_the_receivers(tmp_path, collector, value, stored):
    assert _post(collector.url, _span_json(attributes=_attr("kvtrace.source", value)))[0] == 200
    collector.stop()
    rows = store_rows(tmp_path / "rx.duckdb", "r1", "source, extra_attributes")
    assert rows[0]["source"] == stored
    assert ("kvtrace.source" in dict(rows[0]["extra_attributes"] or [])) == (stored == "otlp")


def _closed_within(s, seconds: float, trickle: bytes = b"") -> bool:
    """Whether the collector closes ``s`` within ``seconds`` while the client sends
    ``trickle`` a byte at a time, 0.2 s apart (a socket's per-read timeout never fires)."""
    import time

    deadline = time.monotonic() + seconds
    s.settimeout(0.2)
    i = 0
    while time.monotonic() < deadline:
        try:
            if s.recv(65536) == b"":
                return True
        except TimeoutError:
            pass
        except OSError:  # reset
            return True
        if i < len(trickle):
            try:
                s.sendall(trickle[i:i + 1])
            except OSError:
                return True
            i += 1
    return False


@pytest.mark.parametrize("sent, trickle", [
    (b"POST /v1/traces HTTP/1.1\r\n", b"X-Slow: " + b"a" * 200),  # a head that never ends
    (b"POST /v1/traces HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n",
     b"b" * 200),  # a body that trickles
])
def test_a_client_that_trickles_bytes_is_dropped_at_its_deadline(tmp_path, sent, trickle):
    """A byte every 0.2 s never trips the 1 s socket timeout; the request's deadline does,
    and meanwhile other clients are served."""
    import socket

    c = OTLPCollector(tmp_path / "rx.duckdb", port=0, read_timeout_s=1.0).start()
    try:
        with socket.create_connection(c.address, timeout=10) as slow:
            slow.sendall(sent)
            assert _post(c.url, _json_body(1))[0] == 200
            assert _closed_within(slow, 6.0, trickle)
    finally:
        c.stop()
    assert count_spans(tmp_path / "rx.duckdb", "json-run") == 1


def test_connections_past_the_cap_get_503_at_once_and_later_ones_are_served(tmp_path):
    import socket

    c = OTLPCollector(tmp_path / "rx.duckdb", port=0, max_connections=2).start()
    try:
        held = [socket.create_connection(c.address, timeout=10) for _ in range(2)]
        for s in held:
            s.sendall(b"POST /v1/traces HTTP/1.1\r\n")  # each holds its thread, waiting for headers
        body = _json_body(1)
        head = (f"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        reply = _raw_http(c.address, head, body, half_close=False)
        assert reply.startswith(b"HTTP/1.1 503") and b"connections open as it serves" in reply, reply[:200]
        for s in held:
            s.close()
        for _ in range(50):  # the held ones' threads end when their sockets close
            if (status := _post(c.url, _json_body(1))[0]) == 200:
                break
            __import__("time").sleep(0.1)
        assert status == 200
    finally:
        c.stop()
    assert count_spans(tmp_path / "rx.duckdb", "json-run") == 1


def test_bodies_past_the_buffer_budget_get_503_before_they_are_read(tmp_path):
    """Each connection announcing a 16 MiB body held it in memory: 40 of them, 810 MB."""
    import socket
    import time

    from kvtrace.instrument.otlp.limits import BUFFERED_BODIES

    # 16 MiB bodies: 4 buffered at once. The held bodies stop after a byte: with the default
    # read timeout (30 s) a loaded box could drop them before the loop below saw its 503
    c = OTLPCollector(tmp_path / "rx.duckdb", port=0, read_timeout_s=300).start()
    try:
        head = (f"POST /v1/traces HTTP/1.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {c.max_body_bytes}\r\n\r\n").encode()
        held = [socket.create_connection(c.address, timeout=10) for _ in range(BUFFERED_BODIES)]
        for s in held:
            s.sendall(head + b"x")
        # (the held bodies counted first: on a loaded box a small request could be served before
        # a held one's handler read its headers, and 300 of them were, every one a 200)
        deadline = time.monotonic() + 120
        while c.guard._buffered < BUFFERED_BODIES * c.max_body_bytes and time.monotonic() < deadline:
            time.sleep(0.05)
        body = _json_body(1)
        small = (f"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n").encode()
        for _ in range(300):  # (until the held bodies are being read: seconds on a loaded box)
            reply = _raw_http(c.address, small, body, half_close=False)
            if reply.startswith(b"HTTP/1.1 503"):
                break
            time.sleep(0.1)
        assert reply.startswith(b"HTTP/1.1 503") and b"too many request bodies buffered" in reply, reply[:200]
        for s in held:
            s.close()
        for _ in range(50):
            if (status := _post(c.url, _json_body(1))[0]) == 200:
                break
            time.sleep(0.1)
        assert status == 200
    finally:
        c.stop()


@pytest.mark.parametrize("codings", [
    b"Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n",
    b"Transfer-Encoding: gzip, chunked\r\n",
    b"Transfer-Encoding: identity\r\n",
])
def test_a_transfer_coding_other_than_chunked_is_501_and_not_stored(tmp_path, collector, codings):
    """The first of two Transfer-Encoding headers framed the body, and it was stored."""
    head = b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + codings + b"\r\n"
    reply = _raw_http(collector.address, head, _chunked(_json_body(2)), half_close=True)
    assert reply.startswith(b"HTTP/1.1 501") and b"only chunked" in reply, reply[:200]
    collector.stop()
    assert count_spans(tmp_path / "rx.duckdb", "json-run") == 0


def test_a_replays_own_summaries_pass_the_senders_check(replayed_store):
    """What the collector asks of a sender's summary, kvtrace's own replays give (engine and
    cache-only): `replay --otlp-endpoint` is never refused by `collect`."""
    from kvtrace.metrics import summary_problem
    from kvtrace.replay.run import RunSpec, run_replay
    from kvtrace.store import read

    summaries = [read.run(replayed_store.path, r)["summary"] for r in (replayed_store.run_on, replayed_store.run_off)]
    summaries.append(run_replay(RunSpec("gen:chat", limit=5, mode="cache-only", capacity_blocks=30)).summary)
    for summary in summaries:
        assert summary and summary_problem(summary) is None, summary


def test_a_burst_of_connections_is_answered_not_reset(tmp_path):
    """100 clients connecting at once, before the accept loop runs: socketserver's listen
    backlog of 5 left the 7th hanging in connect (under load: a reset), where each should
    get an HTTP answer, a 503 at worst."""
    import socket

    collector = OTLPCollector(tmp_path / "burst.duckdb", port=0)
    socks, refused = [], None
    try:
        for i in range(100):
            body = _json_body(1, trace=f"{i + 1:032x}")  # (a span each: the same one sent again is stored once)
            head = (b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n")
            try:
                s = socket.create_connection(collector.address, timeout=3)
            except OSError as err:  # (backlog 5: the 7th timed out here)
                refused = err
                break
            socks.append(s)
            s.sendall(head + body)
    finally:
        collector.start()
        try:
            for s in socks:  # (100 requests stored one by one: seconds under load, so no 3 s each)
                s.settimeout(60)
            replies = [s.recv(12) for s in socks]
        finally:  # (a recv that timed out left the collector serving: the interpreter aborted at exit)
            for s in socks:
                s.close()
            collector.stop()
    assert refused is None and len(replies) == 100
    assert {r[:12] for r in replies} <= {b"HTTP/1.1 200", b"HTTP/1.1 503", b"HTTP/1.0 200", b"HTTP/1.0 503"}
    assert count_spans(tmp_path / "burst.duckdb", "json-run") == sum(r.endswith(b"200") for r in replies) > 0


@pytest.mark.parametrize("target", ["http://[::1/v1/traces", "http://[zz]/v1/traces"])
def test_a_request_target_that_is_no_url_is_400_not_a_traceback(tmp_path, collector, capfd, target):
    """urlsplit raised ValueError (Invalid IPv6 URL): a 500 and a traceback on the server's stderr."""
    body = _json_body(2, run_id="odd-target")
    head = (f"POST {target} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    reply = _raw_http(collector.address, head, body, half_close=True)
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
    assert b"is not a URL" in reply
    assert _post(collector.url, _json_body(2, run_id="after"))[0] == 200
    collector.stop()
    assert count_spans(tmp_path / "rx.duckdb", "odd-target") == 0
    assert count_spans(tmp_path / "rx.duckdb", "after") == 2
    assert collector.requests_rejected == 1
    assert "Traceback" not in capfd.readouterr().err


def test_a_request_stored_as_the_collector_stops_is_answered_first(tmp_path):
    """Handler threads are daemons: a collector stopping (Ctrl-C, SIGTERM) as a request's
    spans were committed could end the process before its 200 was written, and the exporter,
    seeing the reply cut, sent the stored spans again. Closing now waits for that reply."""
    import threading

    collector = OTLPCollector(tmp_path / "stop.duckdb", port=0).start()
    stored, release, got = threading.Event(), threading.Event(), []
    ingest = collector.ingest

    def held_after_storing(spans, wanted=None):
        n = ingest(spans, wanted)
        stored.set()
        release.wait(30)  # (between the commit and the reply)
        return n

    collector.ingest = held_after_storing
    client = threading.Thread(target=lambda: got.append(_post(collector.url, _json_body(2))[0]))
    client.start()
    assert stored.wait(30)
    stopping = threading.Thread(target=collector.stop)
    stopping.start()
    stopping.join(0.5)
    still_waiting = stopping.is_alive()
    release.set()
    stopping.join(30)
    client.join(30)
    assert still_waiting and not stopping.is_alive()  # the stop waited for the stored request's answer
    assert got == [200]
    assert count_spans(tmp_path / "stop.duckdb", "json-run") == 2
