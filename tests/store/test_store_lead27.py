"""A live capture killed before it finished keeps no summary: every view reads one from its
spans (``summary_with_spans``), which gave ``{}`` for a run without request spans, so a
killed capture's 200 publishes read as nothing in ``runs``, ``diff`` and the dashboard."""

from __future__ import annotations

import threading
import time
import warnings

from kvtrace.instrument.vllm import VllmKVCapture
from kvtrace.store import read
from kvtrace.store.writer import Store
from tests.instrument.test_live_capture_restart import _wait
from tests.instrument.test_vllm_real_publisher import TOPIC

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher


def capture_five_blocks(tmp_path, store: Store, run_id: str) -> None:
    """vLLM's own publisher sends five stored blocks, two of them removed, into a capture of ``run_id``."""
    pub_ep, replay_ep = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    cap = VllmKVCapture(pub_ep, replay_ep, store=store, run_id=run_id, topic=TOPIC)
    done = threading.Event()
    thread = threading.Thread(target=cap.run, kwargs={"should_stop": done.is_set})
    thread.start()
    pub = ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=replay_ep, topic=TOPIC)
    try:
        _wait(lambda: cap.stats.connected == 1, "the SUB socket never reached the publisher")
        for k in range(5):
            events = [BlockStored(block_hashes=[100 + k], parent_block_hash=None if k == 0 else 99 + k,
                                  token_ids=[k, k], block_size=2, lora_id=None, medium="GPU", lora_name=None)]
            if k >= 3:
                events.append(BlockRemoved(block_hashes=[100 + k - 3], medium="GPU"))
            pub.publish(KVEventBatch(ts=1_700_000_000.0 + k, events=events))
        # (a burst sent before the subscription reached the PUB is dropped, and no later batch tells
        # of it: then the stop asks the replay socket for it, as a capture stopped after a burst does)
        seen, since = -1, time.monotonic()
        while cap.stats.batches < 5 and time.monotonic() - since < 2:
            if cap.stats.batches != seen:
                seen, since = cap.stats.batches, time.monotonic()
            time.sleep(0.02)
    finally:
        done.set()
        thread.join(60)
        pub.shutdown()
    assert cap.stats.batches == 5, repr(cap.stats)
    store.flush()


def test_a_capture_that_never_finished_reads_its_publishes_and_evictions_from_its_spans(tmp_path):
    db = tmp_path / "c.duckdb"
    store = Store.open(db)
    run_id = store.create_run("vllm", mode="live")
    capture_five_blocks(tmp_path, store, run_id)  # (what its once-a-second flushes had written when killed)
    assert read.run(db, run_id).get("summary") is None  # never finished: no summary stored
    summary = read.run_summary(db, run_id)
    assert (summary.get("publishes"), summary.get("evictions")) == (5, 2), summary
    assert summary["spans"] == sum(read.span_counts(db, run_id)["spans"])
    store.close()
