"""A stop while ``capture vllm --trace-out`` rebuilds its trace keeps the capture's counts (live33's report)."""

from __future__ import annotations

import os
import signal

import msgspec
import pytest
import zmq

from kvtrace.instrument.vllm import capture as capture_module
from kvtrace.instrument.vllm import capture_vllm
from kvtrace.store.read.runs import run

T0 = 1_700_000_000.0


def test_a_ctrl_c_while_the_trace_is_rebuilt_keeps_the_counts(tmp_path, monkeypatch):
    """The rebuild of --trace-out's trace ran after the run's error handling: a Ctrl-C there failed
    the run with the store's summary of the error alone, every count of what was stored gone. A
    real SIGINT is sent to this process as the rebuild begins."""
    real = capture_module.native_trace

    def interrupted(tracers):
        os.kill(os.getpid(), signal.SIGINT)  # (delivered at the next bytecode: inside the rebuild)
        return real(tracers)

    monkeypatch.setattr(capture_module, "native_trace", interrupted)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub_ep = f"ipc://{tmp_path}/pub"
    pub.bind(pub_ep)
    stored = ["BlockStored", [1], None, [1] * 16, 16, None, "GPU", None]
    caps: list = []

    def should_stop() -> bool:
        if not caps or not caps[0].stats.connected:
            return False
        if not caps[0].stats.batches:
            for seq in (0, 1):
                pub.send_multipart([b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode([T0 + seq, [stored]])])
            return False
        return caps[0].stats.batches >= 2

    db = tmp_path / "s.duckdb"
    try:
        with pytest.raises(KeyboardInterrupt):
            capture_vllm(pub_ep, None, store_path=db, on_ready=caps.append, should_stop=should_stop,
                         trace_out=tmp_path / "t.jsonl")
    finally:
        ctx.destroy(0)
    record = run(str(db), "r1")
    assert record["status"] == "failed"
    summary = record["summary"]
    assert summary["error"].startswith("KeyboardInterrupt")
    assert summary["batches"] == 2 and summary["connected"] == 1, summary
    assert not (tmp_path / "t.jsonl").exists()
