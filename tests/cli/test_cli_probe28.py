"""Found by session 28's generated probe of the whole command line (every command, every
option, boundary values, paths and output plumbing): each a regression test."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

KVTRACE = [sys.executable, "-m", "kvtrace.cli"]


@pytest.mark.parametrize("argv", [[], ["capture"]])
def test_the_help_a_bare_command_prints_to_a_closed_stdout_exits_141_silently(argv):
    """`kvtrace | head -0`, `kvtrace capture` into a closed pipe: the help printed for a command
    given nothing ended in a traceback and exit 1 (`--help` itself exits 141, silently)."""
    proc = subprocess.Popen([*KVTRACE, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and err == b"", err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("argv", [[], ["capture"]])
def test_the_help_a_bare_command_prints_to_a_full_stdout_is_one_line(argv):
    with open("/dev/full", "wb") as full:
        proc = subprocess.run([*KVTRACE, *argv], stdout=full, stderr=subprocess.PIPE, timeout=120, check=False)
    err = proc.stderr.decode()
    assert proc.returncode == 2, err
    assert err.splitlines() == ["kvtrace: error: cannot write to stdout: No space left on device"], err
