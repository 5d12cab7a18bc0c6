"""Dashboard fixes of session 28 (fixdash): the server the command starts, and what its pages
say, against what the run's own counts support."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from kvtrace.store.writer import Store
from tests.dashboard.support import free_port, serving
from tests.support.processes import reaped, wait_until

KVTRACE = str(Path(sys.executable).with_name("kvtrace"))  # (the console script)


def _answers(port: int, path: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def test_a_streamlit_config_in_the_users_folder_does_not_move_the_address(tmp_path):
    """Streamlit reads ``.streamlit/config.toml`` from its working directory: a user's folder
    holding one with baseUrlPath "foo" served the dashboard under /foo, and the address the
    command printed answered 404."""
    db = tmp_path / "d.duckdb"
    Store.open(db).close()
    folder = tmp_path / "work"
    (folder / ".streamlit").mkdir(parents=True)
    (folder / ".streamlit" / "config.toml").write_text('[server]\nbaseUrlPath = "foo"\n')
    port = free_port()
    proc = subprocess.Popen([KVTRACE, "dashboard", "--db", str(db), "--port", str(port)], cwd=folder,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    with reaped(proc):
        wait_until(proc, lambda: serving(port) or _answers(port, "/foo/_stcore/health"), "the dashboard never served")
        assert serving(port), "the address printed does not answer (served under the folder's baseUrlPath)"
        assert _answers(port, "/")
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert proc.returncode == 0


def test_a_server_that_dies_at_start_is_one_error_line(tmp_path):
    """A module on PYTHONPATH that breaks the server's imports (a uvicorn.py raising): the command
    printed the address, then the server's 44-line traceback, and exited 1."""
    db = tmp_path / "d.duckdb"
    Store.open(db).close()
    shadow = tmp_path / "pp"
    shadow.mkdir()
    for name in ("uvicorn", "tornado"):  # (the server Streamlit starts, whichever it is)
        (shadow / f"{name}.py").write_text('raise ImportError("shadowed by a test")\n')
    env = dict(os.environ, PYTHONPATH=str(shadow))
    proc = subprocess.run([KVTRACE, "dashboard", "--db", str(db), "--port", str(free_port())], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("kvtrace dashboard: open ")]
    assert len(errors) == 1, proc.stderr
    assert errors[0].startswith("kvtrace: error: the dashboard server"), errors
    assert "ImportError: shadowed by a test" in errors[0] and str(shadow) in errors[0], errors


def test_a_live_captures_evictions_page_says_what_a_capture_cannot_show(tmp_path, monkeypatch):
    """A live capture records vLLM's stores and removals, no lookups and no scheduler steps:
    its Evictions page said "No evictions or repeated prefixes in this run" beside the evictions
    Overview counts (and charted above), and a killed capture was told to fill the page with
    "the same replay run to its end" (a capture is no replay)."""
    import duckdb
    from apptest import render

    from kvtrace.store import read
    from tests.dashboard.test_dash_live_clock import _live_capture

    db = str(tmp_path / "live.duckdb")
    run = _live_capture(db)
    assert read.run_summary(db, run)["evictions"] > 0  # what the page is about
    for status in ("complete", "incomplete"):
        with duckdb.connect(db) as con:
            con.execute("UPDATE runs SET status = ? WHERE run_id = ?", [status, run])
        infos = [i.value for i in render(db, monkeypatch, "evictions", run=run).info]
        assert not any("No evictions" in i or "No miss in this run" in i for i in infos), infos
        assert not any("replay run to its end" in i for i in infos), infos
        assert sum("This run is a live capture" in i for i in infos) == 2, infos


def test_the_stale_drill_down_says_what_the_runs_own_counts_show_beside_its_divergence(tmp_path, monkeypatch):
    """A run with divergent outputs, no stale hash found, stale entries left and table
    disagreements: the drill-down blamed stale keys read and evicted between two audits, which
    none of its counts shows, and left out the counts that it has."""
    from apptest import render

    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path / "st.duckdb")
    summary = run_replay(RunSpec("gen:study-external-hit-running-cow", capacity_blocks=20,
                                 external_capacity_blocks=4096, without=("external-hit-running-cow",)), db=db).summary
    assert summary["stale_hashes"] == 0 and summary["divergent_outputs"] > 0  # what the test is about
    assert summary["stale_hashes_left"] > 0 and summary["table_disagreements"] > 0
    infos = [i.value for i in render(db, monkeypatch, "stale", run="r1").info]
    said = [i for i in infos if i.startswith("No stale hash to drill into")]
    assert len(said) == 1, infos
    assert "evicted between two audits" not in said[0], said
    assert f"{summary['divergent_outputs']:,} output tokens diverged" in said[0]
    assert f"{summary['stale_hashes_left']:,} stale entries" in said[0], said
    assert f"{summary['table_disagreements']:,} table disagreements" in said[0], said
