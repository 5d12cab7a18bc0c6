"""Parquet export round trip; one-line errors for bad, foreign or missing database files."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest

from kvtrace.errors import KVTraceError
from kvtrace.store import Store, StoreError, export_parquet, read
from tests.store.scenario import as_viewed, scenario_rows, scenario_table


def test_export_parquet_round_trip(scenario_db, tmp_path):
    db, run_id = scenario_db
    # a second run in the same store must not leak into the export
    store = Store.open(db)
    other = store.create_run("other")
    store.append_spans(scenario_table(scenario_rows()[:3]), run_id=other)
    store.finish_run(other)
    written = export_parquet(db, run_id, tmp_path / "out")
    assert sorted(written) == ["evicted_blocks", "runs", "spans"]
    spans = pq.read_table(written["spans"])
    expected = as_viewed(scenario_table())
    assert spans.num_rows == expected.num_rows
    assert set(spans.column("run_id").to_pylist()) == {run_id}
    for name in expected.column_names:
        assert spans.column(name).to_pylist() == expected.column(name).to_pylist(), name
    assert pq.read_table(written["runs"]).column("digest").to_pylist() == ["abc"]
    assert pq.read_table(written["evicted_blocks"]).num_rows == 3
    # the exported spans answer the same SQL as the store
    con = duckdb.connect()
    n = con.execute("SELECT count(*) FROM read_parquet(?) WHERE name = 'kvtrace.cache.lookup'",
                    [str(written["spans"])]).fetchall()[0][0]
    assert n == 6


def test_export_unknown_run(scenario_db, tmp_path):
    db, _ = scenario_db
    with pytest.raises(KVTraceError, match="no run with id 'zz'"):
        export_parquet(db, "zz", tmp_path / "out")


def test_export_parquet_refuses_to_replace_a_read_only_file(scenario_db, tmp_path, monkeypatch):
    """Each Parquet file is renamed into place: export_parquet itself (not only the CLI)
    replaced a 0444 spans.parquet."""
    from tests.support.permissions import read_only

    db, run_id = scenario_db
    out = tmp_path / "out"
    out.mkdir()
    kept = out / "spans.parquet"
    kept.write_text("keep me\n")
    with read_only(monkeypatch, kept), pytest.raises(StoreError, match=r"spans\.parquet: cannot write: Permission"):
        export_parquet(db, run_id, out)
    assert kept.read_text() == "keep me\n" and sorted(p.name for p in out.iterdir()) == ["spans.parquet"]


@pytest.mark.parametrize("side", [".wal", ".writer-waiting", ".reader-waiting", ".write-lock"])
def test_an_export_into_the_stores_own_files_is_refused(scenario_db, side):
    # an export into the store's write-ahead log made a directory there: the store no longer opened
    db, run_id = scenario_db
    with pytest.raises(StoreError, match=r"is the store .*'s own"):
        export_parquet(db, run_id, f"{db}{side}")
    assert not Path(f"{db}.wal").is_dir() and read.runs(db).height >= 1


@pytest.mark.parametrize("content", [b"this is not a database\n" * 100, b"", b"\x00" * 8192])
def test_garbage_file_is_a_one_line_error_naming_the_path(tmp_path, content):
    bad = tmp_path / "bad.duckdb"
    bad.write_bytes(content)
    for action in (lambda: read.runs(bad), lambda: Store.open(bad)):
        with pytest.raises(StoreError) as err:
            action()
        msg = str(err.value)
        assert msg.startswith(str(bad)) and "\n" not in msg
        assert isinstance(err.value, KVTraceError)


def test_foreign_duckdb_file_is_refused_and_left_alone(tmp_path):
    foreign = tmp_path / "foreign.duckdb"
    con = duckdb.connect(str(foreign))
    con.execute("CREATE TABLE invoices (id INTEGER)")
    con.close()
    with pytest.raises(StoreError, match="not a kvtrace store"):
        Store.open(foreign)
    with pytest.raises(StoreError, match="not a kvtrace store"):
        read.runs(foreign)
    con = duckdb.connect(str(foreign), read_only=True)
    assert [r[0] for r in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()] == ["invoices"]
    con.close()


def test_store_of_an_older_schema_is_not_appended_to(tmp_path):
    old = tmp_path / "v1.duckdb"
    with Store.open(old) as store:
        store.finish_run(store.create_run("kept"))
    con = duckdb.connect(str(old))
    con.execute("UPDATE kvtrace_meta SET value = '1' WHERE key = 'schema_version'")  # string ids, before v2
    con.close()
    with pytest.raises(StoreError, match=r"v1\.duckdb.*schema version 1 predates .* write to a new store file") as err:
        Store.open(old)
    assert "\n" not in str(err.value)
    assert read.runs(old)["name"].to_list() == ["kept"]  # refused before touching anything


def test_truncated_store_is_a_store_error(scenario_db, tmp_path):
    db, _ = scenario_db
    broken = tmp_path / "truncated.duckdb"
    broken.write_bytes(db.read_bytes()[:6000])
    with pytest.raises(StoreError) as err:
        read.runs(broken)
    assert str(broken) in str(err.value)


def test_missing_file_and_missing_directory(tmp_path):
    with pytest.raises(StoreError, match="no such database file"):
        read.runs(tmp_path / "nope.duckdb")
    with pytest.raises(StoreError, match="does not exist"):
        Store.open(tmp_path / "no-dir" / "x.duckdb")


@pytest.mark.parametrize("target", ["missing", "loop"])
def test_an_export_into_a_symlink_that_leads_nowhere_says_so(scenario_db, tmp_path, target):
    """``--parquet LINK`` whose directory does not exist was 'cannot create export directory:
    File exists' (mkdir's word for the link itself); the link and what it names are left as
    they were."""
    import os

    db, run_id = scenario_db
    link = tmp_path / "out"
    os.symlink("out" if target == "loop" else "nowhere", link)
    with pytest.raises(StoreError, match=r"out: is a symbolic link \(to (nowhere|out)\) that leads to nothing"):
        export_parquet(db, run_id, link)
    assert link.is_symlink() and not (tmp_path / "nowhere").exists()
