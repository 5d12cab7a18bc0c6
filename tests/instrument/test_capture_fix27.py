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


def test_trace_out_cuts_a_chain_past_what_replay_takes_and_says_so(tmp_path):
    """Blocks of 2^31 - 1 tokens (a block size vLLM may report): a chain of two was written as a
    request of 2^32 - 2 tokens, the closing line said "2 requests rebuilt", and ``replay`` refused
    the trace. Now such a chain is cut to its longest prefix of blocks within what replay takes,
    the closing line counts the requests cut, and the trace reads back."""
    from typer.testing import CliRunner

    from kvtrace.cli import app
    from kvtrace.workload.lines import MAX_TOKENS
    from kvtrace.workload.native import read_native

    big = MAX_TOKENS - 1
    pub_ep, replay_ep = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    pub = ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=replay_ep, topic="")
    batches = [([1, 2], None), ([3], 2), ([9], None)]  # two chains past the limit, one block within it
    try:
        for k, (blocks, parent) in enumerate(batches):  # (2 s apart: each a request of its own)
            pub.publish(VllmBatch(ts=T0 + 2 * k, events=[BlockStored(
                block_hashes=blocks, parent_block_hash=parent, token_ids=[1] * 16, block_size=big, lora_id=None,
                medium="GPU", lora_name=None)]))
        trace = tmp_path / "t.jsonl"
        result = CliRunner().invoke(app, ["capture", "vllm", "--endpoint", pub_ep, "--replay-endpoint", replay_ep,
                                          "--db", str(tmp_path / "s.duckdb"), "--duration", "1",
                                          "--trace-out", str(trace)])
    finally:
        pub.shutdown()
    assert result.exit_code == 0, result.output
    assert "3 batches" in result.output
    assert f"3 requests rebuilt in {trace} (2 cut to the longest prefix" in result.output
    assert [r.input_length for r in read_native(str(trace))] == [big, big, big]
