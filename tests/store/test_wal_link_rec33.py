"""A ``<store>.wal`` that is no file of DuckDB's own beside a store (4c432e7 refused one with no
database beside it): a symbolic link had DuckDB write the store's log through it, into the file
it names (a user's notes overwritten with 120 kB of log), and then delete the link at its
checkpoint; a dangling one left the log behind it for good; a directory was DuckDB's own
error. Each is refused in one line, exit 2, the link and what it names kept, the store as it was."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtrace.store import Store, read
from kvtrace.store.errors import StoreError

TRACE = Path(__file__).resolve().parents[1] / "data" / "mooncake_synthetic_trace.jsonl"


def _replay(db: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtrace.cli", "replay", str(TRACE), "--limit", "2", "--mode",
                           "cache-only", "--capacity-blocks", "50", "--db", str(db)],
                          capture_output=True, text=True, check=False)


@pytest.fixture
def store(tmp_path) -> Path:
    db = tmp_path / "s.duckdb"
    with Store.open(str(db)) as s:
        s.finish_run(s.create_run("a"), status="complete")
    return db


@pytest.mark.parametrize("kind", ["a link to a file", "a dangling link", "a directory"])
def test_a_wal_that_is_no_file_is_refused_and_kept(tmp_path, store, kind):
    wal = tmp_path / "s.duckdb.wal"
    notes = tmp_path / "notes.txt"
    if kind == "a directory":
        wal.mkdir()
    else:
        if kind == "a link to a file":
            notes.write_text("my notes\n")
        wal.symlink_to(notes)
    with pytest.raises(StoreError, match=r"s\.duckdb\.wal is (a symbolic link|not a file), where DuckDB keeps"):
        Store.open(str(store))
    out = _replay(store)
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("kvtrace: error:") and "s.duckdb.wal is " in line
    assert os.path.lexists(wal) and wal.is_symlink() == (kind != "a directory")
    assert notes.read_text() == "my notes\n" if kind == "a link to a file" else not notes.exists()
    if kind == "a directory":  # (which no reader reads past either: DuckDB's one line)
        wal.rmdir()
    assert read.runs(str(store))["run_id"].to_list() == ["r1"]
