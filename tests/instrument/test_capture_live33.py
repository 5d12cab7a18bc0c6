"""``kvtrace capture vllm``: the thirty-third session's live probe (real ZMQ sockets, vLLM's own publisher)."""

from __future__ import annotations

import warnings

from typer.testing import CliRunner

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # requests' charset warning on import
    from vllm.distributed.kv_events import BlockStored, ZmqEventPublisher
    from vllm.distributed.kv_events import KVEventBatch as VllmBatch

T0 = 1_700_000_000.0


def _stored(k: int, ts: float) -> VllmBatch:
    return VllmBatch(ts=ts, events=[BlockStored(
        block_hashes=[k + 1], parent_block_hash=None, token_ids=[1] * 16, block_size=16, lora_id=None,
        medium="GPU", lora_name=None)])


def test_a_batch_timed_past_what_a_trace_holds_leaves_the_rebuilt_trace_replayable(tmp_path):
    """The wire took any ts the store holds (up to 2^63 ns, the year 2262): one batch timed
    after 2116 (2^62 ns, the latest time a trace holds) among batches of today was stored, the
    closing line said "2 requests rebuilt", and ``replay`` refused the trace at its arrival_ns.
    Such a ts is a bad message now, and the trace reads back."""
    from kvtrace.cli import app
    from kvtrace.workload.lines import MAX_TIME_NS
    from kvtrace.workload.native import read_native

    pub_ep, replay_ep = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    pub = ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=replay_ep, topic="")
    try:
        pub.publish(_stored(0, T0))
        pub.publish(_stored(1, MAX_TIME_NS / 1e9 + 1e6))  # (past 2116, within the store's 2^63 ns)
        pub.publish(_stored(2, T0 + 2))
        trace = tmp_path / "t.jsonl"
        result = CliRunner().invoke(app, ["capture", "vllm", "--endpoint", pub_ep, "--replay-endpoint", replay_ep,
                                          "--db", str(tmp_path / "s.duckdb"), "--duration", "1",
                                          "--trace-out", str(trace)])
    finally:
        pub.shutdown()
    assert result.exit_code == 0, result.output
    assert "2 batches" in result.output and "1 bad messages" in result.output, result.output
    assert f"2 requests rebuilt in {trace}" in result.output
    assert [r.arrival_ns for r in read_native(str(trace))] == [0, 2_000_000_000]
