"""A store's derived rows are trusted only where today's definitions built them.

Stores written before 2026-12-05 (6efd6bc) kept evictions paired with the next publish by
seq, which runs kind by kind within a batch: read with today's kvtrace, ``diff`` showed 12
evictions before a partial tail where the spans hold 1, beside the right figures of a new
run, and nothing said so. Such rows are stood in for here by rows edited by hand, in a store
whose ``derived_version`` row is taken away as those stores lack it.
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import polars as pl
import pyarrow.parquet as pq
import pytest

from kvtrace.replay.run import RunSpec, run_replay
from kvtrace.store import derived, read
from kvtrace.store.export import export_parquet


def _by_kind(db: Path, run_id: str) -> pl.DataFrame:
    return read.evictions_by_publish_kind(db, run_id).sort(pl.all())


@pytest.fixture
def store(small_replay) -> tuple[Path, str]:
    return small_replay


def _age(db: Path, version: str | None) -> None:
    """Rows no spans give (every eviction said to precede a partial tail), and the store's
    derived version as given (None: no row, as a store before the row kept none)."""
    with duckdb.connect(str(db)) as con:
        con.execute("UPDATE evict_counts SET publish_kind = 'partial_tail'")
        con.execute("UPDATE evicted_blocks SET next_publish_kind = 'partial_tail'")
        con.execute("DELETE FROM kvtrace_meta WHERE key = ?", [derived.DERIVED_VERSION_KEY])
        if version is not None:
            con.execute("INSERT INTO kvtrace_meta VALUES (?, ?)", [derived.DERIVED_VERSION_KEY, version])


def test_a_new_store_says_its_derived_rows_follow_todays_definitions(store):
    db, _ = store
    with duckdb.connect(str(db), read_only=True) as con:
        rows = dict(con.execute("SELECT key, value FROM kvtrace_meta").fetchall())
    assert derived.built_version(rows) == derived.DERIVED_VERSION


@pytest.mark.parametrize("version", [None, "1", "x", "99"])  # (99: a newer kvtrace's, trusted until probe 35)
def test_an_older_stores_derived_rows_are_read_from_its_spans(store, tmp_path, version):
    db, run_id = store
    truth = _by_kind(db, run_id)
    assert truth.height > 1 and set(truth["publish_kind"]) != {"partial_tail"}  # (the edit below shows)
    exported = pq.read_table(export_parquet(db, run_id, tmp_path / "before")["evicted_blocks"])
    _age(db, version)
    assert _by_kind(db, run_id).equals(truth)
    assert pq.read_table(export_parquet(db, run_id, tmp_path / "after")["evicted_blocks"]).equals(exported)


def test_rows_of_todays_definitions_are_read_as_stored(store):
    """(The check above can fail: a current store's rows are what its readers show.)"""
    db, run_id = store
    _age(db, str(derived.DERIVED_VERSION))
    assert set(_by_kind(db, run_id)["publish_kind"]) == {"partial_tail"}


def test_a_writer_appending_to_an_older_store_leaves_its_rows_read_from_the_spans(store):
    """No rebuild in place (one held a big store from every reader for half a minute): the
    store keeps its version, and its runs, old and new, are read from their spans."""
    db, run_id = store
    truth = _by_kind(db, run_id)
    _age(db, None)
    added = run_replay(RunSpec("gen:mixed", limit=40, content=False, capacity_blocks=64), db=db)
    with duckdb.connect(str(db), read_only=True) as con:
        rows = dict(con.execute("SELECT key, value FROM kvtrace_meta").fetchall())
    assert derived.DERIVED_VERSION_KEY not in rows
    assert _by_kind(db, run_id).equals(truth) and _by_kind(db, added.run_id).equals(truth)
