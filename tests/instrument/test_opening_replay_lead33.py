"""``kvtrace replay --db S --otlp-endpoint URL`` killed with -9: its collected copy keeps the settings
its direct store holds (the opening record fc4c7dd built, sent by the replay itself: nums33's repro)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvtrace.instrument.otlp import OTLPCollector
from kvtrace.replay.generate import write_generated
from kvtrace.store import read

ROOT = Path(__file__).resolve().parents[2]


def test_a_replay_killed_after_its_first_export_keeps_its_settings_in_the_collected_copy(tmp_path):
    trace = tmp_path / "big.jsonl"
    write_generated("mixed", trace, fmt="native", seed=2, num_requests=3000)
    collected = tmp_path / "c.duckdb"
    collector = OTLPCollector(collected, port=0).start()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtrace.cli", "replay", str(trace), "--db", str(tmp_path / "o.duckdb"),
             "--percentiles", "25,99.9", "--otlp-endpoint", collector.url],
            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 180
            while collector.spans_received == 0 and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert collector.spans_received > 0 and proc.poll() is None, proc.stderr.read().decode()[-2000:]
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.communicate()
        assert collector.runs_recorded == 0  # (no finishing record: killed)
    finally:
        collector.stop()
    (run_id,) = read.runs(str(tmp_path / "o.duckdb"))["run_id"].to_list()
    (copy_id,) = read.runs(str(collected))["run_id"].to_list()  # (the export's own id: pipeline.unique_export_run_id)
    direct, copy = read.run(str(tmp_path / "o.duckdb"), run_id), read.run(str(collected), copy_id)
    assert copy["status"] == "incomplete" and copy["summary"] is None
    for key in ("name", "trace_source", "config", "behaviours", "created"):
        assert copy[key] == direct[key], key
    assert copy["config"]["percentiles"] == [25.0, 99.9]
