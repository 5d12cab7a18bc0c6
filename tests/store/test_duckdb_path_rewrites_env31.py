"""Paths DuckDB 2.0.1 rewrites before it opens them (probe env31): a leading '~' is the home
folder joined as text, and every '\\' is a '/'. kvtrace checked the path as named and DuckDB
opened another file: a store written beside the home folder, or into a/b/ for a\\b/, then
"no such database file" when kvtrace read back the one it had named. Refused first, in one
line naming the file DuckDB would open, for reading and writing; nothing written."""

from __future__ import annotations

import os
from pathlib import Path

import duckdb
import pytest

from tests.cli.support import assert_one_line, run

DATA = Path(__file__).resolve().parents[1] / "data"
TRACE = str(DATA / "mooncake_synthetic_trace.jsonl")
CACHE_ONLY = ["--mode", "cache-only", "--limit", "3"]


def test_duckdb_still_rewrites_these_paths(tmp_path, monkeypatch):
    """What the refusals stand on: if a DuckDB upgrade stops rewriting, they can go."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "b").mkdir()
    duckdb.connect("a\\b.duckdb").close()
    assert (tmp_path / "a" / "b.duckdb").exists() and not (tmp_path / "a\\b.duckdb").exists()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    duckdb.connect("~x.duckdb").close()
    assert (tmp_path / "homex.duckdb").exists() and not (tmp_path / "~x.duckdb").exists()


@pytest.mark.parametrize("command", ["replay", "runs"])
def test_a_backslash_is_refused(tmp_path, capsys, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a\\b").mkdir()
    (tmp_path / "a" / "b").mkdir(parents=True)
    db = "a\\b/s.duckdb"
    if command == "runs":  # (a store there, as named: DuckDB read a/b/s.duckdb instead)
        duckdb.connect(str(tmp_path / "a" / "b" / "s.duckdb")).close()
        (tmp_path / db).write_bytes((tmp_path / "a" / "b" / "s.duckdb").read_bytes())
    argv = ["replay", TRACE, *CACHE_ONLY, "--db", db] if command == "replay" else ["runs", "--db", db]
    code, out, err = run(argv, capsys)
    assert_one_line(code, err, db, "a '\\' in a path as '/'", str(tmp_path / "a" / "b" / "s.duckdb"))
    assert not out
    if command == "replay":
        assert os.listdir(tmp_path / "a" / "b") == [] and os.listdir(tmp_path / "a\\b") == []


@pytest.mark.parametrize("db", ["~/s.duckdb", "~x.duckdb"])
def test_a_leading_tilde_is_refused(tmp_path, capsys, monkeypatch, db):
    """`--db=~/s.duckdb` (no shell expands a ~ after '='), with a folder named ~ here."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "~").mkdir()
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    code, _, err = run(["replay", TRACE, *CACHE_ONLY, f"--db={db}"], capsys)
    assert_one_line(code, err, "a leading '~' as the home folder", str(home) + db[1:], f"./{db}")
    assert os.listdir(home) == [] and os.listdir(tmp_path / "~") == [] and not (tmp_path / "homex.duckdb").exists()
    code, _, err = run(["replay", TRACE, *CACHE_ONLY, "--db", f"./{db}"], capsys)  # (the way out)
    assert code == 0, err
    assert (tmp_path / db).is_file()


def test_the_store_api_refuses_them_too(tmp_path, monkeypatch):
    from kvtrace.store.connection import read_connection, write_connection
    from kvtrace.store.errors import StoreError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(StoreError, match="Windows separator"), write_connection("x\\y.duckdb"):
        pass
    assert os.listdir(tmp_path) == []
    duckdb.connect(str(tmp_path / "~x.duckdb")).close()  # (a file of that name here: DuckDB read $HOME + x.duckdb)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with pytest.raises(StoreError, match="home folder"), read_connection("~x.duckdb"):
        pass
