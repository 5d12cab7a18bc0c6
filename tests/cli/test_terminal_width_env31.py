"""A terminal's width as the environment says it (probe env31): ``COLUMNS=0`` is no width.
rich laid every table out in 0 columns: on a terminal, replay's summary, ``runs`` and
``diff`` printed nothing at all, exit 0 (a negative one, which rich ignores, kept beside it)."""

from __future__ import annotations

import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1] / "data"
TRACE = str(DATA / "mooncake_synthetic_trace.jsonl")
KVTRACE = [sys.executable, "-m", "kvtrace.cli"]


def _on_a_terminal(argv: list[str], columns: str) -> tuple[int, str]:
    """``kvtrace ARGV`` with its stdout a pseudo-terminal: (exit code, what it showed there)."""
    leader, follower = os.openpty()
    env = {**os.environ, "COLUMNS": columns}
    try:
        proc = subprocess.Popen([*KVTRACE, *argv], stdout=follower, stderr=subprocess.PIPE, env=env)
        os.close(follower)
        shown = b""
        while True:
            ready, _, _ = select.select([leader], [], [], 120)
            if not ready:
                break
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # (EIO: the command closed its end)
                break
            if not chunk:
                break
            shown += chunk
        proc.communicate(timeout=120)
        return proc.returncode, shown.decode("utf-8", "replace")
    finally:
        os.close(leader)


@pytest.mark.parametrize("columns", ["0", "-1"])
def test_a_terminal_of_no_width_still_shows_the_tables(tmp_path, columns):
    db = str(tmp_path / "s.duckdb")
    code, shown = _on_a_terminal(["replay", TRACE, "--mode", "cache-only", "--limit", "3", "--db", db], columns)
    assert code == 0 and "prefix_cache_hit_rate" in shown, shown
    code, shown = _on_a_terminal(["runs", "--db", db], columns)
    assert code == 0 and "│ r1 " in shown, shown  # (folded to the terminal's 80 columns: a cell per line)
