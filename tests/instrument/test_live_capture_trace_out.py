"""``capture vllm --trace-out``: a trace that cannot be written at the end (a full disk) is
its own one-line error; the capture's run is stored whole, complete, with its counts."""

from __future__ import annotations

import json
import threading
import time
import warnings

import duckdb
import pytest

from kvtrace.errors import KVTraceError
from kvtrace.instrument.vllm import capture_vllm
from tests.instrument.test_vllm_real_publisher import TOPIC

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # requests' charset warning on import
    from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher


def test_a_trace_that_cannot_be_written_leaves_the_run_complete_with_its_counts(tmp_path):
    pub_ep, replay_ep = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    db = tmp_path / "c.duckdb"
    caps: list = []
    stop = threading.Event()
    failure: list[BaseException] = []

    def capture() -> None:
        try:
            capture_vllm(pub_ep, replay_ep, store_path=db, topic=TOPIC, trace_out="/dev/full",
                         should_stop=stop.is_set, on_ready=caps.append)
        except BaseException as err:
            failure.append(err)

    pub = ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=replay_ep, topic=TOPIC)
    thread = threading.Thread(target=capture)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        k = 0
        while not caps or caps[0].stats.batches < 3:  # one a 0.2 s until the SUB has joined (replay brings the rest)
            assert thread.is_alive() and time.monotonic() < deadline, failure
            pub.publish(KVEventBatch(ts=1_700_000_000.0 + k, events=[BlockStored(
                block_hashes=[k + 1], parent_block_hash=k or None, token_ids=[k, k], block_size=2, lora_id=None,
                medium="GPU", lora_name=None)]))
            k += 1
            time.sleep(0.2)
        while caps[0].stats.batches < k:
            assert time.monotonic() < deadline, caps[0].stats
            time.sleep(0.05)
    finally:
        stop.set()
        thread.join(60)
        pub.shutdown()
    assert len(failure) == 1 and isinstance(failure[0], KVTraceError), failure
    # with the counts: the CLI's summary line is never reached
    stored = rf"\(the capture itself is stored: run r1, {k} batches, {k} events, \d+ spans[^)]*\)$"
    with pytest.raises(KVTraceError, match=r"^/dev/full: cannot write: .*" + stored):
        raise failure[0]
    con = duckdb.connect(str(db), read_only=True)
    try:
        status, summary = con.execute("SELECT status, summary FROM runs WHERE run_id = 'r1'").fetchone()
        steps = con.execute("SELECT count(*) FROM spans WHERE run_id = 'r1' AND name = 'kvtrace.engine.step'"
                            ).fetchone()
    finally:
        con.close()
    counts = json.loads(summary)
    # it was 'failed', the summary only the error: every count gone
    assert status == "complete" and (counts["batches"], counts["lost"], counts["requests"]) == (k, 0, 1), summary
    assert steps == (k,)
