"""``kvtrace replay``'s summary on an 80-column terminal: the 64-digit digest folded across two
rows of the table, and was copied with its borders. Where the table does not fit, the digest
and the trace are printed whole under it, one line each; where it fits, they stay in it (found
by the left32 probe)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from tests.cli.test_runs_width_left32 import on_terminal

ARGS = ["replay", "gen:chat", "--limit", "5", "--mode", "cache-only", "--capacity-blocks", "30"]


def _digest() -> str:
    done = subprocess.run([sys.executable, "-m", "kvtrace.cli", *ARGS, "--json"], capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout)["digest"]


def test_a_narrow_terminal_gets_the_digest_whole_on_its_own_line():
    digest = _digest()
    out, _ = on_terminal(ARGS, 80)
    assert all(len(line) <= 80 for line in out.splitlines()), out
    assert f"\ndigest: {digest}\n" in out and "\ntrace: gen:chat" in out
    assert not re.search(r"│ digest\b", out)


def test_a_wide_terminal_keeps_it_in_the_table():
    digest = _digest()
    out, _ = on_terminal(ARGS, 200)
    assert re.search(rf"│ digest +│ {digest} │", out), out
    assert "\ndigest: " not in out
