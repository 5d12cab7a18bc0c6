"""An output file at the write-ahead log's name of a DuckDB database with a '?' in its file
name (re-probe reenv31): DuckDB puts '.wal' before the '?' (a?b.duckdb's log is a.wal?b.duckdb),
where the output check looked only at <db>.wal. `generate -o a.wal?b.duckdb` beside the store
a?b.duckdb wrote the trace, exit 0, and the store's next writer took it for its log and
deleted it. Refused first, one line, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.support import assert_one_line, run

DATA = Path(__file__).resolve().parents[1] / "data"
TRACE = str(DATA / "mooncake_synthetic_trace.jsonl")
CACHE_ONLY = ["--mode", "cache-only", "--limit", "2"]


@pytest.mark.parametrize("argv", [
    ["generate", "chat", "--requests", "3", "-o"],
    ["convert", TRACE, "--limit", "2", "-o"],
])
def test_an_output_at_a_stores_log_name_is_refused(tmp_path, capsys, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(["replay", TRACE, *CACHE_ONLY, "--db", "a?b.duckdb"], capsys)
    assert code == 0, err
    code, out, err = run([*argv, "a.wal?b.duckdb"], capsys)
    assert_one_line(code, err, "a.wal?b.duckdb: is the write-ahead log", str(tmp_path / "a?b.duckdb"))
    assert not out and sorted(p.name for p in tmp_path.iterdir()) == ["a?b.duckdb"]


def test_the_capture_store_to_be_made_counts(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(["capture", "vllm", "--endpoint", "tcp://127.0.0.1:1", "--duration", "1",
                        "--db", "q?z.duckdb", "--trace-out", "q.wal?z.duckdb"], capsys)
    assert_one_line(code, err, "q.wal?z.duckdb: is the write-ahead log")
    assert list(tmp_path.iterdir()) == []


def test_such_a_name_without_a_database_is_written(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(["generate", "chat", "--requests", "3", "-o", "c.wal?b.jsonl"], capsys)
    assert code == 0, err
    assert (tmp_path / "c.wal?b.jsonl").is_file()
