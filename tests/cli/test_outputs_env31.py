"""Outputs a shell hands a command (probe env31): ``export --parquet -`` made a folder named
``-`` (and wrote the export there, exit 0), where every ``-o`` refuses ``-`` as no file name a
user means."""

from __future__ import annotations

from pathlib import Path

from tests.cli.support import assert_one_line, run

DATA = Path(__file__).resolve().parents[1] / "data"
TRACE = str(DATA / "mooncake_synthetic_trace.jsonl")


def test_export_to_dash_is_refused(tmp_path, capsys, monkeypatch):
    db = str(tmp_path / "s.duckdb")
    code, _, err = run(["replay", TRACE, "--mode", "cache-only", "--limit", "3", "--db", db], capsys)
    assert code == 0, err
    monkeypatch.chdir(tmp_path)
    code, out, err = run(["export", "--db", db, "--run", "r1", "--parquet", "-"], capsys)
    assert_one_line(code, err, "--parquet: -: not stdout here")
    assert not out and not (tmp_path / "-").exists()
    code, out, err = run(["export", "--db", db, "--run", "r1", "--parquet", "./-"], capsys)  # (the way out)
    assert code == 0, err
    assert (tmp_path / "-" / "spans.parquet").is_file()
