"""A live vLLM capture (real ZMQ, vLLM's wire format) stored in DuckDB and in chdb reads
alike: its evictions carry block hashes but no block ids or ages, the case where ClickHouse's
zipped ARRAY JOIN padded with 0 where DuckDB's unnest pads with NULL."""

from __future__ import annotations

import threading
import time

import polars as pl
import pyarrow.parquet as pq
from polars.testing import assert_frame_equal

from kvtrace.instrument.vllm import capture_vllm
from kvtrace.store import export_parquet, read
from tests.clickhouse.frames import same_answer
from tests.instrument.vllm_publisher import CURRENT, VllmPublisher

BATCHES = 12
EVICTION_READS = ("span_counts", "evictions_by_reason", "evictions_over_time", "block_histograms",
                  "eviction_attribution", "stale_hashes")


def _batches():
    """Batch k stores block k (child of k-1) and, from k=3 on, removes block k-2."""
    EventBatch, BlockStored, BlockRemoved, _ = CURRENT
    h = lambda i: i.to_bytes(4, "big") * 8  # 32 bytes, like sha256_cbor
    out = []
    for k in range(BATCHES):
        events = [BlockStored([h(k + 1)], h(k) if k else None, [k] * 4, 4, None, "GPU", None,
                              group_idx=0, kv_cache_spec_kind="full_attention")]
        if k >= 3:
            events.append(BlockRemoved([h(k - 2)], "GPU", group_idx=0))
        out.append(EventBatch(1_700_000_000.0 + k * 0.01, events, 0))
    return out


def _capture(store: str) -> None:
    pub = VllmPublisher()
    batches = _batches()
    received, done = threading.Event(), threading.Event()
    caps: list = []

    def on_ready(cap):
        caps.append(cap)
        cap.on_batch = lambda seq, batch: received.set()

    t = threading.Thread(target=capture_vllm, args=(pub.endpoint, pub.replay_endpoint),
                         kwargs={"store_path": store, "topic": "kv-events", "should_stop": done.is_set,
                                 "on_ready": on_ready})
    t.start()
    try:
        first = pub.publish(batches[0])
        deadline = time.monotonic() + 20
        while not received.wait(0.05):  # seq 0 again until the subscription is live
            assert time.monotonic() < deadline, "subscriber never connected"
            pub.resend(first)
        for batch in batches[1:]:
            pub.publish(batch)
        while caps[0].stats.batches < BATCHES and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        done.set()
        t.join(30)
        pub.close()
    assert caps[0].stats.batches == BATCHES


def test_a_captured_runs_evictions_read_alike_from_both_stores(tmp_path):
    duck, ch = str(tmp_path / "live.duckdb"), f"chdb:{tmp_path / 'live'}"
    for store in (duck, ch):
        _capture(store)
    (run,) = read.runs(duck)["run_id"].to_list()
    assert read.runs(ch)["run_id"].to_list() == [run]
    assert read.evictions_by_reason(duck, run)["blocks"].sum() == BATCHES - 3  # there were evictions
    for name in EVICTION_READS:
        same_answer(name, getattr(read, name)(duck, run), getattr(read, name)(ch, run))
    a, b = export_parquet(duck, run, tmp_path / "a"), export_parquet(ch, run, tmp_path / "b")
    ea, eb = pl.from_arrow(pq.read_table(a["evicted_blocks"])), pl.from_arrow(pq.read_table(b["evicted_blocks"]))
    assert ea["block_hash"].null_count() == 0 and ea["block_id"].null_count() == ea.height  # hashes, no ids
    assert_frame_equal(ea, eb)
