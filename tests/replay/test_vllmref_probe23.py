"""Probe 23 of ``kvtrace conformance`` and ``--backend vllm``: what a user is told when vLLM
does not import because of something outside vLLM (a broken or shadowed dependency)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvtrace.engine.backends.vllm import _load
from tests.cli.support import assert_one_line, run

ROOT = Path(__file__).resolve().parents[2]


def test_a_broken_dependency_of_vllm_is_named_where_it_broke(tmp_path, monkeypatch, capsys):
    """A dependency raising at import (torch shadowed on PYTHONPATH) was told at vLLM's
    import line ("at vllm/env_override.py:150; fix it there"), a file with nothing to fix."""
    checkout = tmp_path / "checkout"
    (checkout / "fakevllm23").mkdir(parents=True)
    (checkout / "fakevllm23" / "__init__.py").write_text("")
    (checkout / "fakevllm23" / "usesdep.py").write_text("import os\nimport fakedep_probe23\n")
    (checkout / "fakedep_probe23.py").write_text("x = 1\nraise RuntimeError('broken dependency')\n")
    monkeypatch.syspath_prepend(str(checkout))
    monkeypatch.setattr(_load, "_package_root", lambda: str(checkout / "fakevllm23"))
    monkeypatch.setattr(_load, "_loaded", None)
    monkeypatch.setitem(_load._API, "KVCacheManager", ("fakevllm23.usesdep", "KVCacheManager"))
    for name in ("fakevllm23.usesdep", "fakedep_probe23"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    code, _, err = run(["replay", "gen:chat", "--limit", "2", "--backend", "vllm"], capsys)
    assert_one_line(code, err, "RuntimeError: broken dependency, at "
                    f"{checkout}/fakedep_probe23.py:2, imported from {checkout}/fakevllm23/usesdep.py:2)",
                    "fix it there, or reinstall with `make vllm`")


def test_a_torch_shadowed_on_pythonpath_is_one_line_naming_it(tmp_path):
    """The brief's case end to end: a broken PYTHONPATH entry, in a process of its own."""
    shadow = tmp_path / "shadow" / "torch"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise RuntimeError('torch broken')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "shadow")}
    argv = ["replay", "gen:chat", "--limit", "2", "--backend", "vllm", "--no-content"]
    done = subprocess.run([sys.executable, "-m", "kvtrace.cli", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert_one_line(done.returncode, done.stderr, "RuntimeError: torch broken, at "
                    f"{shadow}/__init__.py:1, imported from ", "reinstall with `make vllm`")


def test_a_run_where_no_request_fit_the_pool_says_so(vllm_api):
    """Every request larger than the pool: both refused each, the run compared their lookups
    alone, and the report said "agree" with nothing else but "2 requests ... skipped" (and
    "1 requests" for one)."""
    from kvtrace.replay.conformance import ConformanceSpec, format_report, run_conformance

    spec = ConformanceSpec("gen:chat", preset="dense-attention", limit=6, capacity_blocks=(2, 70))
    result = run_conformance(spec, api=vllm_api)
    none_ran, one_skipped = result.runs
    assert result.agree and (none_ran.requests, none_ran.unschedulable) == (0, 6)
    assert (one_skipped.requests, one_skipped.unschedulable) == (5, 1)
    report = format_report(result)
    told = [i for i, line in enumerate(report) if line.startswith("  no request ran: each was larger than the pool")]
    assert told == [2], report  # under the first run's head line only
    assert report[1].endswith(", 6 requests larger than the pool skipped"), report[1]
    heads = [line for line in report if line.startswith("num_gpu_blocks 70:")]
    assert heads and heads[0].endswith(", 1 request larger than the pool skipped"), heads
