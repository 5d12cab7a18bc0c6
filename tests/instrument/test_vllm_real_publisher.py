"""Gap recovery against vLLM 0.33's own publisher (``vllm.distributed.kv_events.ZmqEventPublisher``,
real sockets): its replay socket answers ``["", topic, seq, payload]`` and ends with
``["", "", END_SEQ, ""]``, and the capture must read that framing.

Each test makes the capture miss batches the way PUB/SUB does (a subscriber that joins
late; a subscriber too slow for the high-water marks, so PUB drops; a publisher that
restarts), then checks every published batch is stored with exactly its events.
"""

from __future__ import annotations

import threading
import time
import warnings

import pytest
import zmq

from kvtrace.instrument.arrow_columns import hash_hex
from kvtrace.instrument.vllm import VllmKVCapture
from kvtrace.store.writer import Store
from tests.instrument.helpers import store_rows

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # requests' charset warning on import
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher

TOPIC = "kv"


def _batch(k: int, tokens: int = 4) -> KVEventBatch:
    """Batch k stores block k+1 under block k and, from k=2 on, removes block k-1."""
    events: list = [BlockStored(block_hashes=[1_000 + k + 1], parent_block_hash=1_000 + k if k else None,
                                token_ids=[k % 50_000] * tokens, block_size=tokens, lora_id=None, medium="GPU",
                                lora_name=None, group_idx=k % 2, kv_cache_spec_kind="full_attention")]
    if k >= 2:
        events.append(BlockRemoved(block_hashes=[1_000 + k - 1], medium="GPU", group_idx=k % 2))
    return KVEventBatch(ts=1_700_000_000.0 + k * 0.01, events=events)


def _endpoints(tmp_path) -> tuple[str, str]:
    # ipc endpoints: vLLM binds them (a tcp one without '*' it would connect instead)
    return f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"


def _buffered(replay_endpoint: str) -> list[int]:
    """The seqs the publisher's replay socket holds, asked through its own protocol."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(replay_endpoint)
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs: list[int] = []
        while sock.poll(5_000):
            frames = sock.recv_multipart()
            assert frames[0] == b"" and len(frames) == 4, frames  # ["", topic, seq, payload] / end marker
            if frames[2] == ZmqEventPublisher.END_SEQ:
                assert frames[1] == b"" and frames[3] == b""
                return seqs
            assert frames[1] == TOPIC.encode()
            seqs.append(int.from_bytes(frames[2], "big"))
        raise AssertionError("no end marker from the replay socket")
    finally:
        sock.close(0)
        ctx.term()


def _wait_buffered(replay_endpoint: str, n: int) -> None:
    deadline = time.monotonic() + 30
    while len(_buffered(replay_endpoint)) < n:
        assert time.monotonic() < deadline, "the publisher never sent its queue"
        time.sleep(0.05)


class _Running:
    """A VllmKVCapture on a store run, polled on a thread until stopped."""

    def __init__(self, tmp_path, pub_ep: str, replay_ep: str, **kw):
        self.store = Store.open(tmp_path / "real.duckdb")
        self.run_id = self.store.create_run("vllm 0.33", mode="live")
        self.cap = VllmKVCapture(pub_ep, replay_ep, store=self.store, run_id=self.run_id, topic=TOPIC, **kw)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.cap.run, kwargs={"should_stop": self.done.is_set})
        self.thread.start()

    def wait_for(self, batches: int) -> None:
        deadline = time.monotonic() + 60
        while self.cap.stats.batches < batches:
            assert time.monotonic() < deadline, self.cap.stats
            time.sleep(0.05)

    def stop(self) -> list[dict]:
        self.done.set()
        self.thread.join(60)
        self.cap.close()
        self.store.finish_run(self.run_id)
        self.store.close()
        return store_rows(self.store.path, self.run_id, "name, step, start_ns, block_hashes, parent_block_hash, "
                                                        "token_ids, block_size, medium, group_id, kv_cache_spec_kind, "
                                                        "evict_reason")


def _assert_exact(rows: list[dict], batches: list[KVEventBatch], steps: list[int]) -> None:
    """Every batch stored once, at its step, with exactly its events."""
    step_rows = sorted(r["step"] for r in rows if r["name"] == "kvtrace.engine.step")
    assert step_rows == steps
    by_step: dict[int, list[dict]] = {}
    for r in rows:
        if r["name"] != "kvtrace.engine.step":
            by_step.setdefault(r["step"], []).append(r)
    for step, batch in zip(steps, batches):
        got = by_step[step]
        assert len(got) == len(batch.events)
        for r, ev in zip(sorted(got, key=lambda r: r["name"] != "kvtrace.cache.publish"), batch.events):
            assert r["start_ns"] == round(batch.ts * 1e9)
            assert isinstance(ev, (BlockStored, BlockRemoved))  # (_batch makes no other kind)
            assert r["block_hashes"] == [hash_hex(h) for h in ev.block_hashes]
            assert (r["medium"], r["group_id"]) == (ev.medium, ev.group_idx)
            if isinstance(ev, BlockStored):
                assert r["name"] == "kvtrace.cache.publish"
                assert r["parent_block_hash"] == (None if ev.parent_block_hash is None else
                                                  hash_hex(ev.parent_block_hash))
                assert (r["token_ids"], r["block_size"], r["kv_cache_spec_kind"]) == (
                    ev.token_ids, ev.block_size, ev.kv_cache_spec_kind)
            else:
                assert (r["name"], r["evict_reason"]) == ("kvtrace.cache.evict", "vllm_removed")


def test_a_late_subscriber_gets_the_earlier_batches_from_vllms_replay_socket(tmp_path):
    pub_ep, replay_ep = _endpoints(tmp_path)
    pub = ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=replay_ep, topic=TOPIC)
    try:
        published = [_batch(k) for k in range(5)]
        for b in published:  # before anyone subscribes: PUB drops them all
            pub.publish(b)
        _wait_buffered(replay_ep, 5)
        run = _Running(tmp_path, pub_ep, replay_ep)
        deadline = time.monotonic() + 60
        while run.cap.stats.batches == 0:  # live batches until one gets through (the slow joiner loses some)
            assert time.monotonic() < deadline, run.cap.stats
            published.append(_batch(len(published)))
            pub.publish(published[-1])
            time.sleep(0.05)
        for _ in range(5):
            published.append(_batch(len(published)))
            pub.publish(published[-1])
        run.wait_for(len(published))
        rows = run.stop()
    finally:
        pub.shutdown()
    stats = run.cap.stats
    assert (stats.lost, stats.gaps, stats.bad_messages, stats.duplicates) == (0, 0, 0, 0)
    assert stats.recovered >= 5 and stats.batches == len(published)
    _assert_exact(rows, published, list(range(len(published))))


def test_batches_pub_drops_for_a_slow_subscriber_come_back_through_replay(tmp_path):
    """High-water marks of 4 on both sides and a subscriber stalled on one batch while 150
    large ones are published: PUB drops most of them; the replay socket returns them all."""
    pub_ep, replay_ep = _endpoints(tmp_path)
    pub = ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=replay_ep, topic=TOPIC, hwm=4)
    release = threading.Event()
    try:
        run = _Running(tmp_path, pub_ep, replay_ep, rcvhwm=4, replay_timeout_s=10,
                       on_batch=lambda seq, b: release.wait(60) if seq == 1 else None)
        published = [_batch(0)]
        pub.publish(published[0])
        deadline = time.monotonic() + 60
        while run.cap.stats.batches == 0:  # the slow joiner: re-publish until one arrives
            assert time.monotonic() < deadline, run.cap.stats
            time.sleep(0.05)
            if run.cap.stats.batches == 0:
                published.append(_batch(len(published)))
                pub.publish(published[-1])
        first_stalled = len(published)
        for _ in range(150):  # ~16 kB each: far beyond the pipes and the socket buffers
            published.append(_batch(len(published), tokens=4_000))
            pub.publish(published[-1])
        _wait_buffered(replay_ep, len(published))
        release.set()
        deadline = time.monotonic() + 60
        while run.cap.stats.batches < len(published):  # a missing tail shows only when a later batch arrives
            assert time.monotonic() < deadline, run.cap.stats
            published.append(_batch(len(published)))
            pub.publish(published[-1])
            time.sleep(0.2)
        run.wait_for(len(published))
        rows = run.stop()
    finally:
        release.set()
        pub.shutdown()
    stats = run.cap.stats
    assert first_stalled >= 1
    assert stats.gaps >= 1 and stats.recovered >= 100 and stats.lost == 0, stats
    assert stats.batches == len(published)
    _assert_exact(rows, published, list(range(len(published))))


def test_a_restarted_vllm_publisher_continues_the_steps(tmp_path):
    pub_ep, replay_ep = _endpoints(tmp_path)
    pub = ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=replay_ep, topic=TOPIC)
    # the restart shows only if the SUB is back before the new publisher's seq passes the old
    # one's: 24 first batches, the second paced at 0.2 s, give it about 5 s (a loaded box needs >0.4)
    first = [_batch(k) for k in range(24)]
    run = _Running(tmp_path, pub_ep, replay_ep)
    try:
        # The SUB may join after a batch: the next one it sees makes it backfill the earlier
        # from the replay socket. Publish one a second until the capture has one (bounded).
        sent, next_at, deadline = 0, 0.0, time.monotonic() + 60
        while run.cap.stats.batches == 0:
            assert time.monotonic() < deadline and sent <= len(first), run.cap.stats
            if sent < len(first) and time.monotonic() >= next_at:
                pub.publish(first[sent])
                sent, next_at = sent + 1, time.monotonic() + 1.0
                _wait_buffered(replay_ep, sent)
            time.sleep(0.05)
        for b in first[sent:]:
            pub.publish(b)
        run.wait_for(len(first))
    finally:
        pub.shutdown()
    # the server restarts: a new publisher on the same endpoints, counting from 0 again
    pub = ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=replay_ep, topic=TOPIC)
    second: list[KVEventBatch] = []
    try:
        deadline = time.monotonic() + 60
        while run.cap.stats.restarts == 0:  # the SUB reconnects by itself; early batches may be lost live
            assert time.monotonic() < deadline, run.cap.stats
            second.append(_batch(100 + len(second)))
            pub.publish(second[-1])
            time.sleep(0.2)
        assert len(second) < len(first)  # the restart is visible: seq fell back
        run.wait_for(len(first) + len(second))
        rows = run.stop()
    finally:
        pub.shutdown()
    stats = run.cap.stats
    assert (stats.restarts, stats.lost, stats.duplicates) == (1, 0, 0)
    _assert_exact(rows, first + second, list(range(len(first) + len(second))))


@pytest.fixture(autouse=True)
def _vllm_quiet():
    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)
