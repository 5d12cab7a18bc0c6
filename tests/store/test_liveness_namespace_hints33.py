"""A writer alive in another pid namespace of the same host (a container that shares the host's
name) keeps its run ``running`` for every reader outside (re-probe hints33 of 9ebc383): its
``writer_pid`` (1, say) named another process here, or none, so `kvtrace runs`, the read API and
the dashboard said ``incomplete`` while it went on writing. ``liveness.host_name`` now records
the pid namespace where it is not the host's first."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtrace.store import read
from kvtrace.store.liveness import host_name, writer_alive

ROOT = str(Path(__file__).resolve().parents[2])
WRITER = """
import sys, time
from kvtrace.store import Store
store = Store.open(sys.argv[1])
store.create_run("in another namespace")
print("ready", flush=True)
time.sleep(60)
"""


def can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, check=False)
    return done.returncode == 0


@pytest.mark.skipif(not can_unshare(), reason="needs unshare --pid (root)")
def test_a_writer_alive_in_another_pid_namespace_keeps_its_run_running(tmp_path):
    db = tmp_path / "s.duckdb"
    writer = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", WRITER, str(db)],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        assert read.runs(db)["status"].to_list() == ["running"]
    finally:
        writer.kill()
        writer.wait()


def test_this_processs_own_writer_and_an_earlier_records_bare_host_are_read_here():
    me, start = os.getpid(), None
    assert writer_alive(me, host_name(), start, db="s", run_id="r1")
    import socket

    # (an earlier kvtrace's record: the bare host name, its pid checked here as before)
    assert not writer_alive(2**22 + 12345, socket.gethostname(), None, db="s", run_id="r1")
    assert writer_alive(5, "another-host", None, db="s", run_id="r1")
