"""reprobe33: a stopped run's summary from spans states its cache's size from its config
(e63070f, db23d82); a damaged config's size past what a summary holds (2^63-1) is an unknown
size there, as a wrong type is, not spans that hold values no kvtrace run holds."""

from __future__ import annotations

import json

import duckdb
import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.replay.run import RunSpec, run_replay
from kvtrace.store import export_parquet, read
from tests.conftest import TRACES


def _stopped_with_config(tmp_path, mode: str, damage) -> tuple[str, str]:
    db = str(tmp_path / "s.duckdb")
    spec = RunSpec(str(TRACES / "mooncake_synthetic_trace.jsonl"), mode=mode, limit=20,
                   capacity_blocks=2000 if mode == "cache-only" else None)
    run_replay(spec, db=db)
    with duckdb.connect(db) as con:
        (config,) = con.execute("SELECT config FROM runs WHERE run_id = 'r1'").fetchone() or (None,)
        con.execute("UPDATE runs SET config = ?, status = 'failed', summary = ? WHERE run_id = 'r1'",
                    [json.dumps(damage(json.loads(config))), json.dumps({"error": "KVTraceError: stopped"})])
    return db, "r1"


@pytest.mark.parametrize(("mode", "damage"), [
    ("cache-only", lambda c: {**c, "capacity_blocks": 10**30}),
    ("cache-only", lambda c: {**c, "block_size": 2**70}),
    ("engine", lambda c: {**c, "cache": {**c["cache"], "num_gpu_blocks": 10**30}}),
    ("engine", lambda c: {**c, "cache": {**c["cache"], "groups": [{"block_size": 2**70,
                                                                    "type": "FullAttentionSpec"}]}}),
])
def test_a_damaged_configs_huge_size_is_unknown_not_spans_damaged(tmp_path, mode, damage):
    """runs listed the run damaged ('its spans hold values no kvtrace run holds ...
    capacity_blocks ... got 10^30'), diff and export refused it, for a size its config alone held."""
    db, run_id = _stopped_with_config(tmp_path, mode, damage)
    summary = read.run_summary(db, run_id)
    assert summary["error"] == "KVTraceError: stopped" and summary["prefix_cache_queries"] > 0
    assert summary.get("capacity_blocks") in (None, 2000) and summary.get("block_size") in (None, 512)
    export_parquet(db, run_id, tmp_path / "out")  # (refused as damaged)
    listed = CliRunner().invoke(app, ["runs", "--db", db, "--json"])
    assert listed.exit_code == 0, listed.output
    (row,) = json.loads(listed.stdout)["runs"]
    assert row["damage"] is None and row["capacity_blocks"] in (None, 2000, 10_239), row
    assert row["block_size"] in (None, 512), row


def test_a_replay_stopped_before_any_span_states_its_configured_sizes(tmp_path):
    """e63070f gave a replay stopped before its first request finished its cache's size from
    its config; one stopped before any span was {} still: diff showed its block size (from the
    config) beside capacity_blocks left out, and the finished run's 10,239 against nothing."""
    db, run_id = _stopped_with_config(tmp_path, "engine", lambda c: c)
    with duckdb.connect(db) as con:
        for (table,) in con.execute("SELECT table_name FROM information_schema.tables "
                                    "WHERE table_type = 'BASE TABLE' AND table_name != 'runs'").fetchall():
            if "run_id" in [c[0] for c in con.execute(f'DESCRIBE "{table}"').fetchall()]:
                con.execute(f'DELETE FROM "{table}" WHERE run_id = ?', [run_id])
    assert read.span_counts(db, run_id).height == 0
    summary = read.run_summary(db, run_id)
    assert summary == {"error": "KVTraceError: stopped", "block_size": 512, "capacity_blocks": 10_239}
    shown = CliRunner().invoke(app, ["diff", run_id, run_id, "--db", db, "--json"])
    assert shown.exit_code == 0, shown.output
    rows = json.loads(shown.stdout)["metrics"]
    assert (rows["block_size"]["a"], rows["capacity_blocks"]["a"]) == (512, 10_239)
