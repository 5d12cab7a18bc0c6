"""Fixes the lead made from the twenty-fifth session's probes (each named in its test)."""

from __future__ import annotations

import json

from tests.cli.support import run

TRACE = "tests/data/mooncake_synthetic_trace.jsonl"


def _ok(argv, capsys):
    code, out, err = run(argv, capsys)
    assert code == 0, err
    return out


def test_runs_lists_an_unbounded_cache_only_run_as_unbounded(tmp_path, capsys):
    """`kvtrace runs` showed "-" as the capacity of an unbounded cache-only run, as of a run
    that recorded none; curve and sweep tables call it unbounded (sweep probe)."""
    db = str(tmp_path / "s.duckdb")
    _ok(["replay", TRACE, "--mode", "cache-only", "--limit", "20", "--db", db], capsys)
    _ok(["replay", TRACE, "--mode", "cache-only", "--capacity-blocks", "50", "--limit", "20", "--db", db], capsys)
    listed = {r["capacity_blocks"]: r for r in json.loads(_ok(["runs", "--db", db, "--json"], capsys))["runs"]}
    assert listed[None]["unbounded"] is True and listed[50]["unbounded"] is False
    table = _ok(["runs", "--db", db], capsys)
    assert "unbounded×512" in table and "50×512" in table
