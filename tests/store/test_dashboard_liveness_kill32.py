"""Probe 32 (kills): a writer killed with -9 changes no file of its store, yet its run then
reads ``incomplete``; the dashboard's cache key (``state.content_state``) must change with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from kvtrace.store import read
from kvtrace.store.state import content_state
from tests.support.processes import reaped

ROOT = str(Path(__file__).resolve().parents[2])
CHILD = str(Path(__file__).with_name("writer_child.py"))


def test_the_dashboards_runs_read_a_killed_writers_run_incomplete(tmp_path):
    """The dashboard caches its runs on the store's content state, which a kill -9 left as it
    was: the page went on showing the killed run ``running`` (until Refresh), where `kvtrace
    runs` and the read API said ``incomplete``."""
    from kvtrace.dashboard import queries

    db = str(tmp_path / "s.duckdb")
    proc = subprocess.Popen([sys.executable, CHILD, db, "hang", "2", "50"], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": ROOT})
    with reaped(proc):
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.strip() == "ready":
                break
        assert queries._runs(db, (0, content_state(db)))["status"].to_list() == ["running"]
        before = content_state(db)  # (the page's next run: the live writer read is in it)
        assert queries._runs(db, (0, before))["status"].to_list() == ["running"]
        assert content_state(db) == before  # (while it lives, the key holds)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    after = content_state(db)
    assert after is not None and after != before
    assert queries._runs(db, (0, after))["status"].to_list() == ["incomplete"]
    assert read.runs(db)["status"].to_list() == ["incomplete"]
    assert content_state(db) == after  # (and holds again)
