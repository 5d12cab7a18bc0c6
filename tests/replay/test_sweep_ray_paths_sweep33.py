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
