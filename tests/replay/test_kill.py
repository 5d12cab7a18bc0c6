"""kill -9 in the middle of an engine replay: what the store committed survives, exactly.

The replay hands spans to the store every ``DEFAULT_FLUSH_STEPS`` engine steps (a count,
so the batches, their ids and the store's seq order are the same in every run) and the
store commits at least once a second: a kill loses at most about a second of work. Here
a driver process (tests/replay/kill_driver.py) commits every hand-over and, after its
second commit (a fixed virtual point), waits to be killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import duckdb
import pyarrow.parquet as pq

from kvtrace.replay.run import RunSpec, run_replay
from kvtrace.store import export_parquet, read
from kvtrace.store.writer import Store
from tests.conftest import TRACES
from tests.instrument.helpers import store_rows
from tests.support.processes import reaped, wait_until

TRACE = str(TRACES / "mooncake_synthetic_trace.jsonl")
LIMIT = 60


def test_a_killed_replay_keeps_every_committed_span_exactly(tmp_path):
    db, marker = tmp_path / "killed.duckdb", tmp_path / "committed"
    proc = subprocess.Popen([sys.executable, "-m", "tests.replay.kill_driver", TRACE, str(LIMIT), str(db),
                             str(marker), "2"], stderr=subprocess.PIPE, text=True)
    with reaped(proc):
        wait_until(proc, marker.exists, "the driver never reached its second commit", timeout_s=300)
        committed = int(marker.read_text())
        os.kill(proc.pid, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL

    # exported before any writer recovers it: the status `runs` shows, and the derived rows
    # finish_run never materialised, computed from the spans (an export had 0 and "running")
    out = export_parquet(db, "r1", tmp_path / "export")
    assert pq.read_table(out["runs"]).column("status").to_pylist() == ["incomplete"]
    # and the summary `runs` and `diff` show, from its spans (runs.parquet held the stored null)
    (summary,) = pq.read_table(out["runs"]).column("summary").to_pylist()
    assert json.loads(summary) == read.run_summary(db, "r1") and json.loads(summary)["prefix_cache_queries"] > 0
    con = duckdb.connect(str(db), read_only=True)
    try:
        (evicted,), = con.execute("SELECT coalesce(sum(len(block_ids)), 0) FROM spans WHERE run_id = 'r1' "
                                  "AND name = 'kvtrace.cache.evict'").fetchall()
    finally:
        con.close()
    assert pq.read_table(out["evicted_blocks"]).num_rows == evicted > 0

    with Store.open(db) as store:  # a writer that finds the dead one's run marks it
        assert store.recovered_runs == ["r1"]
    assert read.run(db, "r1")["status"] == "incomplete"
    con = duckdb.connect(str(db), read_only=True)
    try:
        seqs = [s for (s,) in con.execute("SELECT seq FROM spans WHERE run_id = 'r1' ORDER BY seq").fetchall()]
    finally:
        con.close()
    assert committed > 0 and seqs == list(range(committed))  # all that was committed, contiguous

    complete = tmp_path / "complete.duckdb"
    result = run_replay(RunSpec(TRACE, limit=LIMIT), db=complete)
    assert result.summary["spans"] > committed  # the kill came mid-run
    assert store_rows(db, "r1") == store_rows(complete, result.run_id)[:committed]


def test_sigterm_stops_a_replay_like_ctrl_c_and_keeps_what_it_recorded(tmp_path):
    """SIGTERM (`kill`, `timeout`) mid-replay, sent after the store's second commit: one
    line, exit 143 (as a process killed by it), every span recorded before is flushed
    (at least the committed ones, contiguous), and the run is marked failed, not left running."""
    db, marker = tmp_path / "term.duckdb", tmp_path / "committed"
    proc = subprocess.run([sys.executable, "-m", "tests.replay.sigterm_driver", str(marker), "2", "--",
                           "replay", TRACE, "--limit", str(LIMIT), "--db", str(db)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 143, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == ["kvtrace: error: terminated (SIGTERM); what was recorded is kept"], proc.stderr
    committed = int(marker.read_text())
    run = read.run(db, "r1")
    assert run["status"] == "failed" and "Terminated" in run["summary"]["error"]
    con = duckdb.connect(str(db), read_only=True)
    try:
        seqs = [s for (s,) in con.execute("SELECT seq FROM spans WHERE run_id = 'r1' ORDER BY seq").fetchall()]
    finally:
        con.close()
    assert committed > 0 and len(seqs) >= committed and seqs == list(range(len(seqs)))
