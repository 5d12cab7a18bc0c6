"""reprobe33: a writer alive in the host's first pid namespace keeps its run ``running`` for a
reader in a container that shares the host's name (the other way round from 9c98a80's case):
host_name() recorded the bare name there, which the container's reader took for its own, its
pid checked in the container's namespace: `kvtrace runs` said ``incomplete`` while the run went
on writing, and the container's next writer marked it so."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.store.test_liveness_namespace_hints33 import can_unshare

ROOT = str(Path(__file__).resolve().parents[2])
WRITER = """
import sys, time
from kvtrace.store import Store
store = Store.open(sys.argv[1])
store.create_run("on the host")
print("ready", flush=True)
time.sleep(60)
"""
READER = "import sys; from kvtrace.store import read; print(read.runs(sys.argv[1])['status'].to_list()[0])"


@pytest.mark.skipif(not can_unshare(), reason="needs unshare --pid (root)")
def test_a_writer_alive_outside_a_container_keeps_its_run_running_inside_it(tmp_path):
    db = tmp_path / "s.duckdb"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(db)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        inside = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", READER, str(db)],
                                cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
        assert inside.returncode == 0, inside.stderr
        assert inside.stdout.strip() == "running"
    finally:
        writer.kill()
        writer.wait()
