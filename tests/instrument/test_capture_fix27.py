"""The twenty-seventh session's fixes to ``kvtrace capture vllm``: every batch the publisher sent
is in one count at a stop, and ``--trace-out`` rebuilds only requests ``replay`` takes."""

from __future__ import annotations

import warnings

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # requests' charset warning on import
    from vllm.distributed.kv_events import BlockStored, ZmqEventPublisher
    from vllm.distributed.kv_events import KVEventBatch as VllmBatch

T0 = 1_700_000_000.0


def _vllm_batch(k: int) -> VllmBatch:
    return VllmBatch(ts=T0 + k, events=[BlockStored(
        block_hashes=[k + 1], parent_block_hash=k if k else None, token_ids=[1] * 16, block_size=16, lora_id=None,
        medium="GPU", lora_name=None)])


def test_a_stop_before_any_live_batch_counts_the_backlog_its_answer_did_not_bring(tmp_path, monkeypatch):
    """A publisher that had sent 3,000 batches and sends nothing more: the stop asks its replay
    socket for them, and the answer is cut DRAIN_S after the stop. What it did not bring was in
    no count (4,210 received of 10,000, none missed); now it is missed before contact."""
    from kvtrace.instrument.vllm import capture as capture_module
    from kvtrace.instrument.vllm import capture_vllm

    monkeypatch.setattr(capture_module, "DRAIN_S", 0.0)  # (the answer cut at its first batch)
    pub_ep, replay_ep = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    pub = ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=replay_ep, topic="")
    sent = 3_000
    try:
        for k in range(sent):  # (nobody subscribed: PUB drops them, the replay buffer keeps them)
            pub.publish(_vllm_batch(k))
        caps: list = []
        stats = capture_vllm(pub_ep, replay_ep, store_path=tmp_path / "stop.duckdb", on_ready=caps.append,
                             should_stop=lambda: bool(caps and caps[0].stats.connected))
    finally:
        pub.shutdown()
    assert stats.connected == 1 and stats.lost == 0
    assert stats.batches == stats.recovered < sent
    assert stats.batches + stats.missed_before_contact == sent

