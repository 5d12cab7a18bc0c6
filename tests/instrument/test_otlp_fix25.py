"""The twenty-fifth session's fixes to ``kvtrace collect``: a kvtrace run collected equals its
direct write whatever order its export requests came in (``kvtrace.seq`` kept as seq, the
resource stored as a direct write stores it), gRPC's own refusals counted, run summaries
whose counters disagree refused, token counts bounded."""

from __future__ import annotations

import json

import duckdb
import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from kvtrace.instrument import KVCacheInstrumentor, build_tracer_provider
from kvtrace.instrument.ids import SeededIdGenerator
from kvtrace.instrument.otlp import OTLPCollector
from kvtrace.instrument.otlp.collector import _HeldSeqs
from kvtrace.instrument.pipeline import make_resource
from kvtrace.instrument.processor import BulkSpanProcessor
from kvtrace.store.writer import Store
from tests.instrument.helpers import one_of_each_step, post_otlp_json
from tests.support.synthetic_spans import synthetic_steps

TRACE = "5d1e0a3b7c9f41d2a8b6c4e2f0a1b3c5"


class _Held(SpanExporter):
    """Keeps each export request's spans, sent later in any order."""

    def __init__(self):
        self.requests: list[list] = []

    def export(self, spans):
        self.requests.append(list(spans))
        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass


def _replay(provider, run_id, steps) -> None:
    inst = KVCacheInstrumentor(provider, run_id=run_id, flush_spans=1000)
    for batch in steps:
        inst(batch)
    inst.force_flush()
    provider.shutdown()


def _exported_requests(run_id: str, steps) -> list[list]:
    """The export requests kvtrace's OTLP path makes of a replay (numbered, shifted, 100 spans each)."""
    held = _Held()
    resource = make_resource(run_id, time_offset_ns=7_000_000_000)
    provider = TracerProvider(resource=resource, id_generator=SeededIdGenerator(3))  # (build_tracer_provider's)
    provider.add_span_processor(BulkSpanProcessor(held, max_export_batch_size=100, resource=resource, run_id=run_id,
                                                  time_offset_ns=7_000_000_000, number_spans=True))
    _replay(provider, run_id, steps)
    return held.requests


def _rows(path, run_id: str) -> list[tuple]:
    """Every span row of a run (seq and resource included), in seq order."""
    con = duckdb.connect(str(path), read_only=True)
    try:
        cur = con.execute("SELECT * FROM spans WHERE run_id = ? ORDER BY seq", [run_id])
        names = [d[0] for d in cur.description]
        return [tuple(v for n, v in zip(names, r) if n != "run_id") for r in cur.fetchall()]
    finally:
        con.close()


def _derived(path, run_id: str) -> list[tuple]:
    con = duckdb.connect(str(path), read_only=True)
    try:
        return con.execute("SELECT * EXCLUDE (run_id) FROM evicted_blocks WHERE run_id = ? ORDER BY ALL",
                           [run_id]).fetchall()
    finally:
        con.close()


@pytest.fixture()
def collector(tmp_path):
    c = OTLPCollector(tmp_path / "collected.duckdb", port=0).start()
    yield c
    c.stop()


def test_export_requests_arriving_out_of_order_store_the_direct_run(tmp_path, collector):
    """A forwarding collector reorders requests: the collected run kept arrival order as seq
    (and so other derived tables, evictions among them), where its sender numbered its spans."""
    steps = [one_of_each_step(0), *synthetic_steps(60, seed=8)]
    with Store.open(tmp_path / "direct.duckdb") as store:
        store.create_run("direct", run_id="replay-1")
        _replay(build_tracer_provider(store=store, run_id="replay-1", seed=3), "replay-1", steps)
        store.finish_run("replay-1")
    requests = _exported_requests("replay-1", steps)
    assert len(requests) > 5
    exporter = OTLPSpanExporter(endpoint=collector.url)
    for spans in reversed(requests):  # the last request first
        assert exporter.export(spans) is SpanExportResult.SUCCESS
    collector.stop()
    got, want = _rows(tmp_path / "collected.duckdb", "replay-1"), _rows(tmp_path / "direct.duckdb", "replay-1")
    assert len(got) == len(want) > 700
    assert got == want  # seq, times and the resource (none stored: the SDK's self-description is not)
    assert _derived(tmp_path / "collected.duckdb", "replay-1") == _derived(tmp_path / "direct.duckdb", "replay-1")


def _kv(key: str, value) -> dict:
    kind = "intValue" if isinstance(value, int) else "stringValue"
    return {"key": key, "value": {kind: str(value) if kind == "intValue" else value}}


def _span(i: int, seq: int | None = None, **extra) -> dict:
    attrs = [] if seq is None else [_kv("kvtrace.seq", seq)]
    return {"traceId": TRACE, "spanId": f"{i:016x}", "name": "op", "startTimeUnixNano": str(5_000 + i),
            "endTimeUnixNano": str(6_000 + i), "attributes": attrs, **extra}


def _post(url: str, spans: list[dict], run_id: str | None = "fix25", resource: list[dict] | None = None):
    attrs = ([] if run_id is None else [_kv("kvtrace.run.id", run_id)]) + (resource or [])
    doc = {"resourceSpans": [{"resource": {"attributes": attrs}, "scopeSpans": [{"spans": spans}]}]}
    return post_otlp_json(url, doc)


def _seqs(path, run_id: str) -> dict[int, int]:
    """span id -> seq of a run's spans."""
    con = duckdb.connect(str(path), read_only=True)
    try:
        return {int(s, 16): q for s, q in con.execute("SELECT span_id, seq FROM spans WHERE run_id = ?",
                                                      [run_id]).fetchall()}
    finally:
        con.close()


def test_spans_without_kvtrace_seq_are_numbered_past_the_runs_numbers(tmp_path, collector):
    assert _post(collector.url, [_span(1, 4), _span(2, 5)])[0] == 200
    # two without: from 2^62, past every number a sender may give (re-probe C1: one numbered 6 here
    # made the sender's own 6, sent next, a 400)
    assert _post(collector.url, [_span(3), _span(4, 0), _span(5)])[0] == 200
    assert _post(collector.url, [_span(8, 6), _span(9, 7)])[0] == 200  # the sender's next numbers: free
    assert _post(collector.url, [_span(6)], run_id=None)[0] == 200  # the collector's own run: by arrival
    assert _post(collector.url, [_span(7, 9)], run_id=None)[0] == 200  # (no sender's run: kvtrace.seq not kept)
    collector.stop()
    base = 1 << 62
    assert _seqs(tmp_path / "collected.duckdb", "fix25") == {1: 4, 2: 5, 3: base, 4: 0, 5: base + 1, 8: 6, 9: 7}
    con = duckdb.connect(str(tmp_path / "collected.duckdb"), read_only=True)
    own = con.execute("SELECT span_id, seq FROM spans WHERE run_id <> 'fix25' ORDER BY seq").fetchall()
    con.close()
    assert [(int(s, 16), q) for s, q in own] == [(6, 0), (7, 1)]


def test_a_kvtrace_seq_taken_by_another_span_is_refused_and_one_sent_again_is_not_stored_twice(tmp_path):
    db = tmp_path / "seq.duckdb"
    c = OTLPCollector(db, port=0).start()
    try:
        assert _post(c.url, [_span(1, 0), _span(2, 1)])[0] == 200
        code, message = _post(c.url, [_span(3, 1)])
        assert code == 400
        assert "kvtrace.seq: run fix25 holds another span numbered 1 already" in message
        code, message = _post(c.url, [_span(4, 7), _span(5, 7)])
        assert code == 400 and "spans[1]: kvtrace.seq: 7 is resourceSpans[0].scopeSpans[0].spans[0]'s too" in message
        for bad in ("x", -1, 1 << 62):
            code, message = _post(c.url, [_span(6, bad)])
            assert code == 400 and "kvtrace.seq: expected an integer from 0 to 2^62 - 1" in message, message
    finally:
        c.stop()
    # a restarted collector reads what the run holds: a span sent again (its ids) is a duplicate,
    # another span at a held number is refused
    c = OTLPCollector(db, port=0).start()
    try:
        assert _post(c.url, [_span(2, 1), _span(8, 2)])[0] == 200
        assert c.duplicate_spans == 1 and c.spans_received == 1
        assert _post(c.url, [_span(9, 0)])[0] == 400
    finally:
        c.stop()
    assert _seqs(db, "fix25") == {1: 0, 2: 1, 8: 2}


def test_held_seq_ranges_merge():
    held = _HeldSeqs([(10, 12), (0, 3)])
    held.add([3, 4, 8, 9])
    assert [held.holds(s) for s in range(14)] == [True] * 5 + [False] * 3 + [True] * 4 + [False] * 2
    assert held.end == 12
    held.add_range(5, 8)
    assert held._starts == [0] and held._ends == [12]


def test_a_kvtrace_runs_resource_is_stored_as_its_direct_write_stores_it(tmp_path, collector):
    """Two collections of one replay differed: the SDK's telemetry.sdk.* and a random
    service.instance.id were kept (the direct write and the ClickHouse path drop them)."""
    sdk = [_kv("telemetry.sdk.language", "python"), _kv("service.instance.id", "0f3c"), _kv("service.name", "kv"),
           _kv("deployment", "a")]
    assert _post(collector.url, [_span(1, 0)], resource=sdk)[0] == 200
    assert _post(collector.url, [_span(2)], run_id=None, resource=sdk)[0] == 200  # another producer's: whole
    collector.stop()
    con = duckdb.connect(str(tmp_path / "collected.duckdb"), read_only=True)
    rows = dict(con.execute("SELECT run_id = 'fix25', resource_attributes FROM spans").fetchall())
    services = {r[0] for r in con.execute("SELECT service_name FROM spans").fetchall()}
    con.close()
    assert rows[True] == {"deployment": "a"}
    assert rows[False] == {"telemetry.sdk.language": "python", "service.instance.id": "0f3c", "service.name": "kv",
                           "deployment": "a"}
    assert services == {"kv"}


def _grpc_request(size: int) -> bytes:
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
    from opentelemetry.proto.common.v1 import common_pb2

    req = trace_service_pb2.ExportTraceServiceRequest()
    span = req.resource_spans.add().scope_spans.add().spans.add()
    span.name, span.trace_id, span.span_id = "s", b"\x01" * 16, b"\x02" * 8
    span.start_time_unix_nano, span.end_time_unix_nano = 1, 2
    span.attributes.append(common_pb2.KeyValue(key="k", value=common_pb2.AnyValue(string_value="a" * size)))
    return req.SerializeToString()


def test_requests_grpc_itself_refuses_are_counted_and_logged(tmp_path, caplog):
    """A gzip bomb, a message past the limit and an unknown grpc-encoding are refused by gRPC
    before the handler reads them: they were neither counted nor logged ("0 requests rejected")."""
    import grpc

    from kvtrace.instrument.otlp.grpc import EXPORT_METHOD
    from tests.instrument.raw_h2 import export_with_headers

    c = OTLPCollector(tmp_path / "g.duckdb", port=0, grpc_port=0, max_body_bytes=1 << 20).start()
    codes = []
    try:
        with grpc.insecure_channel(c.grpc_target, options=[("grpc.max_send_message_length", -1)]) as channel:
            call = channel.unary_unary(EXPORT_METHOD, request_serializer=lambda b: b,
                                       response_deserializer=lambda b: b)
            for body, compression in ((_grpc_request(8 << 20), grpc.Compression.Gzip), (_grpc_request(2 << 20), None)):
                with pytest.raises(grpc.RpcError) as err:
                    call(body, timeout=30, compression=compression)
                codes.append(err.value.code())
            export_with_headers(int(c.grpc_target.rsplit(":", 1)[1]), [("grpc-encoding", "br")], b"xx")
            call(_grpc_request(10), timeout=30)  # still served
    finally:
        c.stop()  # (its handlers done: the counts final)
    assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2
    assert c.requests_rejected == 3 and c.spans_received == 1
    refused = [r for r in caplog.records if "refused, nothing stored" in r.getMessage()]
    assert len(refused) == 3
    assert not [r for r in caplog.records if r.levelname == "ERROR"]  # (no handler failed on the way)


_GOOD = {"prefix_cache_hits": 3, "prefix_cache_queries": 4, "prefix_cache_hit_rate": 0.75, "hit_blocks": 1,
         "total_blocks": 2, "block_hit_rate": 0.5, "evictions": 5, "evictions_by_reason": {"lru": 4, "moved": 1},
         "p50_ttft_ms": 2.0, "p90_ttft_ms": 2.5, "p99_ttft_ms": 3.0, "external_prefix_cache_hits": 0,
         "external_prefix_cache_queries": 0, "external_prefix_cache_hit_rate": None}


@pytest.mark.parametrize("change, message", [
    ({"prefix_cache_hits": 5}, "prefix_cache_hits: 5 exceeds prefix_cache_queries 4"),
    ({"prefix_cache_hits": 5, "prefix_cache_hit_rate": None}, "prefix_cache_hits: 5 exceeds prefix_cache_queries 4"),
    ({"prefix_cache_hit_rate": 0.5}, "prefix_cache_hit_rate: 0.5 is not prefix_cache_hits / prefix_cache_queries"),
    ({"block_hit_rate": 0.9}, "block_hit_rate: 0.9 is not hit_blocks / total_blocks = 1 / 2 (0.5)"),
    ({"external_prefix_cache_hit_rate": 0.0}, "external_prefix_cache_hit_rate: 0.0 is not"),
    ({"evictions": 7}, "evictions_by_reason: adds up to 5, not evictions 7"),
    ({"p99_ttft_ms": 1.0}, "p99_ttft_ms: 1.0 is below p90_ttft_ms 2.5"),
    ({"p99.9_ttft_ms": 2.9}, "p99.9_ttft_ms: 2.9 is below p99_ttft_ms 3.0"),
])
def test_a_run_summary_that_disagrees_with_itself_is_refused_naming_the_key(tmp_path, collector, change, message):
    def record(summary: dict, i: int) -> dict:
        return _span(i, name="kvtrace.run", attributes=[_kv("kvtrace.run.summary", json.dumps(summary)),
                                                         _kv("kvtrace.run.status", "complete")])

    code, said = _post(collector.url, [_span(1, 0), record({**_GOOD, **change}, 2)])
    assert code == 400 and f"kvtrace.run.summary: {message}" in said, said
    assert _post(collector.url, [_span(1, 0), record(_GOOD, 2)])[0] == 200  # (the same, consistent: stored)


@pytest.mark.parametrize("key, value, told", [
    ("gen_ai.usage.input_tokens", 1 << 62, str(1 << 62)),
    ("kvtrace.hit_tokens", (1 << 31), str(1 << 31)),
    ("kvtrace.request.prefill_chunks", [0, 1, 1 << 40], str(1 << 40)),
])
def test_token_counts_past_the_documented_maximum_are_refused_naming_the_field(tmp_path, collector, key, value, told):
    """Three request spans of 2^62 input tokens were stored with a 200, then every reader said
    the run was damaged (its token sums overflowed int64)."""
    from kvtrace.store.schema import MAX_SPAN_COUNT

    attr = ({"key": key, "value": {"arrayValue": {"values": [{"intValue": str(v)} for v in value]}}}
            if isinstance(value, list) else _kv(key, value))
    spans = [_span(i + 1, name="kvtrace.request", attributes=[attr, _kv("kvtrace.seq", i)]) for i in range(3)]
    code, message = _post(collector.url, spans)
    assert code == 400, message
    assert f"spans[0]: {key}: {told} is more than a span may count (at most {MAX_SPAN_COUNT:,}" in message
    at_most = [MAX_SPAN_COUNT * (v > 1) for v in value] if isinstance(value, list) else MAX_SPAN_COUNT
    attr = ({"key": key, "value": {"arrayValue": {"values": [{"intValue": str(v)} for v in at_most]}}}
            if isinstance(value, list) else _kv(key, at_most))
    assert _post(collector.url, [_span(9, attributes=[attr])])[0] == 200  # (at the maximum: stored)


def test_a_request_sent_again_within_the_recent_window_reads_nothing_back(tmp_path, collector, monkeypatch):
    """A retried export (a lost 200) is told by the ids remembered: its numbers, all held, are no
    reason to read the store back (it did, once per retry)."""
    import kvtrace.store.read._sql as sql

    assert _post(collector.url, [_span(1, 0), _span(2, 1)])[0] == 200
    reads = []
    real = sql.connect
    monkeypatch.setattr(sql, "connect", lambda *a, **k: reads.append(a) or real(*a, **k))
    assert _post(collector.url, [_span(1, 0), _span(2, 1)])[0] == 200
    assert collector.duplicate_spans == 2 and reads == []


def test_spans_numbered_by_their_caller_are_discarded_without_touching_the_stores_count(tmp_path):
    """A collector's commit that failed discards its buffer: a run it numbered (a restart's run,
    never counted here) has no count of the store's to give back."""
    import pyarrow as pa

    db = tmp_path / "d.duckdb"
    with Store.open(db) as store:
        store.create_run("r", run_id="r")
        store.append_spans(pa.table({"name": ["a"], "span_id": pa.array([1], pa.uint64())}), run_id="r")
    with Store.open(db) as store:
        table = pa.table({"name": ["b", "c"], "span_id": pa.array([2, 3], pa.uint64())})
        assert store.append_spans(table, run_id="r", seq=pa.array([7, 5])) == 2
        assert store.discard_buffer() == 2
        store.append_spans(table, run_id="r", seq=pa.array([7, 5]))
        store.append_spans(table.slice(0, 1), run_id="r")  # numbered on by the store: past its largest
    con = duckdb.connect(str(db), read_only=True)
    got = con.execute("SELECT name, seq FROM spans WHERE run_id = 'r' ORDER BY seq").fetchall()
    con.close()
    assert got == [("a", 0), ("c", 5), ("b", 7), ("b", 8)]


def test_other_counts_and_impossible_gaps_are_refused_naming_the_field(tmp_path, collector):
    """908c9a5 bounded token counts alone: three request spans of 2^62 preemptions were stored
    with a 200, then every reader called the run damaged, and inter-token gaps of 2^62 ns in a
    request of 1 µs made diff's median ITL 4.6e12 ms (re-probe C1)."""
    from kvtrace.store.schema import MAX_SPAN_COUNT

    spans = [_span(i + 1, name="kvtrace.request", attributes=[_kv("kvtrace.request.preemptions", 1 << 62),
                                                              _kv("kvtrace.seq", i)]) for i in range(3)]
    code, message = _post(collector.url, spans)
    assert code == 400 and f"kvtrace.request.preemptions: {1 << 62} is more than a span may count (at most " \
                           f"{MAX_SPAN_COUNT:,}" in message, message
    gaps = {"key": "kvtrace.request.itl_ns", "value": {"arrayValue": {"values": [{"intValue": str(1 << 62)}]}}}
    timed = [_kv("kvtrace.request.first_token_ns", 5_100)]  # (the span ends at 6,007: 907 ns after)
    code, message = _post(collector.url, [_span(7, name="kvtrace.request", attributes=[gaps, *timed,
                                                                                         _kv("kvtrace.seq", 7)])])
    assert code == 400 and "kvtrace.request.itl_ns: its gaps add up to" in message and "= 907 ns" in message, message
    # without a first token: within the span, its start to its end (re-probe D: two gaps of 2^62 were stored)
    code, message = _post(collector.url, [_span(9, name="kvtrace.request", attributes=[gaps, _kv("kvtrace.seq", 9)])])
    assert code == 400 and "kvtrace.request.itl_ns: its gaps add up to" in message and "its start = 1000 ns" in message
    fine = {"key": "kvtrace.request.itl_ns", "value": {"arrayValue": {"values": [{"intValue": "400"},
                                                                                 {"intValue": "500"}]}}}
    assert _post(collector.url, [_span(8, name="kvtrace.request", attributes=[fine, *timed,
                                                                              _kv("kvtrace.seq", 8)])])[0] == 200
