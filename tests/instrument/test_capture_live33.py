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
    assert "2 batches" in result.output and "1 bad message" in result.output, result.output
    assert f"2 requests rebuilt in {trace}" in result.output
    assert [r.arrival_ns for r in read_native(str(trace))] == [0, 2_000_000_000]


def test_a_second_ctrl_c_while_the_close_settles_a_held_message_keeps_the_counts(tmp_path):
    """A seq that jumped ahead as the last message before the stop is settled at the close, its
    gap asked of the replay socket (a slow one answers within the replay timeout). A second Ctrl-C
    there failed the run with the error alone as its summary: every count gone, where a second
    Ctrl-C in the loop keeps them beside the error."""
    import os
    import signal
    import threading

    import msgspec
    import pytest
    import zmq

    from kvtrace.instrument.vllm import capture_vllm
    from kvtrace.store.read.runs import run

    ctx = zmq.Context()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)  # (a replay socket that never answers)
    for sock in (pub, router):
        sock.setsockopt(zmq.LINGER, 0)
    pub_ep, replay_ep = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    pub.bind(pub_ep)
    router.bind(replay_ep)
    stored = ["BlockStored", [1], None, [1] * 16, 16, None, "GPU", None]
    caps: list = []
    timer: list[threading.Timer] = []

    def should_stop() -> bool:
        if not caps or not caps[0].stats.connected:
            return False
        if not caps[0].stats.batches:
            for seq in (0, 1, 2, 9):  # (9: a jump past 3..8, held until the close)
                pub.send_multipart([b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode([T0 + seq, [stored]])])
            return False
        if caps[0].held and not timer:  # the second Ctrl-C, while the close waits on the replay socket
            timer.append(threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)))
            timer[0].start()
        return bool(timer)

    db = tmp_path / "s.duckdb"
    try:
        with pytest.raises(KeyboardInterrupt):
            capture_vllm(pub_ep, replay_ep, store_path=db, replay_timeout_s=30.0, on_ready=caps.append,
                         should_stop=should_stop)
    finally:
        for t in timer:
            t.join()
        ctx.destroy(0)
    record = run(str(db), "r1")
    assert record["status"] == "failed"
    summary = record["summary"]
    assert summary["error"].startswith("KeyboardInterrupt")
    assert summary["batches"] == 3 and summary["connected"] == 1, summary


def test_a_replay_socket_that_never_answers_is_no_answer_cut_at_the_stop(tmp_path, caplog):
    """At the stop the tail past the last batch is asked of the replay socket, for the replay
    timeout. One that never answered (reached, silent) was taken for an answer cut at the stop:
    its rest read off for a second more, and a warning that "a replay answer cut at the stop had
    not ended 1 s later (0 more batches taken off undecoded)", of an answer that never came."""
    import logging

    import msgspec
    import zmq

    from kvtrace.instrument.vllm import capture_vllm

    ctx = zmq.Context()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    for sock in (pub, router):
        sock.setsockopt(zmq.LINGER, 0)
    pub_ep, replay_ep = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    pub.bind(pub_ep)
    router.bind(replay_ep)
    stored = ["BlockStored", [1], None, [1] * 16, 16, None, "GPU", None]
    caps: list = []

    def should_stop() -> bool:
        if caps and caps[0].stats.connected and not caps[0].stats.batches:
            pub.send_multipart([b"", (0).to_bytes(8, "big"), msgspec.msgpack.encode([T0, [stored]])])
        return bool(caps and caps[0].stats.batches)

    try:
        with caplog.at_level(logging.WARNING, logger="kvtrace.instrument.vllm.capture"):
            stats = capture_vllm(pub_ep, replay_ep, store_path=tmp_path / "s.duckdb", on_ready=caps.append,
                                 should_stop=should_stop)
        asked = router.poll(0)  # (the tail was asked)
    finally:
        ctx.destroy(0)
    assert asked
    assert stats.batches == 1 and stats.lost == 0 and stats.missed_before_contact == 0
    assert "cut at the stop" not in caplog.text, caplog.text
