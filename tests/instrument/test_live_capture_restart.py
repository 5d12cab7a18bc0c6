"""A vLLM publisher (its own ``ZmqEventPublisher``) restarted while the capture's SUB socket
reconnects: the new lifetime's first batches go to no subscriber, and the first one the
capture sees may carry the old lifetime's next seq by chance."""

from __future__ import annotations

import threading
import time
import warnings

import msgspec
import zmq

from kvtrace.instrument.arrow_columns import hash_hex
from kvtrace.instrument.vllm import VllmKVCapture
from kvtrace.store.writer import Store
from tests.instrument.helpers import store_rows
from tests.instrument.test_vllm_real_publisher import TOPIC

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # requests' charset warning on import
    from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher


def _batch(life: int, k: int) -> KVEventBatch:
    return KVEventBatch(ts=1_700_000_000.0 + 10 * life + k, events=[
        BlockStored(block_hashes=[1_000 * life + k], parent_block_hash=None, token_ids=[k, k], block_size=2,
                    lora_id=None, medium="GPU", lora_name=None)])


def _wait(cond, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_restart_whose_first_seen_seq_follows_the_old_one_is_a_restart_with_its_batches(tmp_path):
    """Lifetime 1 sends seqs 0-2; lifetime 2 sends 0-2 before the SUB is back (dropped), then
    3, which is the old lifetime's next seq: taken as its continuation, lifetime 2's first three
    batches were missing from the store and from every count, and no restart was counted."""
    pub_ep, replay_ep = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    store = Store.open(tmp_path / "c.duckdb")
    run_id = store.create_run("vllm", mode="live")
    cap = VllmKVCapture(pub_ep, replay_ep, store=store, run_id=run_id, topic=TOPIC)
    cap.socket.setsockopt(zmq.RECONNECT_IVL, 1_000)  # the reconnect comes well after lifetime 2's first batches
    done = threading.Event()
    thread = threading.Thread(target=cap.run, kwargs={"should_stop": done.is_set})
    thread.start()
    pub = ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=replay_ep, topic=TOPIC)
    try:
        _wait(lambda: cap.stats.connected == 1, "the SUB socket never reached the publisher")
        # (its subscription reaches the PUB after the connection: what is sent before is dropped, and
        # under load lifetime 1 went that way, unseen, no later batch telling of it)
        time.sleep(0.5)
        for k in range(3):
            pub.publish(_batch(1, k))
        _wait(lambda: cap.stats.batches + cap.stats.recovered >= 3, "lifetime 1 never arrived")
        pub.shutdown()
        pub = ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=replay_ep, topic=TOPIC)
        for k in range(3):
            pub.publish(_batch(2, k))
        time.sleep(2.5)  # the SUB is back
        pub.publish(_batch(2, 3))
        _wait(lambda: cap.stats.batches >= 4, "seq 3 of lifetime 2 never arrived")
        time.sleep(0.5)
    finally:
        done.set()
        thread.join(60)
        cap.close()
        pub.shutdown()
    store.finish_run(run_id)
    store.close()
    stats = cap.stats
    assert (stats.batches, stats.restarts, stats.recovered, stats.lost, stats.bad_messages) == (7, 1, 3, 0, 0), stats
    rows = store_rows(tmp_path / "c.duckdb", run_id, "name, step, block_hashes")
    stored = sorted((r["step"], r["block_hashes"][0]) for r in rows if r["name"] == "kvtrace.cache.publish")
    # lifetime 2's steps follow lifetime 1's
    assert stored == [(k, hash_hex(1_000 + k)) for k in range(3)] + [(3 + k, hash_hex(2_000 + k)) for k in range(4)]


def test_a_monitor_event_read_with_the_message_it_came_with_does_not_hold_the_capture(tmp_path):
    """One poll finds a message and the reconnect that brought it: ``receive`` reads the
    monitor's event first, so the poll's own turn for the monitor finds none left, and a
    blocking read there held the capture for good (no batch taken after a restart)."""
    pub_ep = f"ipc://{tmp_path}/pub"
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(pub_ep)
    cap = VllmKVCapture(pub_ep, topic=TOPIC)
    read = threading.Thread(target=cap.on_monitor, daemon=True)
    try:
        _wait(lambda: cap.monitor.poll(0), "the SUB socket never reached the publisher")
        cap.receive([TOPIC.encode(), (0).to_bytes(8, "big"), msgspec.msgpack.encode(_batch(1, 0))])
        assert cap.stats.connected == 1 and cap.stats.batches == 1  # (the event was read with the message)
        read.start()
        read.join(5)
        assert not read.is_alive(), "on_monitor waited for an event that had been read already"
    finally:
        if not read.is_alive():  # (a socket in use on another thread cannot be closed)
            cap.close()
        pub.close(0)
        ctx.term()
