"""A '?' in a DuckDB store's file name (re-probe reenv31 of 22ff4bd): DuckDB 2.0.1 puts the
write-ahead log's '.wal' before the first '?' of the path (a?b.duckdb's log is a.wal?b.duckdb),
not at the end, where kvtrace's check of a store's log name looked. A store named a.wal?b.duckdb
was taken for a?b.duckdb's log by the next writer of a?b.duckdb, replayed and deleted, its runs
lost, exit 0. Refused first, in one line; a '?' in a file name otherwise keeps working."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest

from tests.cli.support import assert_one_line, run

DATA = Path(__file__).resolve().parents[1] / "data"
TRACE = str(DATA / "mooncake_synthetic_trace.jsonl")
CACHE_ONLY = ["--mode", "cache-only", "--limit", "3"]


def test_duckdb_still_names_the_log_so(tmp_path, monkeypatch):
    """What the refusals stand on: if a DuckDB upgrade names the log otherwise, they can go."""
    monkeypatch.chdir(tmp_path)
    con = duckdb.connect("a?b.duckdb")
    con.execute("SET checkpoint_threshold='1TB'")
    con.execute("CREATE TABLE t(a INT)")
    assert (tmp_path / "a.wal?b.duckdb").exists() and not (tmp_path / "a?b.duckdb.wal").exists()
    con.close()


def test_a_store_named_as_the_log_is_not_deleted(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(["replay", TRACE, *CACHE_ONLY, "--db", "a.wal?b.duckdb"], capsys)
    assert code == 0, err
    kept = (tmp_path / "a.wal?b.duckdb").read_bytes()
    code, out, err = run(["replay", TRACE, *CACHE_ONLY, "--db", "a?b.duckdb"], capsys)
    assert_one_line(code, err, "a?b.duckdb", str(tmp_path / "a.wal?b.duckdb"), "DuckDB database of its own")
    assert not out and (tmp_path / "a.wal?b.duckdb").read_bytes() == kept and not (tmp_path / "a?b.duckdb").exists()
    code, out, _ = run(["runs", "--db", "a.wal?b.duckdb", "--json"], capsys)
    assert code == 0 and '"r1"' in out


def test_a_store_is_not_made_under_another_ones_log_name(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(["replay", TRACE, *CACHE_ONLY, "--db", "a?b.duckdb"], capsys)
    assert code == 0, err
    code, _, err = run(["replay", TRACE, *CACHE_ONLY, "--db", "a.wal?b.duckdb"], capsys)
    assert_one_line(code, err, "write-ahead log's name of the store", str(tmp_path / "a?b.duckdb"))
    assert not (tmp_path / "a.wal?b.duckdb").exists()


def test_the_store_api_refuses_it_too(tmp_path, monkeypatch):
    from kvtrace.store.connection import write_connection
    from kvtrace.store.errors import StoreError

    monkeypatch.chdir(tmp_path)
    duckdb.connect("x.wal?y.duckdb").close()
    with pytest.raises(StoreError, match="of its own"), write_connection("x?y.duckdb"):
        pass
    assert not (tmp_path / "x?y.duckdb").exists() and (tmp_path / "x.wal?y.duckdb").exists()


@pytest.mark.parametrize("db", ["a?b.duckdb", "s p#&é?.duckdb", "q.duckdb?x"])
def test_a_question_mark_in_a_name_still_works(tmp_path, capsys, monkeypatch, db):
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        code, _, err = run(["replay", TRACE, *CACHE_ONLY, "--db", db], capsys)
        assert code == 0, err
    code, out, err = run(["runs", "--db", db, "--json"], capsys)
    assert code == 0 and '"r2"' in out, err
