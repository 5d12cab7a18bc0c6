"""``--db -`` (re-probe reenv31 of 161b718, which refused ``--parquet -``): a DuckDB store
named '-' was made in the current directory, 'run r1 recorded in -', exit 0, and ``runs --db -``
offered 'kvtrace replay TRACE --db -' to make one. '-' is never stdin or stdout here (README);
one line at --db, nothing written; ``./-`` names a file of that name."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.support import assert_one_line, run

DATA = Path(__file__).resolve().parents[1] / "data"
TRACE = str(DATA / "mooncake_synthetic_trace.jsonl")
CACHE_ONLY = ["--mode", "cache-only", "--limit", "2"]


@pytest.mark.parametrize("argv", [
    ["replay", TRACE, *CACHE_ONLY],
    ["sweep", TRACE, *CACHE_ONLY, "--param", "capacity_blocks=10,20"],
    ["demo"],
    ["runs"],
    ["diff", "r1", "r2"],
    ["export", "--run", "r1", "--parquet", "out"],
    ["dashboard"],
    ["collect", "--port", "0"],
])
def test_a_dash_store_is_refused(tmp_path, capsys, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    code, out, err = run([*argv, "--db", "-"], capsys)
    assert_one_line(code, err, "--db: -: not stdin or stdout", "./-")
    assert not out and list(tmp_path.iterdir()) == []


def test_dot_slash_dash_is_a_store(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(["replay", TRACE, *CACHE_ONLY, "--db", "./-"], capsys)
    assert code == 0, err
    code, out, err = run(["runs", "--db", "./-", "--json"], capsys)
    assert code == 0 and '"r1"' in out, err
