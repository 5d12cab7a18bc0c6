"""Stores probed by hand (session 21): what a user's or another tool's edit leaves in a
DuckDB store, given to the real CLI."""

from __future__ import annotations

import hashlib
import os

import duckdb
import pytest

from kvtrace.store import Store, StoreError
from tests.cli.support import assert_one_line
from tests.cli.support import run as kvtrace
from tests.conftest import MOONCAKE
from tests.support.permissions import read_only


def _meta_rows(db, *rows: tuple[str, str]) -> None:
    """``kvtrace_meta`` rebuilt without its primary key, with ``rows`` added."""
    con = duckdb.connect(str(db))
    con.execute("CREATE TABLE m AS SELECT * FROM kvtrace_meta")
    con.execute("DROP TABLE kvtrace_meta")
    con.execute("CREATE TABLE kvtrace_meta AS SELECT * FROM m")
    con.execute("DROP TABLE m")
    con.executemany("INSERT INTO kvtrace_meta VALUES (?, ?)", [list(r) for r in rows])
    con.close()


def test_a_meta_key_given_twice_with_two_values_is_a_damaged_store(scenario_db, capsys):
    """Version 3 and 4 both declared: the last row read won (4: refused as newer; with the
    rows the other way round, 3: read as whole), never said to be ambiguous."""
    db, _ = scenario_db
    _meta_rows(db, ("schema_version", "4"))
    for argv in (["runs", "--db", str(db)], ["export", "--db", str(db), "--run", "sc", "--parquet", str(db) + "-x"]):
        code, _, err = kvtrace(argv, capsys)
        assert_one_line(code, err, str(db), "damaged kvtrace store", "schema_version is given twice", "'3'", "'4'")


def test_a_meta_row_given_twice_alike_is_read(scenario_db, capsys):
    """The same value twice (two writers that made one ClickHouse store at once) is one."""
    db, run_id = scenario_db
    _meta_rows(db, ("schema_version", "3"), ("magic", "kvtrace-store"))
    code, out, err = kvtrace(["runs", "--db", str(db), "--json"], capsys)
    assert code == 0, err
    assert f'"run_id": "{run_id}"' in out



def test_a_read_only_store_is_not_written_into(scenario_db, capsys, monkeypatch):
    """A store made read-only (0444) on purpose: root's open wrote a new run into it (the
    mode is no bar to root), where anyone else's was refused. Refused for all, read still."""
    db, run_id = scenario_db
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    with read_only(monkeypatch, db):
        code, _, err = kvtrace(["replay", str(MOONCAKE), "--limit", "3", "--mode", "cache-only", "--db", str(db)],
                               capsys)
        assert_one_line(code, err, str(db), "cannot write", "Permission denied", "read-only")
        with pytest.raises(StoreError, match="read-only"):
            Store.open(db)
        assert hashlib.sha256(db.read_bytes()).hexdigest() == before and not os.path.exists(f"{db}.wal")
        code, out, err = kvtrace(["runs", "--db", str(db), "--json"], capsys)
        assert code == 0 and f'"run_id": "{run_id}"' in out, err
