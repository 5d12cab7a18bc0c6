"""OTLP/gRPC into kvtrace's receiver: the SDK's gRPC exporter (vLLM's default protocol) on
loopback, raw gRPC calls for malformed and oversized requests, and ``kvtrace collect``."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys

import grpc
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from kvtrace.instrument.otlp import OTLPCollector
from kvtrace.instrument.otlp.grpc import EXPORT_METHOD
from kvtrace.process import probe_address
from tests.instrument.helpers import count_spans, store_rows


def _send_request_and_child(target: str, resource: dict) -> tuple[str, str, str]:
    """Two spans through the SDK's OTLP/gRPC exporter; returns (trace id, request span id,
    child span id) as OTel hex."""
    provider = TracerProvider(resource=Resource.create(resource))
    # an http:// endpoint is how the gRPC exporter is told to connect without TLS
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"http://{target}")))
    tracer = provider.get_tracer("vllm")
    with tracer.start_as_current_span("llm_request", attributes={
            "gen_ai.usage.input_tokens": 12, "gen_ai.usage.output_tokens": 3, "gen_ai.request.model": "m"}) as req:
        child = tracer.start_span("child")
        child.end()
    provider.shutdown()
    ctx = req.get_span_context()
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}", f"{child.get_span_context().span_id:016x}"


def _raw_export(target: str, body: bytes) -> None:
    with grpc.insecure_channel(target) as channel:
        channel.unary_unary(EXPORT_METHOD)(body, timeout=10)


def test_sdk_grpc_exporter_spans_are_stored_with_typed_columns_and_hex_ids(tmp_path):
    db = tmp_path / "grpc.duckdb"
    collector = OTLPCollector(db, port=0, grpc_port=0).start()
    try:
        trace_id, req_id, child_id = _send_request_and_child(collector.grpc_target, {"service.name": "vllm"})
    finally:
        collector.stop()
    rows = store_rows(db, "r1", "name, trace_id, span_id, parent_span_id, num_prompt_tokens, num_output_tokens, "
                                "extra_attributes, source, service_name, scope_name")
    req = next(r for r in rows if r["name"] == "llm_request")
    child = next(r for r in rows if r["name"] == "child")
    assert (req["trace_id"], req["span_id"], req["parent_span_id"]) == (trace_id, req_id, None)
    assert (child["trace_id"], child["span_id"], child["parent_span_id"]) == (trace_id, child_id, req_id)
    assert (req["num_prompt_tokens"], req["num_output_tokens"]) == (12, 3)
    assert req["extra_attributes"] == {"gen_ai.request.model": "m"}
    assert (req["source"], req["service_name"], req["scope_name"]) == ("otlp", "vllm", "vllm")
    assert collector.spans_received == 2 and collector.requests_rejected == 0


def test_grpc_run_id_resource_files_spans_under_that_run(tmp_path):
    db = tmp_path / "grpc.duckdb"
    collector = OTLPCollector(db, port=0, grpc_port=0).start()
    try:
        _send_request_and_child(collector.grpc_target, {"kvtrace.run.id": "replay-7"})
    finally:
        collector.stop()
    assert count_spans(db, "replay-7") == 2


def test_malformed_grpc_requests_are_invalid_argument_and_lose_nothing(tmp_path):
    db = tmp_path / "grpc.duckdb"
    collector = OTLPCollector(db, port=0, grpc_port=0).start()
    try:
        _send_request_and_child(collector.grpc_target, {"service.name": "vllm"})
        with pytest.raises(grpc.RpcError) as garbage:
            _raw_export(collector.grpc_target, b"\xff\xff\xff not protobuf")
        bad = trace_service_pb2.ExportTraceServiceRequest()
        span = bad.resource_spans.add().scope_spans.add().spans.add()
        span.name, span.trace_id, span.span_id = "x", b"\x01\x02\x03", b"\x00" * 7 + b"\x01"
        with pytest.raises(grpc.RpcError) as short_id:
            _raw_export(collector.grpc_target, bad.SerializeToString())
    finally:
        collector.stop()
    assert garbage.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert short_id.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "spans[0]: traceId must be 16 bytes, got 3" in short_id.value.details()
    assert count_spans(db, "r1") == 2 and collector.requests_rejected == 2


def test_oversized_grpc_request_is_resource_exhausted(tmp_path):
    db = tmp_path / "grpc.duckdb"
    collector = OTLPCollector(db, port=0, grpc_port=0, max_body_bytes=4096).start()
    try:
        big = trace_service_pb2.ExportTraceServiceRequest()
        span = big.resource_spans.add().scope_spans.add().spans.add()
        span.name, span.trace_id, span.span_id = "x" * 8192, b"\x01" * 16, b"\x02" * 8
        with pytest.raises(grpc.RpcError) as err:
            _raw_export(collector.grpc_target, big.SerializeToString())
    finally:
        collector.stop()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert collector.spans_received == 0


def _collect(*args: str) -> subprocess.Popen:
    env = dict(os.environ, COLUMNS="200")
    return subprocess.Popen([sys.executable, "-m", "kvtrace.cli", "collect", *args], env=env,
                            stderr=subprocess.PIPE, text=True)


def test_kvtrace_collect_serves_grpc_and_http_until_ctrl_c(tmp_path):
    db = tmp_path / "cli.duckdb"
    proc = _collect("--db", str(db), "--port", "0", "--grpc-port", "0")
    try:
        ready = proc.stderr.readline()
        m = re.search(r"OTLP/HTTP on http://127\.0\.0\.1:(\d+)/v1/traces, OTLP/gRPC on (127\.0\.0\.1:\d+)", ready)
        assert m, ready
        _send_request_and_child(m.group(2), {"service.name": "vllm"})
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "2 spans stored, 0 requests rejected" in err
    assert count_spans(db, "r1") == 2
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    assert con.execute("SELECT status, mode FROM runs WHERE run_id = 'r1'").fetchone() == ("complete", "otlp")
    con.close()


@pytest.mark.parametrize("which", ["--port", "--grpc-port"])
def test_kvtrace_collect_on_a_busy_port_is_one_line(tmp_path, which):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        other = "--grpc-port" if which == "--port" else "--port"
        proc = _collect("--db", str(tmp_path / "busy.duckdb"), which, str(port), other, "0")
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvtrace: error: cannot listen on 127.0.0.1:{port}"), err
    assert ("OTLP/HTTP" if which == "--port" else "OTLP/gRPC") in lines[0]
    assert lines[0].endswith(f"; choose another with {which} N, or {which} 0 for a free one"), err
    assert list(tmp_path.iterdir()) == []  # no new, empty store left behind (it was made before the ports)


@pytest.mark.parametrize("chdb", [False, True])
def test_a_collector_whose_store_cannot_open_frees_its_ports(tmp_path, chdb):
    """The ports are bound first, so a bad --db must give them back: a second try on the same
    ports, with a good store, serves."""
    from kvtrace.errors import KVTraceError

    with socket.socket() as s1, socket.socket() as s2:
        s1.bind(("127.0.0.1", 0))
        s2.bind(("127.0.0.1", 0))
        port, grpc_port = s1.getsockname()[1], s2.getsockname()[1]
    (tmp_path / "file").write_text("x")
    bad = f"chdb:{tmp_path / 'file'}" if chdb else tmp_path / "missing" / "x.duckdb"
    with pytest.raises(KVTraceError, match="is a file, not a directory" if chdb else "missing does not exist"):
        OTLPCollector(bad, port=port, grpc_port=grpc_port)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    collector = OTLPCollector(tmp_path / "good.duckdb", port=port, grpc_port=grpc_port).start()
    try:
        _send_request_and_child(collector.grpc_target, {"service.name": "vllm"})
    finally:
        collector.stop()
    assert collector.address[1] == port and count_spans(tmp_path / "good.duckdb", "r1") == 2


def test_probe_finds_a_busy_port_before_grpc_does():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError, match=re.escape(f"cannot listen on 127.0.0.1:{port} (OTLP/gRPC)")):
            probe_address("127.0.0.1", port, "OTLP/gRPC")
    probe_address("127.0.0.1", port, "OTLP/gRPC")  # free again
    probe_address("127.0.0.1", 0, "OTLP/gRPC")  # any free port


def test_grpc_values_the_store_cannot_hold_are_invalid_argument_naming_the_field(tmp_path, capfd):
    """A legal fixed64 time of 2^64 - 1 and a NaN in a DOUBLE column: INVALID_ARGUMENT naming
    the field, nothing stored, no traceback in the server's log, and the next export lands."""
    db = tmp_path / "grpc.duckdb"
    collector = OTLPCollector(db, port=0, grpc_port=0).start()
    errors = []
    try:
        for start, attr in ((2**64 - 1, None), (5, ("kvtrace.request.itl_p99_ns", float("nan")))):
            req = trace_service_pb2.ExportTraceServiceRequest()
            span = req.resource_spans.add().scope_spans.add().spans.add()
            span.name, span.trace_id, span.span_id = "x", b"\x01" * 16, b"\x02" * 8
            span.start_time_unix_nano, span.end_time_unix_nano = start, 9
            if attr:
                kv = span.attributes.add()
                kv.key, kv.value.double_value = attr
            with pytest.raises(grpc.RpcError) as err:
                _raw_export(collector.grpc_target, req.SerializeToString())
            errors.append(err.value)
        _send_request_and_child(collector.grpc_target, {"service.name": "vllm"})
    finally:
        collector.stop()
    assert [e.code() for e in errors] == [grpc.StatusCode.INVALID_ARGUMENT] * 2
    assert "spans[0].startTimeUnixNano: 18446744073709551615" in errors[0].details()
    assert "spans[0]: kvtrace.request.itl_p99_ns: NaN" in errors[1].details()
    assert count_spans(db, "r1") == 2 and collector.requests_rejected == 2
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])  # (`kill`; the terminal closed)
def test_kvtrace_collect_stopped_by_sigterm_summarises_and_finishes_its_run(tmp_path, sig):
    db = tmp_path / "term.duckdb"
    proc = _collect("--db", str(db), "--port", "0", "--grpc-port", "0")
    try:
        ready = proc.stderr.readline()
        m = re.search(r"OTLP/gRPC on (127\.0\.0\.1:\d+)", ready)
        assert m, ready
        _send_request_and_child(m.group(1), {"service.name": "vllm"})
    finally:
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "2 spans stored, 0 requests rejected" in err and "Traceback" not in err
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    assert con.execute("SELECT status FROM runs WHERE run_id = 'r1'").fetchone() == ("complete",)
    con.close()


def _many_spans(n: int) -> bytes:
    req = trace_service_pb2.ExportTraceServiceRequest()
    spans = req.resource_spans.add().scope_spans.add().spans
    for i in range(n):
        span = spans.add()
        span.name, span.trace_id, span.span_id = "s", b"\x01" * 16, (i + 1).to_bytes(8, "big")
        span.start_time_unix_nano, span.end_time_unix_nano = i, i + 1
    return req.SerializeToString()


def test_an_export_past_its_deadline_is_not_stored(tmp_path):
    """The exporter sends it again after DEADLINE_EXCEEDED: storing it too made duplicates.
    (50,000 spans take far longer than 10 ms to decode here.)"""
    db = tmp_path / "grpc.duckdb"
    collector = OTLPCollector(db, port=0, grpc_port=0).start()
    try:
        with grpc.insecure_channel(collector.grpc_target) as channel, pytest.raises(grpc.RpcError) as err:
            channel.unary_unary(EXPORT_METHOD)(_many_spans(50_000), timeout=0.01)
        _send_request_and_child(collector.grpc_target, {"service.name": "vllm"})  # the next one is stored
    finally:
        collector.stop()
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert count_spans(db, "r1") == 2 and collector.spans_received == 2


def test_a_request_after_the_store_closed_is_refused_not_stored(tmp_path):
    """A handler still decoding when shutdown closed the store (SIGTERM with exports in
    flight) used to reopen the file, create a run and leave it `running`."""
    from kvtrace.errors import KVTraceError
    from kvtrace.instrument.otlp.decode import decode_protobuf
    from kvtrace.store import read

    db = tmp_path / "grpc.duckdb"
    collector = OTLPCollector(db, port=0, grpc_port=0).start()
    _send_request_and_child(collector.grpc_target, {"service.name": "vllm"})
    collector.stop()
    with pytest.raises(KVTraceError, match="shutting down: not stored"):
        collector.ingest(decode_protobuf(_many_spans(3)))
    runs = read.runs(str(db))
    assert runs["status"].to_list() == ["complete"] and count_spans(db, "r1") == 2
    assert collector.spans_received == 2


def test_malformed_grpc_metadata_does_not_flood_the_collectors_stderr(tmp_path):
    """gRPC's C core wrote one line per request with a bad grpc-encoding (any peer can send
    one), so a hostile client could fill the log; the collector's stderr is its own lines: one
    short line per refused call (counted as HTTP's refusals are), none echoing the header."""
    from tests.instrument.raw_h2 import export_with_headers

    proc = _collect("--db", str(tmp_path / "flood.duckdb"), "--port", "0", "--grpc-port", "0")
    try:
        ready = proc.stderr.readline()
        port = int(re.search(r"OTLP/gRPC on 127\.0\.0\.1:(\d+)", ready).group(1))
        for i in range(3):
            export_with_headers(port, [("grpc-encoding", "x" * 1000 + str(i))])
        _send_request_and_child(f"127.0.0.1:{port}", {"service.name": "vllm"})  # still serving
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    lines = err.strip().splitlines()
    assert lines[-1] == "kvtrace collect: 2 spans stored, 3 requests rejected", err
    assert len(lines) == 4 and all("refused, nothing stored" in line and len(line) < 300 for line in lines[:3]), err


def _run_body(run_id: str, n: int = 2) -> bytes:
    req = trace_service_pb2.ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    attr = rs.resource.attributes.add()
    attr.key, attr.value.string_value = "kvtrace.run.id", run_id
    spans = rs.scope_spans.add().spans
    for i in range(n):
        span = spans.add()
        span.name, span.trace_id, span.span_id = "s", b"\x01" * 16, (i + 1).to_bytes(8, "big")
        span.start_time_unix_nano, span.end_time_unix_nano = i, i + 1
    return req.SerializeToString()


class _Stalled:
    """Calls that open an export and send no request until ``release`` (a client-streaming
    call whose iterator blocks): what gRPC's unary handling waited for on a worker thread."""

    def __init__(self, target: str, n: int):
        import threading

        self._go = threading.Event()
        self.channels = [grpc.insecure_channel(target) for _ in range(n)]
        self.calls = [ch.stream_unary(EXPORT_METHOD).future(self._requests()) for ch in self.channels]

    def _requests(self):
        self._go.wait(30)
        yield from ()

    def release(self) -> None:
        self._go.set()
        for call in self.calls:
            with contextlib.suppress(grpc.RpcError, grpc.FutureTimeoutError):
                call.result(timeout=30)
        for channel in self.channels:
            channel.close()


def test_callers_that_never_send_their_request_do_not_hold_the_receiver(tmp_path):
    """Four calls opened and never sent held gRPC's four workers (its unary handling waits
    for the message with no limit): every other exporter's export timed out behind them."""
    db = tmp_path / "grpc.duckdb"
    collector = OTLPCollector(db, port=0, grpc_port=0).start()
    stalled = _Stalled(collector.grpc_target, 8)
    try:
        _raw_export(collector.grpc_target, _run_body("served"))  # (timeout 10 s: it waited for good)
    finally:
        stalled.release()
        collector.stop()
    assert count_spans(db, "served") == 2


def test_a_call_whose_request_never_comes_is_cancelled_at_its_read_deadline(tmp_path, caplog):
    db = tmp_path / "grpc.duckdb"
    collector = OTLPCollector(db, port=0, grpc_port=0, max_body_bytes=4096, read_timeout_s=1.0).start()
    stalled = _Stalled(collector.grpc_target, 1)
    try:
        with pytest.raises(grpc.RpcError) as err:
            stalled.calls[0].result(timeout=20)
        _raw_export(collector.grpc_target, _run_body("after"))
    finally:
        stalled.release()
        collector.stop()
    assert err.value.code() == grpc.StatusCode.CANCELLED
    assert collector.requests_rejected == 1 and count_spans(db, "after") == 2
    assert "dropped: its request did not come within" in caplog.text


def test_two_requests_in_one_export_call_are_refused_whole(tmp_path):
    """A client streaming two requests to the unary Export got OK, and the second was
    dropped unstored."""
    db = tmp_path / "grpc.duckdb"
    collector = OTLPCollector(db, port=0, grpc_port=0).start()
    try:
        with grpc.insecure_channel(collector.grpc_target) as channel, pytest.raises(grpc.RpcError) as err:
            channel.stream_unary(EXPORT_METHOD)(iter([_run_body("first"), _run_body("second")]), timeout=10)
        with grpc.insecure_channel(collector.grpc_target) as channel, pytest.raises(grpc.RpcError) as none:
            channel.stream_unary(EXPORT_METHOD)(iter([]), timeout=10)
        _raw_export(collector.grpc_target, _run_body("after"))
    finally:
        collector.stop()
    assert err.value.code() == none.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "more than one ExportTraceServiceRequest" in err.value.details()
    assert "no ExportTraceServiceRequest" in none.value.details()
    assert count_spans(db, "first") == count_spans(db, "second") == 0 and count_spans(db, "after") == 2
    assert collector.requests_rejected == 2


def test_a_stopped_collector_leaves_no_grpc_worker_or_watchdog_thread(tmp_path):
    """gRPC's ``stop`` leaves its worker pool's threads alive: each collector stopped in a
    long-lived process left up to 64 of them behind (one per call it had served at once)."""
    import threading

    db = tmp_path / "grpc.duckdb"
    collector = OTLPCollector(db, port=0, grpc_port=0).start()
    stalled = _Stalled(collector.grpc_target, 6)  # six calls at once: six workers
    try:
        _raw_export(collector.grpc_target, _run_body("served"))
    finally:
        stalled.release()
        collector.stop()
    ours = [t.name for t in threading.enumerate()
            if t.is_alive() and t.name.startswith(("kvtrace-otlp-grpc", "kvtrace-otlp-deadlines"))]
    assert ours == []
    assert count_spans(db, "served") == 2


def test_closing_the_deadline_watchdog_ends_its_thread():
    """``close`` only flagged the watchdog to stop: a stopped collector's thread lived on."""
    import threading

    from kvtrace.instrument.otlp.guard import Deadlines

    deadlines = Deadlines(watch_interval_s=30.0, name="kvtrace-test-deadlines")
    deadlines.set("key", 60.0, lambda: None)
    watchdog = next(t for t in threading.enumerate() if t.name == "kvtrace-test-deadlines")
    deadlines.close()
    assert not watchdog.is_alive()
