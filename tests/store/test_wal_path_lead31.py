"""One rule for where DuckDB 2.0.1 keeps a store's write-ahead log (store.backend.wal_path):
``<store>.wal``, but with ``.wal`` before the first ``?`` of the store's real path. Three
places said ``<store>.wal`` for every name: the demo deleted a user's file named
``d?x.duckdb.wal`` as it replaced ``d?x.duckdb`` (leaving the store's real old log in
place), and ``c.duckdb?x.wal`` was refused as the log of the store ``c.duckdb?x``, whose
log is ``c.duckdb.wal?x``."""

from __future__ import annotations

import os
from pathlib import Path

from kvtrace.compare import demo
from kvtrace.errors import wal_path
from kvtrace.store.backend import duckdb_path_problem
from kvtrace.store.writer import Store


def test_the_log_of_a_name_with_a_question_mark_is_before_it(tmp_path: Path) -> None:
    assert wal_path(str(tmp_path / "s.duckdb")) == str(tmp_path / "s.duckdb") + ".wal"
    assert wal_path(str(tmp_path / "a?b.duckdb")) == os.path.realpath(tmp_path) + "/a.wal?b.duckdb"


def test_a_demo_replacing_a_store_keeps_a_users_file_at_its_plain_log_name(tmp_path: Path) -> None:
    target, built = str(tmp_path / "d?x.duckdb"), str(tmp_path / "built.duckdb")
    for path in (target, built):
        Store.open(path).close()
    notes = Path(target + ".wal")
    notes.write_text("notes")
    Path(wal_path(target)).write_bytes(b"")  # (the old store's own log: it goes)
    demo._replace(built, target)
    assert notes.read_text() == "notes" and not os.path.exists(wal_path(target))


def test_a_name_ending_in_wal_beside_a_question_mark_store_is_no_log(tmp_path: Path) -> None:
    Store.open(str(tmp_path / "c.duckdb?x")).close()
    assert duckdb_path_problem(str(tmp_path / "c.duckdb?x.wal"), missing=None) is None
    Store.open(str(tmp_path / "c.duckdb?x.wal")).close()  # (a store of its own, the other one intact)
    assert Store.open(str(tmp_path / "c.duckdb?x")).close() is None
