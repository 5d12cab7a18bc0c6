"""A current directory deleted under the shell (probe env31): a relative path cannot be
made absolute (getcwd() fails). One line naming the folder, exit 2, before anything is
written; absolute paths still work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.support import assert_one_line

DATA = Path(__file__).resolve().parents[1] / "data"
TRACE = str(DATA / "mooncake_synthetic_trace.jsonl")
KVTRACE = [sys.executable, "-m", "kvtrace.cli"]
CACHE_ONLY = ["--mode", "cache-only", "--limit", "3"]


def _in_a_deleted_folder(tmp_path: Path, argv: list[str]) -> subprocess.CompletedProcess:
    gone = tmp_path / "gone"
    gone.mkdir()
    script = 'cd "$1" && rmdir "$1" && shift && exec "$@"'
    return subprocess.run(["bash", "-c", script, "bash", str(gone), *KVTRACE, *argv],
                          capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize("argv", [
    ["replay", TRACE, *CACHE_ONLY, "--db", "rel.duckdb"],
    ["convert", TRACE, "--limit", "2", "-o", "out.jsonl"],
    ["generate", "chat", "--requests", "3", "-o", "out.jsonl"],
    ["demo"],
    ["export", "--db", "{store}", "--run", "r1", "--parquet", "pq"],
])
def test_a_deleted_current_directory_is_one_line(tmp_path, argv):
    """os.path.realpath and abspath of a relative path call getcwd(), which raised
    FileNotFoundError (no file named): a traceback from the store's open, the output's
    checks, the demo's target or the export's folder."""
    store = tmp_path / "s.duckdb"
    if "{store}" in argv:
        r = subprocess.run([*KVTRACE, "replay", TRACE, *CACHE_ONLY, "--db", str(store)],
                           capture_output=True, text=True, timeout=300, check=False)
        assert r.returncode == 0, r.stderr
        argv = [str(store) if a == "{store}" else a for a in argv]
    r = _in_a_deleted_folder(tmp_path, argv)
    assert_one_line(r.returncode, r.stderr, str(tmp_path / "gone"), "current directory no longer exists")
    assert not r.stdout


def test_a_deleted_current_directory_with_absolute_paths_still_works(tmp_path):
    r = _in_a_deleted_folder(tmp_path, ["replay", TRACE, *CACHE_ONLY, "--db", str(tmp_path / "abs.duckdb")])
    assert r.returncode == 0, r.stderr
