"""A curve recorded again into a chdb store and killed (kill -9, or SIGTERM, which says "what
was recorded is kept"): ClickHouse has no transaction, and the DELETE of the earlier recording
then the insert of the new one lost the committed curve (22 points -> 0; found by the kill32
probe). The new points go in first, the earlier recording goes after; readers take a curve's
newest recording alone, so a kill between the two reads one curve, never none, never two."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtrace.store import read
from kvtrace.store.backend import clickhouse_target
from kvtrace.store.clickhouse import client

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "tests" / "data" / "mooncake_synthetic_trace.jsonl"
# The CLI, killed by its own signal at a named step of the recording (no sleep that guesses).
DRIVER = r"""
import os, signal, sys
from kvtrace.store.clickhouse import client
from kvtrace import cli
sig = getattr(signal, os.environ["KILL_SIGNAL"])
at = os.environ["KILL_AT"]
insert, command = client.ClickHouseConnection.insert_arrow, client.ClickHouseConnection.command
def insert_arrow(self, table, rows):
    if at == "insert" and table == "curves":
        os.kill(os.getpid(), sig)
    return insert(self, table, rows)
def run_command(self, sql, params=None):
    if at == "delete" and sql.startswith("DELETE FROM curves"):
        os.kill(os.getpid(), sig)
    return command(self, sql, params)
client.ClickHouseConnection.insert_arrow = insert_arrow
client.ClickHouseConnection.command = run_command
sys.argv = ["kvtrace", *sys.argv[1:]]
cli.main()
"""


@pytest.mark.parametrize(("sig", "at"), [("SIGKILL", "insert"), ("SIGTERM", "insert"), ("SIGKILL", "delete")])
def test_a_curve_recorded_again_and_killed_reads_one_whole_recording(tmp_path, sig, at):
    db = f"chdb:{tmp_path / 'ch'}"
    args = ["curve", str(TRACE), "--limit", "60", "--db", db]
    subprocess.run([sys.executable, "-m", "kvtrace.cli", *args], check=True, capture_output=True)
    before = read.curves(db)
    assert before.height > 0
    done = subprocess.run([sys.executable, "-c", DRIVER, *args], capture_output=True, text=True, check=False,
                          env={**os.environ, "KILL_SIGNAL": sig, "KILL_AT": at})
    assert done.returncode == (-9 if sig == "SIGKILL" else 143), done.stderr
    after = read.curves(db)
    assert after.height == before.height
    keep = [c for c in after.columns if c != "created"]
    assert after.select(keep).sort(keep).equals(before.select(keep).sort(keep))  # (the same points: one curve)
    with client.connect(clickhouse_target(db)) as con:
        recordings = con.ch_frame("SELECT count(DISTINCT created) AS n FROM curves")["n"][0]
    assert recordings == (2 if at == "delete" else 1)  # (killed before its delete: both, read as the newest)
