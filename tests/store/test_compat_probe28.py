"""Probe 28 (compat): stores written by older kvtraces, and one from a newer schema, as
today's kvtrace reads, appends to, exports or refuses them."""

from __future__ import annotations

import duckdb
import pyarrow.parquet as pq
import pytest

from kvtrace.store.schema import META_TABLE, SCHEMA_VERSION
from tests.cli.support import assert_one_line
from tests.cli.support import run as kvtrace


@pytest.fixture(scope="module")
def engine_store(tmp_path_factory) -> bytes:
    """The bytes of a store holding one engine run of 8 requests, r1."""
    from kvtrace.replay.run import RunSpec, run_replay

    db = tmp_path_factory.mktemp("engine") / "e.duckdb"
    run_replay(RunSpec("gen:mixed", limit=8, content=False), db=db)
    return db.read_bytes()


def _store(tmp_path, data: bytes, name: str, *sql: str):
    db = tmp_path / name
    db.write_bytes(data)
    con = duckdb.connect(str(db))
    for stmt in sql:
        con.execute(stmt)
    con.close()
    return db


def test_an_export_of_a_store_from_before_time_offset_ns_has_todays_columns(tmp_path, engine_store, capsys):
    """A version 3 store a kvtrace of 2026-12-01 wrote has no runs.time_offset_ns (nor
    span_stats' extent): the writer adds them (0 for the runs already there) when it opens
    one, and every reader does without. Its export wrote runs.parquet without the column, a
    file of another schema than every other store's, and than the same store's once a
    replay had upgraded it."""
    db = _store(tmp_path, engine_store, "old.duckdb", "ALTER TABLE runs DROP COLUMN time_offset_ns",
                "ALTER TABLE span_stats DROP COLUMN start_ns", "ALTER TABLE span_stats DROP COLUMN end_ns")
    code, _, err = kvtrace(["export", "--run", "r1", "--db", str(db), "--parquet", str(tmp_path / "before")], capsys)
    assert code == 0, err
    before = pq.read_table(tmp_path / "before" / "runs.parquet")
    current = tmp_path / "current.duckdb"
    current.write_bytes(engine_store)
    code, _, err = kvtrace(["export", "--run", "r1", "--db", str(current), "--parquet", str(tmp_path / "now")], capsys)
    assert code == 0, err
    assert before.schema.equals(pq.read_schema(tmp_path / "now" / "runs.parquet"))
    assert before.column("time_offset_ns").to_pylist() == [0]
    # the same file once a writer of today has upgraded the store (its ALTER's DEFAULT 0)
    from kvtrace.store import Store

    Store.open(db).close()
    code, _, err = kvtrace(["export", "--run", "r1", "--db", str(db), "--parquet", str(tmp_path / "after")], capsys)
    assert code == 0, err
    assert pq.read_table(tmp_path / "after" / "runs.parquet").equals(before)


@pytest.mark.parametrize("argv", [
    ["runs"], ["diff", "r1", "r1"], ["replay", "gen:mixed", "--limit", "2", "--no-content"],
    ["export", "--run", "r1", "--parquet", "{tmp}/out"],
])
def test_a_store_of_a_newer_schema_is_refused_saying_what_to_do_and_left_untouched(tmp_path, engine_store, capsys,
                                                                                   argv):
    """The refusal of an older store says what to do (read it with the kvtrace that wrote
    it, write to a new file); a newer one's said only that it was newer."""
    newer = SCHEMA_VERSION + 1
    db = _store(tmp_path, engine_store, "new.duckdb",
                f"UPDATE {META_TABLE} SET value = '{newer}' WHERE key = 'schema_version'")
    data = db.read_bytes()
    args = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    code, _, err = kvtrace([*args, "--db", str(db)], capsys)
    assert_one_line(code, err, str(db), f"store schema version {newer} is newer than this kvtrace's ({SCHEMA_VERSION})",
                    "upgrade")
    assert db.read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.duckdb"]  # (no WAL, lock or export left)


@pytest.mark.parametrize("argv", [["runs"], ["replay", "gen:mixed", "--limit", "2", "--no-content"]])
def test_a_store_without_its_schema_version_row_is_damaged_not_old(tmp_path, engine_store, capsys, argv):
    """Every kvtrace writes the version row in the insert that writes the magic. A store
    without it was taken for "version 0": listed as an old store with its layout unchecked,
    and refused for appending as one that "predates this kvtrace's (3)"."""
    db = _store(tmp_path, engine_store, "s.duckdb", f"DELETE FROM {META_TABLE} WHERE key = 'schema_version'")
    data = db.read_bytes()
    code, _, err = kvtrace([*argv, "--db", str(db)], capsys)
    line = assert_one_line(code, err, str(db), "damaged kvtrace store", "no schema_version row")
    assert "predates" not in line
    assert db.read_bytes() == data


def test_an_older_stores_retired_tables_are_kvtraces_own_not_a_users(tmp_path, engine_store):
    """Version 1 and 2 stores kept latency percentiles in latency_quantiles (version 3:
    latency_cdf). Every store those versions wrote holds it, and it was listed as a user's
    own table: ``kvtrace demo`` refused to replace a real version 2 demo store ("holds 1
    table(s) or view(s) that are not kvtrace's (e.g. 'main.latency_quantiles')"), which a
    version number changed by hand, without the table, never showed."""
    from kvtrace.compare.demo import DEMO_TRACE, _demo_target
    from kvtrace.store.connection import check_store, read_connection
    from kvtrace.store.layout import foreign_relations

    quantiles = "CREATE TABLE latency_quantiles (run_id VARCHAR, metric VARCHAR, q DOUBLE, value_ns DOUBLE)"
    db = _store(tmp_path, engine_store, "v2.duckdb",
                f"UPDATE {META_TABLE} SET value = '2' WHERE key = 'schema_version'", "DROP TABLE latency_cdf",
                quantiles, f"UPDATE runs SET name = 'demo: ' || run_id, trace_source = '{DEMO_TRACE}'")
    with read_connection(db) as con:
        assert foreign_relations(con, check_store(con, str(db))) == []
    assert _demo_target(str(db)) == str(db)  # (an earlier demo store: replaced, not refused)
    # in a store of today's version the table is no kvtrace's: a user's own, kept from the demo
    current = _store(tmp_path, engine_store, "v3.duckdb", quantiles)
    with read_connection(current) as con:
        assert foreign_relations(con, check_store(con, str(current))) == ["main.latency_quantiles"]
