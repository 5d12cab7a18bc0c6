"""Live capture and collect, found by probing (round 21): each test names what it broke."""

from __future__ import annotations

import threading

import msgspec
import pytest


def _batch(i: int) -> bytes:
    return msgspec.msgpack.encode([float(i + 1), [["BlockStored", [i + 1], None, [i] * 4, 4, None, "GPU"]], 0])


def test_a_replay_endpoint_that_never_answers_cannot_hang_the_capture_after_1000_gaps(tmp_path):
    """A --replay-endpoint nobody listens at (a typo) queued one unsent request per gap on
    the DEALER; the 1,001st gap's send blocked for good (ZMQ's default high-water mark),
    deaf to Ctrl-C, where each gap should be counted lost after the replay timeout."""
    from kvtrace.instrument.vllm.capture import VllmKVCapture

    cap = VllmKVCapture(f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay-nobody", replay_timeout_s=0.001)
    seqs = list(range(0, 2 * 1_100 + 1, 2))  # a gap before every message but the first
    done = threading.Event()

    def feed() -> None:
        for seq in seqs:
            cap.receive([b"kv", seq.to_bytes(8, "big"), _batch(seq)])
        done.set()

    t = threading.Thread(target=feed, daemon=True)  # (a hung send cannot be joined)
    t.start()
    assert done.wait(60), f"the capture hung after {cap.stats.gaps} gaps"
    cap.close()
    s = cap.stats
    assert (s.batches, s.gaps, s.lost, s.recovered) == (len(seqs), len(seqs) - 1, len(seqs) - 1, 0)


def test_batches_a_connected_capture_never_saw_are_asked_of_the_replay_socket_at_the_stop(tmp_path):
    """A burst published while the subscription was not yet live (ZMQ's slow joiner: PUB
    drops it) and nothing after: the capture stored nothing, and said the server published
    no KV events, though the replay socket held every batch."""
    from kvtrace.instrument.vllm import capture_vllm
    from tests.instrument.helpers import count_spans
    from tests.instrument.vllm_publisher import LEGACY, VllmPublisher

    EventBatch, BlockStored, _, _ = LEGACY
    pub = VllmPublisher()
    try:
        for k in range(5):  # published, never delivered: the capture has not joined
            pub.publish(EventBatch(1_700_000_000.0 + k, [BlockStored([k + 1], k or None, [k] * 4, 4, None, "GPU",
                                                                     None)], 0), send=False)
        caps = []
        stats = capture_vllm(pub.endpoint, pub.replay_endpoint, store_path=tmp_path / "s.duckdb", topic="kv-events",
                             on_ready=caps.append, should_stop=lambda: caps[0].stats.connected == 1)
    finally:
        pub.close()
    assert (stats.batches, stats.recovered, stats.lost, stats.nothing_received) == (5, 5, 0, False)
    assert count_spans(tmp_path / "s.duckdb", stats.run_id) == 10  # a step and a publish each


def _post_json(url: str, doc: dict) -> int:
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, json.dumps(doc).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as reply:
            return reply.status
    except urllib.error.HTTPError as err:
        return err.code


def _spans_doc(spans: list[dict]) -> dict:
    return {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "app"}}]},
                               "scopeSpans": [{"spans": spans}]}]}


def _span(i: int, name: str = "work", attributes: list | None = None) -> dict:
    return {"traceId": f"{i:032x}", "spanId": f"{i:016x}", "name": name, "startTimeUnixNano": "1",
            "endTimeUnixNano": "2", "attributes": attributes or []}


def test_a_run_record_naming_no_run_cannot_finish_the_collectors_own_run(tmp_path):
    """A ``kvtrace.run`` record whose resource names no run id finished the collector's own
    run (every sender's spans that name none) as ``failed``, with the sender's digest and a
    summary of 5 requests, with a 200; one naming that run by its id was already refused."""
    from kvtrace.instrument.otlp.collector import OTLPCollector
    from kvtrace.store.read import run
    from tests.instrument.helpers import count_spans

    collector = OTLPCollector(tmp_path / "c.duckdb", port=0).start()
    try:
        assert _post_json(collector.url, _spans_doc([_span(1), _span(2)])) == 200
        record = [{"key": "kvtrace.run.status", "value": {"stringValue": "failed"}},
                  {"key": "kvtrace.run.digest", "value": {"stringValue": "d" * 64}},
                  {"key": "kvtrace.run.summary", "value": {"stringValue": '{"requests": 5}'}}]
        assert _post_json(collector.url, _spans_doc([_span(3), _span(4, "kvtrace.run", record)])) == 400
        assert _post_json(collector.url, _spans_doc([_span(5)])) == 200
        own = collector._default_run
    finally:
        collector.stop()
    got = run(tmp_path / "c.duckdb", own)
    assert (got["status"], got["digest"], got["summary"]) == ("complete", None, None)
    assert count_spans(tmp_path / "c.duckdb", own) == 3  # (the refused request stored nothing)


def test_a_capture_forced_to_stop_mid_answer_keeps_its_counts_in_the_failed_run(tmp_path):
    """A second Ctrl-C (here: raised from the batch callback) while the replay socket answered
    first contact: the run was marked failed with ``{"error": "KeyboardInterrupt: "}`` alone,
    every count gone though the batches' spans were stored, and the batches stored from the
    answer were not counted recovered."""
    import time

    from kvtrace.instrument.vllm import capture_vllm
    from kvtrace.store.read import run
    from tests.instrument.helpers import count_spans
    from tests.instrument.vllm_publisher import LEGACY, VllmPublisher

    EventBatch, BlockStored, _, _ = LEGACY

    def batch(k: int):
        return EventBatch(1_700_000_000.0 + k, [BlockStored([k + 1], k or None, [k] * 4, 4, None, "GPU", None)], 0)

    def on_batch(seq: int, _batch) -> None:
        if seq == 2:  # the third batch of the first contact's answer
            raise KeyboardInterrupt

    def on_ready(cap) -> None:
        cap.on_batch = on_batch

    pub = VllmPublisher()
    result: dict = {}

    def capture() -> None:
        try:
            capture_vllm(pub.endpoint, pub.replay_endpoint, store_path=tmp_path / "s.duckdb", topic="kv-events",
                         on_ready=on_ready)
        except KeyboardInterrupt as err:
            result["raised"] = err

    try:
        for k in range(5):  # sent before the capture joined: its first contact asks for them
            pub.publish(batch(k), send=False)
        fifth = pub.publish(batch(5))
        t = threading.Thread(target=capture)
        t.start()
        deadline = time.monotonic() + 30
        while t.is_alive() and time.monotonic() < deadline:
            pub.resend(fifth)  # (until the subscription is live)
            t.join(0.05)
        assert not t.is_alive(), "the capture never stopped"
    finally:
        pub.close()
    assert isinstance(result.get("raised"), KeyboardInterrupt)
    got = run(tmp_path / "s.duckdb", "r1")
    assert got["status"] == "failed" and got["summary"]["error"] == "KeyboardInterrupt: "
    s = got["summary"]
    # seqs 0-2 stored (a step and a publish each); 0 and 1 counted recovered, 2 stopped inside its own accept
    assert (s["batches"], s["recovered"], s["spans"]) == (3, 2, count_spans(tmp_path / "s.duckdb", "r1")) == (3, 2, 6)


def test_collect_refuses_a_blank_host_before_listening_anywhere(tmp_path):
    """``--host ''`` (an unset ``$HOST``) bound the OTLP/HTTP server on every interface
    (0.0.0.0) with --no-grpc, and with gRPC failed saying the address was in use."""
    import subprocess
    import sys

    from kvtrace.errors import ConfigError
    from kvtrace.instrument.otlp.collector import OTLPCollector

    db = tmp_path / "c.duckdb"
    for host in ("", "  "):
        done = subprocess.run([sys.executable, "-m", "kvtrace.cli", "collect", "--db", str(db), "--host", host,
                               "--port", "0", "--no-grpc"], capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 2 and done.stderr.splitlines() == [
            f"kvtrace: error: --host: {host!r}: expected an address to listen on (0.0.0.0: every interface)"]
    assert not db.exists()
    try:
        OTLPCollector(db, host="", port=0).stop()
    except ConfigError as err:
        assert "--host" in str(err)
    else:
        raise AssertionError("OTLPCollector(host='') served")


def test_capture_refuses_endpoints_no_vllm_server_can_be_reached_at(tmp_path):
    """``inproc://`` (sockets of this process only) recorded a run of nothing and exit 1; vLLM's
    own bind address ``tcp://*:5557``, copied, was ZMQ's bare "Invalid argument"."""
    import subprocess
    import sys

    db = tmp_path / "c.duckdb"
    for args, flag, why in (
            (["--endpoint", "inproc://kv"], "--endpoint", "inproc:// reaches sockets of this process only"),
            (["--endpoint", "tcp://127.0.0.1:5557", "--replay-endpoint", "inproc://r"], "--replay-endpoint",
             "inproc:// reaches sockets of this process only"),
            (["--endpoint", "tcp://*:5557"], "--endpoint", "'*' is where vLLM binds (every interface); connect to "
                                                           "the server's address, e.g. tcp://127.0.0.1:5557"),
    ):
        done = subprocess.run([sys.executable, "-m", "kvtrace.cli", "capture", "vllm", "--db", str(db), *args,
                               "--duration", "0"], capture_output=True, text=True, timeout=60, check=False)
        lines = done.stderr.splitlines()
        assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"kvtrace: error: {flag}: "), lines
        assert why in lines[0]
    assert not db.exists()


def test_a_dp_rank_never_reached_is_told(tmp_path, caplog):
    """``--dp-size 2`` against a server of one rank: the closing line said "5 batches" and
    nothing of rank 1, whose SUB socket never reached a publisher (only the run's summary
    held its ``connected: 0``)."""
    import logging
    import time

    import zmq

    from kvtrace.instrument.vllm import capture_vllm

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1", min_port=20_000, max_port=60_000)  # rank 0 only
    got = threading.Event()

    def on_ready(cap) -> None:
        if cap.endpoint == f"tcp://127.0.0.1:{port}":
            cap.on_batch = lambda seq, batch: got.set()

    def publish() -> None:
        deadline = time.monotonic() + 30
        while not got.is_set() and time.monotonic() < deadline:  # (until the subscription is live)
            pub.send_multipart([b"", (0).to_bytes(8, "big"), _batch(0)])
            got.wait(0.05)

    sender = threading.Thread(target=publish)
    sender.start()
    try:
        with caplog.at_level(logging.WARNING, logger="kvtrace.instrument.vllm.capture"):
            stats = capture_vllm(f"tcp://127.0.0.1:{port}", store_path=tmp_path / "s.duckdb", dp_size=2,
                                 on_ready=on_ready, should_stop=got.is_set)
    finally:
        sender.join()
        pub.close(0)
        ctx.term()
    assert stats.batches >= 1 and stats.connected == 1
    told = [r.getMessage() for r in caplog.records if "DP ranks never reached" in r.getMessage()]
    assert told == [f"kvtrace capture vllm: 1 of 2 DP ranks never reached, nothing received from them "
                    f"(tcp://127.0.0.1:{port + 1}): is --dp-size 2 the server's --data-parallel-size, and is every "
                    f"rank up?"]


def test_a_run_id_that_is_no_text_or_empty_is_not_filed_in_the_collectors_own_run(tmp_path):
    """``kvtrace.run.id`` as an intValue, or "", went to the collector's own run with a 200,
    where the README says a run id must be 1-128 printable characters. An empty one is refused;
    one of another type names the run the ClickHouse exporter's text of it names there (7 is
    run "7", True run "true": the twenty-ninth session, as the exporter path reads it)."""
    import json

    from kvtrace.instrument.otlp.collector import OTLPCollector
    from kvtrace.store import read

    db = tmp_path / "c.duckdb"
    collector = OTLPCollector(db, port=0).start()
    try:
        for i, (value, status) in enumerate((({"intValue": 7}, 200), ({"stringValue": ""}, 400),
                                             ({"boolValue": True}, 200))):
            doc = _spans_doc([_span(i + 1)])
            doc["resourceSpans"][0]["resource"]["attributes"].append({"key": "kvtrace.run.id", "value": value})
            assert _post_json(collector.url, doc) == status, json.dumps(value)
        assert collector.spans_received == 2 and collector._default_run is None
    finally:
        collector.stop()
    assert sorted(read.runs(db)["run_id"].to_list()) == ["7", "true"]


def test_a_stop_whose_failed_record_cannot_be_written_is_still_the_stop(tmp_path, monkeypatch):
    """The stopped capture's own failure record (its counts beside the error) failed in a
    store that failed too: that store error replaced the stop the user had made."""
    from kvtrace.instrument.vllm import capture as capture_module
    from kvtrace.store.errors import StoreError
    from kvtrace.store.read import run
    from kvtrace.store.writer import Store

    def stopped(*_args, **_kw):
        raise KeyboardInterrupt

    finish = Store.finish_run

    def failing_finish(self, run_id, status=None, **kw):
        if "error" in (kw.get("summary") or {}) and "batches" in (kw.get("summary") or {}):
            raise StoreError(str(tmp_path / "s.duckdb"), "disk full")
        return finish(self, run_id, status=status, **kw)

    monkeypatch.setattr(capture_module, "run_captures", stopped)
    monkeypatch.setattr(Store, "finish_run", failing_finish)
    with pytest.raises(KeyboardInterrupt):
        capture_module.capture_vllm("tcp://127.0.0.1:9", store_path=tmp_path / "s.duckdb", duration=1)
    assert run(tmp_path / "s.duckdb", "r1")["status"] in ("failed", "incomplete")
