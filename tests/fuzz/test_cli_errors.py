"""The CLI on inputs the fuzz suite found: ``kvtrace replay FILE`` prints exactly one
``kvtrace: error:`` line naming the file, no traceback, and exits 2.

A few real subprocesses (not one per fuzz example): the fuzz tests hold the library's
invariant, these hold that ``main()`` turns it into the promised line.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CASES = {
    "bailian_time_1e300.jsonl": ('{"chat_id": 1, "parent_chat_id": -1, "timestamp": 1e300, "input_length": 1, '
                                 '"output_length": 0, "hash_ids": [0]}\n', ["--format", "bailian"]),
    "run.toml": ('[cache]\ngroups = [{ type = "full_attention", block_size = 64 }]\n', None),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_replay_prints_one_error_line_and_exits_2(tmp_path: Path, name):
    text, args = CASES[name]
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    if args is None:  # a config file: with a valid trace
        trace = tmp_path / "t.jsonl"
        trace.write_text('{"kvtrace_trace": 1}\n{"arrival_ns": 0, "input_length": 1, "output_length": 1, '
                         '"token_ids": [1]}\n')
        argv = [str(trace), "--config", str(path)]
    else:
        argv = [str(path), *args]
    proc = subprocess.run([sys.executable, "-m", "kvtrace.cli", "replay", *argv], capture_output=True, text=True,
                          check=False, timeout=120, cwd=Path(__file__).resolve().parents[2])
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("kvtrace: error: "), proc.stderr
    assert str(path) in lines[0] and "Traceback" not in proc.stderr
    assert proc.stdout == ""
