"""reprobe33: `kvtrace runs` lists a stopped cache-only run's capacity as its summary from spans
and diff state it (db23d82): at the trace's own block size, which no span records, runs said
capacity "-" and --json capacity_blocks null beside the read API's and diff's 2,000."""

from __future__ import annotations

import json
import subprocess
import sys

from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.store import read
from tests.conftest import TRACES


def test_a_stopped_cache_only_runs_capacity_is_listed_as_its_summary_states_it(tmp_path):
    trace = str(TRACES / "mooncake_synthetic_trace.jsonl")
    db, marker = tmp_path / "term.duckdb", tmp_path / "committed"
    proc = subprocess.run([sys.executable, "-m", "tests.replay.sigterm_driver", str(marker), "2", "--",
                           "replay", trace, "--mode", "cache-only", "--capacity-blocks", "2000", "--db", str(db)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 143 and marker.exists(), proc.stderr
    assert read.run(db, "r1")["status"] == "failed"
    assert read.run_summary(db, "r1")["capacity_blocks"] == 2000
    listed = CliRunner().invoke(app, ["runs", "--db", str(db), "--json"])
    assert listed.exit_code == 0, listed.output
    (row,) = json.loads(listed.stdout)["runs"]
    assert (row["capacity_blocks"], row["block_size"], row["unbounded"]) == (2000, None, False)
    table = CliRunner().invoke(app, ["runs", "--db", str(db)], env={"COLUMNS": "300"})
    assert table.exit_code == 0 and "2,000×?" in table.stdout, table.output


def test_a_cache_only_run_stopped_before_any_span_lists_its_capacity(tmp_path):
    from kvtrace.store import Store

    db = tmp_path / "e.duckdb"
    with Store.open(db) as store:
        run_id = store.create_run("empty", mode="cache-only/lru", config={
            "mode": "cache-only", "policy": "lru", "capacity_blocks": 2000, "block_size": None})
        store.finish_run(run_id, status="failed", summary={"error": "KVTraceError: stopped"})
    assert read.run_summary(db, run_id)["capacity_blocks"] == 2000
    listed = CliRunner().invoke(app, ["runs", "--db", str(db), "--json"])
    (row,) = json.loads(listed.stdout)["runs"]
    assert (row["capacity_blocks"], row["block_size"]) == (2000, None)
