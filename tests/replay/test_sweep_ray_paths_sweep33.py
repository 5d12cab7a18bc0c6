"""A sweep on Ray with a relative trace (and --config) path (sweep33).

A Ray task's worker opens the trace itself, in its own working directory (the cluster's,
wherever `ray start` ran), not the command's: the README's own example (`ray start --head`,
then `kvtrace sweep trace.jsonl ... --ray auto`) ended with 'trace.jsonl: no such file or
directory' for a file that was there. The paths go to the cluster resolved, and the runs
record the trace as it was typed, as a local sweep's do.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import replace

import pytest

from kvtrace.replay.run import RunSpec
from kvtrace.replay.sweep import run_sweep
from tests.conftest import MOONCAKE


def test_a_relative_trace_and_config_reach_a_ray_worker_elsewhere_and_are_recorded_as_typed(tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(MOONCAKE, work / "trace.jsonl")
    (work / "run.toml").write_text("[cache]\nenable_partial_hits = true\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    # the cluster's workers start here, as a cluster started in another directory has them
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        monkeypatch.chdir(work)
        base = RunSpec("trace.jsonl", mode="cache-only", limit=80)
        on_ray = run_sweep(base, [("capacity_blocks", [30, 90])], ray_address="auto")
        engine = run_sweep(RunSpec("trace.jsonl", config_file="run.toml", limit=20),
                           [("capacity_blocks", [300, 400])], ray_address="auto")
    finally:
        ray.shutdown()
    assert os.getcwd() == str(work)
    here = run_sweep(replace(base), [("capacity_blocks", [30, 90])], workers=1)
    assert [r.summary for r in on_ray.runs] == [r.summary for r in here.runs]
    assert {r.summary["trace"] for r in on_ray.runs} == {"trace.jsonl"}
    assert on_ray.sweep_id == here.sweep_id
    assert [r.summary["trace"] for r in engine.runs] == ["trace.jsonl", "trace.jsonl"]


def test_ray_auto_with_a_dead_ray_address_is_refused_in_seconds(tmp_path):
    """``--ray auto`` goes where RAY_ADDRESS says: a dead address there held ray.init for
    minutes of retries and warnings, deaf to SIGTERM (timeout's) and Ctrl-C alike."""
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path

    pytest.importorskip("ray")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_ADDRESS"] = f"127.0.0.1:{port}"
    db = tmp_path / "s.duckdb"
    began = time.monotonic()
    out = subprocess.run([str(Path(sys.executable).parent / "kvtrace"), "sweep", "gen:mixed", "--param",
                          "capacity_blocks=40,50", "--ray", "auto", "--db", str(db)],
                         env=env, capture_output=True, text=True, timeout=90, check=False)
    assert time.monotonic() - began < 30
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [f"kvtrace: error: --ray auto: RAY_ADDRESS=127.0.0.1:{port}: cannot "
                                               "reach a Ray cluster there (Connection refused)"], out.stderr
    assert not db.exists()
