"""A DuckDB store whose folder's name holds a '?' (probe env31): DuckDB puts the store's
write-ahead log before the first '?' of its real path, in another folder. Refused first, in
one line, before anything is written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.cli.support import assert_one_line, run

DATA = Path(__file__).resolve().parents[1] / "data"
TRACE = str(DATA / "mooncake_synthetic_trace.jsonl")
CACHE_ONLY = ["--mode", "cache-only", "--limit", "3"]


@pytest.mark.parametrize("argv", [
    ["replay", TRACE, *CACHE_ONLY],
    ["sweep", TRACE, *CACHE_ONLY, "--param", "capacity_blocks=2,4"],
    ["demo"],
])
def test_a_question_mark_in_the_stores_folder_is_refused_first(tmp_path, capsys, argv):
    """DuckDB 2.0.1 wrote the log of q?x/s.duckdb at q.wal?x/s.duckdb: every commit failed
    ('cannot write: .../q.wal?x/s.duckdb: No such file or directory') after the store file
    was made, an empty database a later read called a killed writer's; the demo said so of its
    scratch store's path after its progress bar started."""
    folder = tmp_path / "q?x"
    folder.mkdir()
    db = folder / "s.duckdb"
    code, out, err = run([*argv, "--db", str(db)], capsys)
    line = assert_one_line(code, err, str(db), "'?'", str(tmp_path / "q.wal?x" / "s.duckdb"))
    assert "scratch" not in line and ".kvtrace-demo" not in line
    assert not out
    assert os.listdir(folder) == [] and not (tmp_path / "q.wal?x").exists()


def test_a_link_into_a_folder_with_a_question_mark_is_refused(tmp_path, capsys):
    """DuckDB follows the link: its real path's '?' is the one that counts."""
    folder = tmp_path / "a?b"
    folder.mkdir()
    link = tmp_path / "link.duckdb"
    link.symlink_to(folder / "s.duckdb")
    code, _, err = run(["replay", TRACE, *CACHE_ONLY, "--db", str(link)], capsys)
    assert_one_line(code, err, str(link), str(tmp_path / "a.wal?b" / "s.duckdb"))
    assert os.listdir(folder) == []


def test_a_question_mark_in_the_file_name_alone_still_records(tmp_path, capsys):
    """Its log stays beside it (what?.duckdb's at what.wal?.duckdb), read back by DuckDB: kept working."""
    db = tmp_path / "what?.duckdb"
    code, _, err = run(["replay", TRACE, *CACHE_ONLY, "--db", str(db)], capsys)
    assert code == 0, err
    code, out, err = run(["runs", "--db", str(db), "--json"], capsys)
    assert code == 0 and '"r1"' in out, err


def test_the_store_api_refuses_a_write_there_too(tmp_path):
    from kvtrace.store.connection import write_connection
    from kvtrace.store.errors import StoreError

    folder = tmp_path / "q?x"
    folder.mkdir()
    with pytest.raises(StoreError, match=r"a '\?' in its folder"), write_connection(folder / "s.duckdb"):
        pass
    assert os.listdir(folder) == []
