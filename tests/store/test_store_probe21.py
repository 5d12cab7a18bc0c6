"""Stores probed by hand (session 21): what a user's or another tool's edit leaves in a
DuckDB store, given to the real CLI."""

from __future__ import annotations

import hashlib
import json
import os

import duckdb
import pytest

from kvtrace.store import Store, StoreError, read
from tests.cli.support import assert_one_line
from tests.cli.support import run as kvtrace
from tests.conftest import MOONCAKE
from tests.support.permissions import read_only


@pytest.fixture(scope="module")
def engine_store(tmp_path_factory) -> bytes:
    """The bytes of a store holding two engine runs of 8 requests, r1 and r2."""
    from kvtrace.replay.run import RunSpec, run_replay

    db = tmp_path_factory.mktemp("engine") / "e.duckdb"
    for _ in range(2):
        run_replay(RunSpec("gen:mixed", limit=8, content=False), db=db)
    return db.read_bytes()


def _altered(tmp_path, data: bytes, *sql: str):
    tmp_path.mkdir(parents=True, exist_ok=True)
    db = tmp_path / "e.duckdb"
    db.write_bytes(data)
    con = duckdb.connect(str(db))
    for stmt in sql:
        con.execute(stmt)
    con.close()
    return db


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


HUGE = 2**63 - 1  # a count no kvtrace run holds: a sum of two overflows


def test_spans_whose_sums_overflow_are_a_damaged_store_not_a_traceback(tmp_path, engine_store):
    """A count near 2^63 in a run's spans (written by hand, or sent to a collector): the read
    API raised DuckDB's ConversionException or polars' InvalidOperationError, and a notebook or
    ``runs`` of an unfinished run showed a traceback."""
    db = _altered(tmp_path, engine_store, f"UPDATE spans_request SET num_prompt_tokens = {HUGE}, "
                                          f"first_token_ns = {HUGE} WHERE run_id = 'r2'")
    for name in ("hit_counters", "summary_from_spans", "itl_over_time"):
        with pytest.raises(StoreError, match=r"damaged kvtrace store: run r2's spans hold values") as err:
            getattr(read, name)(db, "r2")
        assert str(db) in str(err.value) and "\n" not in str(err.value)
    assert read.hit_counters(db, "r1")["requests"] == 8  # the other run reads as before


def test_runs_lists_an_unfinished_run_whose_spans_overflow_as_damaged(tmp_path, engine_store, capsys):
    """``runs`` reads an unfinished run's numbers from its spans: one that overflowed was a
    traceback, and no run of the store was listed. Listed ``damaged``, as a damaged record is."""
    db = _altered(tmp_path, engine_store, "UPDATE runs SET status = 'failed', summary = NULL WHERE run_id = 'r2'",
                  f"UPDATE spans_request SET num_prompt_tokens = {HUGE} WHERE run_id = 'r2'")
    code, out, err = kvtrace(["runs", "--db", str(db), "--json"], capsys)
    assert code == 0, err
    listed = {r["run_id"]: r for r in json.loads(out)["runs"]}
    assert listed["r1"]["status"] == "complete" and listed["r1"]["requests"] == 8
    assert listed["r2"]["status"] == "damaged" and "spans hold values" in listed["r2"]["damage"]
    code, out, err = kvtrace(["runs", "--db", str(db)], capsys)
    assert code == 0 and "Traceback" not in err and "spans hold values" in err, err
    for argv in (["diff", "r1", "r2", "--db", str(db)], ["export", "--db", str(db), "--run", "r2", "--parquet",
                                                           str(tmp_path / "x")]):
        code, _, err = kvtrace(argv, capsys)
        assert_one_line(code, err, str(db), "damaged kvtrace store")


def test_itl_over_time_skips_a_null_gap(tmp_path, engine_store):
    """A NULL in a request's itl_ns (no kvtrace run holds one): ``int()`` of its NaN window
    was a ValueError; the other gaps are read."""
    db = _altered(tmp_path, engine_store)
    whole = read.itl_over_time(db, "r2")["gaps"].sum()
    con = duckdb.connect(str(db))
    one = con.execute("SELECT request_id, len(itl_ns) FROM spans_request WHERE run_id = 'r2' AND len(itl_ns) > 1 "
                      "ORDER BY request_id LIMIT 1").fetchone()
    assert one is not None
    con.execute("UPDATE spans_request SET itl_ns = list_prepend(NULL, itl_ns[2:]) WHERE run_id = 'r2' "
                "AND request_id = ?", [one[0]])
    con.close()
    assert read.itl_over_time(db, "r2")["gaps"].sum() == whole - 1


def test_export_keeps_its_one_schema_beside_a_column_added_by_hand(tmp_path, engine_store):
    """A column added to ``runs`` or ``evicted_blocks`` by hand (or another tool) was exported
    too: that store's files had another schema than every other store's."""
    import pyarrow.parquet as pq

    from kvtrace.store import export_parquet

    plain = export_parquet(_altered(tmp_path / "a", engine_store), "r2", tmp_path / "plain")
    db = _altered(tmp_path / "b", engine_store, "ALTER TABLE runs ADD COLUMN note VARCHAR",
                  "ALTER TABLE evicted_blocks ADD COLUMN extra INTEGER")
    extra = export_parquet(db, "r2", tmp_path / "extra")
    for table, path in plain.items():
        assert pq.read_schema(extra[table]) == pq.read_schema(path), table
        assert pq.read_table(extra[table]).num_rows == pq.read_table(path).num_rows, table


def test_export_writes_the_declared_column_order_of_a_table_rebuilt_in_another(tmp_path, engine_store):
    """``runs`` rebuilt by hand with its columns in another order exported them in that order."""
    import pyarrow.parquet as pq

    from kvtrace.store import export_parquet

    plain = export_parquet(_altered(tmp_path / "a", engine_store), "r2", tmp_path / "plain")
    db = _altered(tmp_path / "b", engine_store,
                  "CREATE TABLE runs_r AS SELECT time_offset_ns, * EXCLUDE (time_offset_ns) FROM runs",
                  "DROP TABLE runs", "ALTER TABLE runs_r RENAME TO runs", "ALTER TABLE runs ADD PRIMARY KEY (run_id)")
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("SELECT * FROM runs LIMIT 0").description[0][0] == "time_offset_ns"
    moved = export_parquet(db, "r2", tmp_path / "moved")
    assert pq.read_schema(moved["runs"]) == pq.read_schema(plain["runs"])


def test_a_histogram_of_latencies_too_close_for_their_magnitude_is_one_bin(tmp_path, engine_store):
    """Every TTFT near 2^63 (written by hand): numpy's "Too many bins for data range" escaped."""
    db = _altered(tmp_path, engine_store, "UPDATE spans_request SET ttft_ns = 9223372036854775807 "
                                          "- (hash(request_id) % 5) WHERE run_id = 'r2'")
    hist = read.latency_histogram(db, "r2")
    assert hist["count"].sum() == read.latency_samples(db, "r2", "ttft").size > 0
