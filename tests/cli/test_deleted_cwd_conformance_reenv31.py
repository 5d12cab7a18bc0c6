"""kvtrace conformance in a current directory deleted under the shell (re-probe reenv31 of
691226d): with gen:NAME or absolute paths it must work, as every other command does; torch
did not import there (its MKL printed 'Intel oneMKL FATAL ERROR: Cannot load
.../libtorch_cpu.so.' and exited 2, no kvtrace line), and vLLM did not (torch._dynamo's
getcwd()). Both are loaded from / now."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

KVTRACE = [sys.executable, "-m", "kvtrace.cli"]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")


def _in_a_deleted_folder(tmp_path: Path, argv: list[str]) -> subprocess.CompletedProcess:
    gone = tmp_path / "gone"
    gone.mkdir()
    script = 'cd "$1" && rmdir "$1" && shift && exec "$@"'
    return subprocess.run(["bash", "-c", script, "bash", str(gone), *KVTRACE, *argv],
                          capture_output=True, text=True, timeout=600, check=False)


def test_conformance_of_a_generated_workload_works(tmp_path):
    done = _in_a_deleted_folder(tmp_path, ["conformance", "gen:chat", "--limit", "3", "--json"])
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["agree"] is True
    assert "Traceback" not in done.stderr and "FATAL" not in done.stderr
