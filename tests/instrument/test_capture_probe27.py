"""The twenty-seventh session's probe of ``kvtrace capture vllm``: what a capture counts and
stores, checked against what the publisher sent (vLLM 0.33's own ``ZmqEventPublisher``, or the
tests' wire-exact one where a test must drop or re-send a message).
"""

from __future__ import annotations

import threading
import time
import warnings

import msgspec

from kvtrace.instrument.vllm import VllmKVCapture
from kvtrace.store.writer import Store
from tests.instrument.helpers import store_rows
from tests.instrument.vllm_publisher import LEGACY, VllmPublisher

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # requests' charset warning on import
    from vllm.distributed.kv_events import BlockStored, ZmqEventPublisher
    from vllm.distributed.kv_events import KVEventBatch as VllmBatch

T0 = 1_700_000_000.0


class _Capturing:
    """A VllmKVCapture into a store run, polled on a thread until ``stop``."""

    def __init__(self, tmp_path, endpoint: str, replay_endpoint: str | None, topic: str = ""):
        self.db = tmp_path / "probe27.duckdb"
        self.store = Store.open(self.db)
        self.run_id = self.store.create_run("probe27", mode="live")
        self.cap = VllmKVCapture(endpoint, replay_endpoint, store=self.store, run_id=self.run_id, topic=topic,
                                 replay_timeout_s=1.0)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.cap.run, kwargs={"should_stop": self.done.is_set})
        self.thread.start()

    def wait(self, until, what: str) -> None:
        deadline = time.monotonic() + 30
        while not until(self.cap.stats):
            assert time.monotonic() < deadline, f"{what}: {self.cap.stats}"
            time.sleep(0.02)

    def stop(self) -> list[dict]:
        self.done.set()
        self.thread.join(60)
        self.cap.close()
        self.store.finish_run(self.run_id)
        self.store.close()
        return store_rows(self.db, self.run_id, "name, step, block_hashes")


def _published_steps(rows: list[dict]) -> list[tuple[int, int]]:
    """(step, the block hash it stored) of every publish, in step order."""
    return sorted((r["step"], int(r["block_hashes"][0], 16)) for r in rows if r["name"] == "kvtrace.cache.publish")


def _vllm_batch(life: int, k: int) -> VllmBatch:
    """Batch ``k`` of a publisher lifetime: it stores block ``life * 1000 + k + 1``."""
    return VllmBatch(ts=T0 + life * 100 + k, events=[BlockStored(
        block_hashes=[life * 1000 + k + 1], parent_block_hash=life * 1000 + k if k else None, token_ids=[1] * 16,
        block_size=16, lora_id=None, medium="GPU", lora_name=None)])


def test_a_server_restarted_after_one_batch_keeps_its_new_lifetimes_first_batch(tmp_path):
    """vLLM published one batch (seq 0), restarted, and published seq 0..4 again: the capture
    took the new seq 0 (the last seq it had accepted, other contents) for a stray message since
    seq 1 followed it, so the new lifetime's first batch was a bad message, never stored, and
    the restart went uncounted."""
    pub_ep, replay_ep = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    pub = ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=replay_ep, topic="")
    run = _Capturing(tmp_path, pub_ep, replay_ep)
    try:
        run.wait(lambda s: s.connected, "the connect")
        time.sleep(0.5)  # (PUB has no word of a subscription: one that is not live yet drops the batch)
        pub.publish(_vllm_batch(0, 0))  # the old lifetime's one batch, seq 0
        run.wait(lambda s: s.batches, "the first batch")
        pub.shutdown()
        # the restart: the same endpoints, seq from 0 again; the SUB socket reconnects first
        pub = ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=replay_ep, topic="")
        run.wait(lambda s: s.connected and run.cap._linked, "the reconnect")
        time.sleep(0.5)  # (the subscription passes the reconnect before the publisher sends)
        for k in range(5):
            pub.publish(_vllm_batch(1, k))
        run.wait(lambda s: s.batches + s.bad_messages >= 6, "the new lifetime")
    finally:
        rows = run.stop()
        pub.shutdown()
    stats = run.cap.stats
    assert (stats.batches, stats.restarts, stats.bad_messages, stats.lost) == (6, 1, 0, 0)
    assert _published_steps(rows) == [(0, 1), *((1 + k, 1000 + k + 1) for k in range(5))]


def _raw(ts: float, block: int) -> bytes:
    EventBatch, Stored, _, _ = LEGACY
    return msgspec.msgpack.encode(EventBatch(ts, [Stored([block], None, [0] * 4, 4, None, "GPU", None)], 0))


def _first_batch_received(pub: VllmPublisher, run: _Capturing) -> None:
    """seq 0 (block 1), re-sent until the subscription is live."""
    seq = pub.publish_raw(_raw(T0, 1))
    deadline = time.monotonic() + 30
    while run.cap.stats.batches == 0:
        assert time.monotonic() < deadline, "the subscriber never connected"
        pub.resend(seq)
        time.sleep(0.05)


def test_a_restart_at_the_last_seq_no_reconnect_showed_is_told_by_the_replay_socket(tmp_path):
    """A publisher whose new lifetime the SUB socket met without a reconnect it saw (its new
    seq 0 after the old seq 0, then seq 1): the replay socket holds the new seq 0, so it is a
    restart, its batches all stored."""
    pub = VllmPublisher(topic="kv")
    run = _Capturing(tmp_path, pub.endpoint, pub.replay_endpoint, topic="kv")
    try:
        _first_batch_received(pub, run)
        pub.seq = 0  # the restart, on the same sockets
        with pub._lock:
            pub.buffer.clear()
        for k in range(3):
            pub.publish_raw(_raw(T0 + 100 + k, 1000 + k))
        run.wait(lambda s: s.batches + s.bad_messages >= 4, "the new lifetime")
    finally:
        rows = run.stop()
        pub.close()
    stats = run.cap.stats
    assert (stats.batches, stats.restarts, stats.bad_messages, stats.lost) == (4, 1, 0, 0)
    assert _published_steps(rows) == [(0, 1), (1, 1000), (2, 1001), (3, 1002)]


def test_a_stray_message_at_the_last_seq_is_still_a_stray(tmp_path):
    """Another payload at the last seq accepted, then the old sequence going on, the
    publisher's replay buffer unchanged: one bad message, no restart, nothing lost."""
    pub = VllmPublisher(topic="kv")
    run = _Capturing(tmp_path, pub.endpoint, pub.replay_endpoint, topic="kv")
    try:
        _first_batch_received(pub, run)
        pub.pub.send_multipart((pub.topic, (0).to_bytes(8, "big"), _raw(T0 + 50, 999)))  # (a stray seq 0)
        for k in range(1, 4):
            pub.publish_raw(_raw(T0 + k, 1 + k))
        run.wait(lambda s: s.batches + s.bad_messages >= 5, "the old sequence")
    finally:
        rows = run.stop()
        pub.close()
    stats = run.cap.stats
    assert (stats.batches, stats.restarts, stats.bad_messages, stats.lost) == (4, 0, 1, 0)
    assert _published_steps(rows) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_a_stop_while_first_contact_is_answered_ends_the_answer_within_the_drain(tmp_path, monkeypatch):
    """First contact with a vLLM that had published 3,000 batches: its replay answer is read a
    batch at a time, and a stop that came meanwhile waited for all of it (vLLM's buffer of
    10,000 batches held Ctrl-C, or --duration 2, for 35 s). Now the answer gets the drain's
    time after the stop, and what it has not brought is counted missed before contact."""
    from kvtrace.instrument.vllm import capture as capture_module
    from kvtrace.instrument.vllm import capture_vllm

    monkeypatch.setattr(capture_module, "DRAIN_S", 0.2)
    pub_ep, replay_ep = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    pub = ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=replay_ep, topic="")
    earlier = 3_000
    for k in range(earlier):  # (nobody subscribed: PUB drops them, the replay buffer keeps them)
        pub.publish(_vllm_batch(0, k))
    accepted: list[int] = []
    done, caps, result = threading.Event(), [], {}

    def on_batch(seq, _batch) -> None:
        accepted.append(seq)
        if len(accepted) >= 50:  # (well into the answer: the stop)
            done.set()

    def on_ready(cap) -> None:
        cap.on_batch = on_batch
        caps.append(cap)

    def capture() -> None:
        result["stats"] = capture_vllm(pub_ep, replay_ep, store_path=tmp_path / "stop.duckdb",
                                       should_stop=done.is_set, on_ready=on_ready)

    thread = threading.Thread(target=capture)
    thread.start()
    try:
        k = earlier
        deadline = time.monotonic() + 60
        while not done.is_set():  # live batches until one reaches the capture (first contact)
            assert time.monotonic() < deadline, caps[0].stats if caps else "no capture"
            pub.publish(_vllm_batch(0, k))
            k += 1
            done.wait(0.05)
        thread.join(60)
        assert not thread.is_alive()
    finally:
        done.set()
        thread.join(60)
        pub.shutdown()
    stats = result["stats"]
    contact = next(seq for seq in accepted if seq >= earlier)  # the live batch first received
    before = sum(1 for seq in accepted if seq < contact)
    assert 50 <= before < contact and stats.recovered >= before
    assert before + stats.missed_before_contact == contact and stats.lost == 0


def test_a_prefix_past_what_a_span_may_count_leaves_num_tokens_out_not_the_batch():
    """``num_tokens`` is kvtrace's own figure (chain depth x block size), no value vLLM sent:
    two blocks of 2^31 - 1 tokens made it 2^32 - 2, past what a span may count, and the valid
    publish was refused whole as a bad message (and with it the chain below it)."""
    from kvtrace.instrument.ids import SeededIdGenerator
    from kvtrace.instrument.vllm import KVEvent, VllmSpanRows
    from kvtrace.instrument.vllm.wire import BLOCK_STORED, KVEventBatch
    from kvtrace.store.schema import MAX_SPAN_COUNT

    rows = VllmSpanRows(SeededIdGenerator(0), {"service.name": "vllm"})
    for step, (blocks, parent) in enumerate(((["01"], None), (["02"], "01"))):
        rows.add(step, KVEventBatch(T0 + step, [KVEvent(BLOCK_STORED, blocks, parent, [1], MAX_SPAN_COUNT)]))
    table = rows.take()
    assert table is not None
    columns = (table.column(c).to_pylist() for c in ("name", "block_hashes", "num_tokens"))
    publishes = [(h, n) for name, h, n in zip(*columns) if name == "kvtrace.cache.publish"]
    assert publishes == [(["01"], MAX_SPAN_COUNT), (["02"], None)]


def test_the_closing_lines_say_how_many_requests_the_trace_holds_and_an_empty_one(tmp_path):
    """``--trace-out`` was written without a word: the closing line counted batches, events and
    spans, and a capture that stored no block wrote a trace of its header alone, which
    ``kvtrace replay`` refuses (holds no request). The rebuilt requests are now told, as many
    as the file holds."""
    import subprocess
    import sys

    from kvtrace.workload.native import read_native

    EventBatch, Stored, _, _ = LEGACY
    pub = VllmPublisher(topic="kv")
    for k in range(2):  # one request's two chunks, sent before the capture joined: replayed at its stop
        stored = Stored([k + 1], k or None, [k] * 4, 4, None, "GPU", None)
        pub.publish(EventBatch(T0 + k * 0.1, [stored], 0), send=False)
    db = str(tmp_path / "t.duckdb")
    cmd = [sys.executable, "-m", "kvtrace.cli", "capture", "vllm", "--db", db, "--duration", "1"]
    try:
        rebuilt = subprocess.run([*cmd, "--endpoint", pub.endpoint, "--replay-endpoint", pub.replay_endpoint,
                                  "--trace-out", str(tmp_path / "one.jsonl")], capture_output=True, text=True,
                                 timeout=120, check=False)
        empty = subprocess.run([*cmd, "--endpoint", pub.endpoint, "--trace-out", str(tmp_path / "none.jsonl")],
                               capture_output=True, text=True, timeout=120, check=False)
    finally:
        pub.close()
    assert rebuilt.returncode == 0 and empty.returncode == 0, (rebuilt.stderr, empty.stderr)
    requests = list(read_native(tmp_path / "one.jsonl"))
    assert [r.hash_ids for r in requests] == [(0, 1)]
    assert f"kvtrace capture vllm: 1 request rebuilt in {tmp_path / 'one.jsonl'}\n" in rebuilt.stderr
    assert (f"kvtrace capture vllm: 0 requests rebuilt in {tmp_path / 'none.jsonl'} (no stored block was "
            "received: the trace holds no request to replay)") in empty.stderr
