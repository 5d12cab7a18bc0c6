"""``kvtrace capture vllm`` killed with -9 mid-stream from vLLM's own publisher, then run
again on the same store: what it flushed survives, the run reads as ``incomplete``, and
the store stays readable by ``runs`` and ``diff``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings

from kvtrace.store.read import span_counts
from tests.instrument.test_vllm_real_publisher import TOPIC, _batch
from tests.support.processes import reaped, wait_until

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # requests' charset warning on import
    from vllm.distributed.kv_events import ZmqEventPublisher


def _steps(db, run_id: str) -> int:
    """Step spans the store holds for the run (0 before it has any)."""
    if not os.path.exists(db):
        return 0
    try:
        frame = span_counts(db, run_id)
    except Exception:  # (the run not created yet)
        return 0
    rows = frame.filter(frame["name"] == "kvtrace.engine.step")["spans"]
    return int(rows[0]) if len(rows) else 0


def _kvtrace(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtrace.cli", *args], check=False, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, COLUMNS="200"))


def test_a_capture_killed_mid_stream_keeps_what_it_flushed_and_reads_incomplete(tmp_path):
    db = tmp_path / "cap.duckdb"
    pub_ep, replay_ep = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    pub = ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=replay_ep, topic=TOPIC)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "kvtrace.cli", "capture", "vllm", "--endpoint", pub_ep,
                                 "--replay-endpoint", replay_ep, "--db", str(db)], stderr=subprocess.PIPE, text=True)
        with reaped(proc):
            sent = 0
            deadline = time.monotonic() + 60
            while _steps(db, "r1") == 0:  # one a 0.3 s until the SUB has joined (replay brings the rest)
                assert proc.poll() is None and time.monotonic() < deadline
                pub.publish(_batch(sent))
                sent += 1
                time.sleep(0.3)
            for _ in range(30):
                pub.publish(_batch(sent))
                sent += 1
            wait_until(proc, lambda: _steps(db, "r1") == sent, "the capture never flushed every batch", 60)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        assert proc.returncode == -signal.SIGKILL

        listed = json.loads(_kvtrace("runs", "--db", str(db), "--json").stdout)["runs"]
        assert [(r["run_id"], r["status"]) for r in listed] == [("r1", "incomplete")]
        assert _steps(db, "r1") == sent  # every flushed batch, once

        # a capture started again on the store makes a run of its own, beside the killed one
        proc = subprocess.Popen([sys.executable, "-m", "kvtrace.cli", "capture", "vllm", "--endpoint", pub_ep,
                                 "--replay-endpoint", replay_ep, "--db", str(db)], stderr=subprocess.PIPE, text=True)
        with reaped(proc):
            deadline = time.monotonic() + 60
            while _steps(db, "r2") == 0:
                assert proc.poll() is None and time.monotonic() < deadline
                pub.publish(_batch(sent))
                sent += 1
                time.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "Traceback" not in err, err
    finally:
        pub.shutdown()
    listed = json.loads(_kvtrace("runs", "--db", str(db), "--json").stdout)["runs"]
    assert sorted((r["run_id"], r["status"]) for r in listed) == [("r1", "incomplete"), ("r2", "complete")]
    diff = _kvtrace("diff", "r1", "r2", "--db", str(db))
    assert diff.returncode == 0, diff.stderr
    assert "is incomplete: partial numbers" in diff.stdout + diff.stderr  # (A, the killed run)
