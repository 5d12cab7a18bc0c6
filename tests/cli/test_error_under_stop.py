"""A KVTraceError that a stop signal brought about (a library caught the stop's interrupt and
raised its own error, a store the stop closed under a reader) ends the command as the stop:
``terminated (SIGTERM)``, exit 143, not exit 2 with the error as if the input were wrong
(re-probe 30)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvtrace.replay.run import RunSpec, run_replay

_PROGRAM = """
import os, signal, sys, time
from kvtrace.errors import KVTraceError
import kvtrace.store.read as read

def runs(db):
    try:
        os.kill(os.getpid(), signal.SIG{sig})
        time.sleep(5)
    except KeyboardInterrupt as stop:
        {raise_}
    raise KVTraceError("store closed under the reader")

read.runs = runs
sys.argv = ["kvtrace", "runs", "--db", sys.argv[1]]
from kvtrace.cli import main
main()
"""


@pytest.mark.parametrize("raise_", ['raise KVTraceError("query interrupted")', "pass"],
                         ids=["in-its-handler", "after-it"])
@pytest.mark.parametrize(("sig", "code"), [("TERM", 143), ("HUP", 129)])
def test_an_error_a_stop_brought_about_ends_the_command_as_the_stop(tmp_path, raise_, sig, code):
    db = tmp_path / "s.duckdb"
    run_replay(RunSpec("gen:chat", limit=2, mode="cache-only"), db=str(db))
    program = _PROGRAM.format(sig=sig, raise_=raise_)
    r = subprocess.run([sys.executable, "-c", program, str(db)], capture_output=True, text=True, timeout=300,
                       check=False)
    assert r.returncode == code, r.stderr
    assert r.stderr.strip() == f"kvtrace: error: terminated (SIG{sig})"
