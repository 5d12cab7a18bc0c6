"""A file at ``<store>.wal`` with no database beside it: DuckDB, making the new store, took it
for the store's log and deleted it (a user's file lost without a word). Refused in one line,
exit 2, the file kept; an empty database file beside it is a new database too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvtrace.store import Store
from kvtrace.store.errors import StoreError

TRACE = Path(__file__).resolve().parents[1] / "data" / "mooncake_synthetic_trace.jsonl"


@pytest.mark.parametrize("empty_db", [False, True])
def test_a_lone_wal_is_kept_and_the_store_refused(tmp_path, empty_db):
    db = tmp_path / "x.duckdb"
    wal = tmp_path / "x.duckdb.wal"
    wal.write_text("my notes\n")
    if empty_db:
        db.touch()
    with pytest.raises(StoreError, match=r"x\.duckdb\.wal exists with no database beside it"):
        Store.open(str(db))
    assert wal.read_text() == "my notes\n"


def test_the_command_says_it_in_one_line_and_keeps_the_file(tmp_path):
    wal = tmp_path / "x.duckdb.wal"
    wal.write_text("my notes\n")
    out = subprocess.run([sys.executable, "-m", "kvtrace.cli", "replay", str(TRACE), "--limit", "2", "--mode",
                          "cache-only", "--capacity-blocks", "50", "--db", str(tmp_path / "x.duckdb")],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("kvtrace: error:") and "x.duckdb.wal exists with no database beside it" in line
    assert wal.read_text() == "my notes\n"
    assert not (tmp_path / "x.duckdb").exists()


def test_a_store_with_its_own_log_still_opens(tmp_path):
    """A store whose writer was killed keeps its log beside it: that one is DuckDB's to replay."""
    db = str(tmp_path / "s.duckdb")
    with Store.open(db) as store:
        store.create_run("a")
    script = """import duckdb, os, sys
con = duckdb.connect(sys.argv[1])
con.execute("PRAGMA disable_checkpoint_on_shutdown")
con.execute("INSERT INTO kvtrace_meta VALUES ('k', 'v')")
os._exit(0)
"""
    subprocess.run([sys.executable, "-c", script, db], check=True)
    assert (tmp_path / "s.duckdb.wal").exists()
    with Store.open(db) as store:
        assert store.has_run("r1")
