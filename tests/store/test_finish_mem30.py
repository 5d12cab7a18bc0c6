"""A finish's derived rows never pass through Python (memory at scale, session 30).

``finish_run`` computed every derived table into Arrow on its read-only connection and
inserted the Arrow tables on its write connection: a 160,000-request cache-only run's
3.4M evicted blocks took the process to 2.8 GB, DuckDB sorting them in memory beside the
Arrow copy. The rows now go from one connection to the other as Parquet files DuckDB
writes and reads, in a scratch folder beside the store, within a memory limit past which
DuckDB spills. What is stored is what the spans give, as before.
"""

from __future__ import annotations

import os
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest

from kvtrace.store import derived
from kvtrace.store.writer import Store


@pytest.fixture
def replayed(small_replay) -> tuple[Path, str]:
    return small_replay


def _scratch(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith(derived.SCRATCH_PREFIX))


def _rows(con, table: str, run_id: str) -> list[tuple]:
    return con.execute(f"SELECT * FROM {table} WHERE run_id = ? ORDER BY ALL", [run_id]).fetchall()


def test_compute_hands_the_sql_tables_over_as_parquet_files_not_arrow(replayed):
    db, run_id = replayed
    with duckdb.connect(str(db), read_only=True) as con:
        rows = derived.compute(con, run_id)
        try:
            assert set(rows) == set(derived.TABLES)
            files = {name: value for name, value in rows.items() if isinstance(value, str)}
            # every table but latency_cdf (its percentiles are numpy's, computed in Python)
            assert set(files) == set(derived.TABLES) - {"latency_cdf"}
            for name, path in files.items():
                assert Path(path).parent == Path(rows.folder) and Path(rows.folder).parent == db.parent
                assert pq.read_table(path).num_rows == len(_rows(con, name, run_id)), name
            evicted = pq.read_table(files["evicted_blocks"]).num_rows
            assert evicted > 0
        finally:
            rows.close()
        assert not os.path.exists(rows.folder)


def test_a_finish_stores_the_rows_the_spans_give_and_leaves_no_scratch(replayed):
    db, run_id = replayed
    assert _scratch(db.parent) == []
    with duckdb.connect(str(db), read_only=True) as con:
        stored = {t: _rows(con, t, run_id) for t in derived.TABLES}
        for table in ("evicted_blocks", "miss_attribution", "block_values", "evict_counts", "span_stats"):
            live = con.execute(f"SELECT * FROM ({derived.live_sql(table)}) ORDER BY ALL", {"run_id": run_id}).fetchall()
            assert stored[table] == live, table
    store = Store.open(db)
    try:
        store.refresh_run(run_id)  # (the finish again: the same rows)
    finally:
        store.close()
    with duckdb.connect(str(db), read_only=True) as con:
        assert {t: _rows(con, t, run_id) for t in derived.TABLES} == stored
    assert _scratch(db.parent) == []
    assert not os.path.exists(f"{db}.tmp")  # (DuckDB's spill folder, removed by DuckDB)


class _Recording:
    """A connection that records every statement run on it."""

    def __init__(self, con):
        self.con, self.statements = con, []

    def execute(self, sql, *args):
        self.statements.append(sql)
        return self.con.execute(sql, *args)

    def sql(self, sql, **kwargs):
        self.statements.append(sql)
        return self.con.sql(sql, **kwargs)

    def register(self, name, table):
        return self.con.register(name, table)

    def unregister(self, name):
        return self.con.unregister(name)


def test_the_rows_are_copied_by_duckdb_within_the_limit_and_the_connection_keeps_its_own(replayed):
    db, run_id = replayed
    with duckdb.connect(str(db)) as con:  # (a write connection goes on after materialise)
        before = con.execute("SELECT current_setting('memory_limit')").fetchone()
        recording = _Recording(con)
        con.execute("BEGIN")
        rows = derived.compute(recording, run_id)
        derived.store(recording, run_id, rows)
        con.execute("COMMIT")
        assert not os.path.exists(rows.folder)
        assert con.execute("SELECT current_setting('memory_limit')").fetchone() == before
    said = recording.statements
    copies = [i for i, s in enumerate(said) if s.startswith("COPY (")]
    limit = said.index(f"SET memory_limit = '{derived.FINISH_MEMORY_LIMIT}'")
    assert len(copies) == len(derived.TABLES) - 1  # (all but latency_cdf's, from numpy)
    assert limit < copies[0] and said.index("RESET memory_limit") > copies[-1]
    inserts = [s for s in said if s.startswith("INSERT INTO")]
    assert sum("read_parquet(" in s for s in inserts) == len(copies) and len(inserts) == len(derived.TABLES)


def test_a_scratch_folder_a_killed_finish_left_is_removed_by_the_next(replayed):
    db, run_id = replayed
    dead = os.fork()
    if dead == 0:  # (a pid no process has once it is reaped)
        os._exit(0)
    os.waitpid(dead, 0)
    left = db.parent / f"{derived.SCRATCH_PREFIX}{dead}-abc"
    left.mkdir()
    (left / "evicted_blocks.parquet").write_bytes(b"half")
    alive = db.parent / f"{derived.SCRATCH_PREFIX}{os.getppid()}-xyz"  # (a live process's: kept)
    alive.mkdir()
    store = Store.open(db)
    try:
        store.refresh_run(run_id)
    finally:
        store.close()
    assert _scratch(db.parent) == [alive.name]
