"""Probe 22 (kills): a store removed or replaced while a writer holds it, and other hard stops."""

from __future__ import annotations

import os
import shutil

import pyarrow as pa
import pytest

from kvtrace.store import Store, read
from kvtrace.store.errors import StoreError


def _step_spans(first: int, n: int) -> pa.Table:
    return pa.table({"name": ["kvtrace.engine.step"] * n, "step": list(range(first, first + n)),
                     "start_ns": list(range(first, first + n))})


def _other_store(path) -> None:
    """A finished store holding its own run ``r1`` (one span)."""
    with Store.open(path) as other:
        run_id = other.create_run("someone else's")
        other.append_spans(_step_spans(0, 1), run_id=run_id)
        other.finish_run(run_id, digest="theirs", summary={"requests": 1})


@pytest.mark.parametrize("hold", [False, True], ids=["connection-per-flush", "held-connection"])
def test_a_store_replaced_while_a_run_is_written_is_refused_and_the_replacement_left_alone(tmp_path, hold):
    """Another store renamed over the path mid-run: the held connection committed the run's
    spans into the unlinked file, and the finish opened the replacement and marked *its*
    run r1 complete with this run's digest and summary (exit 0, "run r1 recorded")."""
    db, theirs = tmp_path / "s.duckdb", tmp_path / "theirs.duckdb"
    _other_store(theirs)
    store = Store.open(db, hold=hold)
    run_id = store.create_run("ours")
    assert run_id == "r1"  # (the id the replacement's run has too)
    store.append_spans(_step_spans(0, 10), run_id=run_id)
    store.flush()
    store.release()  # (a held connection lets go now and then: the check is at every open too)
    store.append_spans(_step_spans(10, 10), run_id=run_id)
    store.flush()
    shutil.copy(theirs, tmp_path / "copy.duckdb")
    os.replace(tmp_path / "copy.duckdb", db)
    store.append_spans(_step_spans(20, 10), run_id=run_id)
    with pytest.raises(StoreError, match=r"was replaced by another file while this process wrote to it \(run r1\)"):
        store.flush()
    with pytest.raises(StoreError, match="replaced by another file"):
        store.finish_run(run_id, digest="ours", summary={"requests": 99})
    with pytest.raises(StoreError, match="replaced by another file"):
        store.close()
    (row,) = read.runs(db).select("run_id", "name", "status", "num_spans").rows()
    assert row == ("r1", "someone else's", "complete", 1)
    assert read.run(db, "r1")["digest"] == "theirs"


def test_a_store_removed_while_a_run_is_written_is_said_so_and_not_created_again_empty(tmp_path):
    """Removed mid-run: the held connection went on into the unlinked file and the finish
    said "no such database file (run `kvtrace replay --db` ... first)"; a connection per
    flush created a new, empty database at the path."""
    db = tmp_path / "s.duckdb"
    for hold in (True, False):
        store = Store.open(db, hold=hold)
        run_id = store.create_run("ours")
        store.append_spans(_step_spans(0, 10), run_id=run_id)
        store.flush()
        store.release()
        for leftover in (db, tmp_path / "s.duckdb.wal"):
            leftover.unlink(missing_ok=True)
        store.append_spans(_step_spans(10, 10), run_id=run_id)
        with pytest.raises(StoreError, match=r"was removed \(or renamed\) while this process wrote to it"):
            store.flush()
        with pytest.raises(StoreError, match="removed"):
            store.finish_run(run_id)
        assert not db.exists()  # (nothing made at the path: no empty store to be refused later)
        with pytest.raises(StoreError, match="removed"):
            store.close()


def test_a_store_whose_path_is_unchanged_is_written_as_before(tmp_path):
    """The guard's other side: a store reopened at every flush, and one written through a
    symbolic link, are the same file each time."""
    target = tmp_path / "s.duckdb"
    link = tmp_path / "link.duckdb"
    Store.open(target).close()
    link.symlink_to(target)
    with Store.open(link, hold=True) as store:
        run_id = store.create_run("ours")
        for first in range(0, 30, 10):
            store.append_spans(_step_spans(first, 10), run_id=run_id)
            store.flush()
            store.release()
        store.finish_run(run_id)
    assert read.runs(target).select("status", "num_spans").rows() == [("complete", 30)]


@pytest.fixture()
def stop_came():
    """This command's stop flags as the SIGINT/SIGTERM handler sets them (no signal sent),
    cleared again after the test."""
    from kvtrace import process

    def came(sigterm: bool) -> None:
        if sigterm:
            process._terminated.set()
        process._stop()

    yield came
    for event in (process._terminated, process._stopped, process._pending, process._swallowed):
        event.clear()


@pytest.mark.parametrize("sigterm", [False, True], ids=["ctrl-c", "sigterm"])
def test_a_stop_that_duckdb_turns_into_query_interrupted_in_a_finish_marks_the_run_failed(tmp_path, monkeypatch,
                                                                                         stop_came, sigterm):
    """A Ctrl-C while a finish's derived-table query runs: DuckDB raises RuntimeError('Query
    interrupted'), which finish_run took for a finish tried and failed; a sweep's store then
    never marked the run (left 'running': incomplete at the next open, its error lost)."""
    from kvtrace.process import Terminated
    from kvtrace.store import derived

    db = tmp_path / "s.duckdb"
    real_compute = derived.compute

    def interrupted(con, run_id):
        stop_came(sigterm)
        raise RuntimeError("Query interrupted")

    stop = Terminated if sigterm else KeyboardInterrupt
    with pytest.raises(stop), Store.open(db) as store:  # (as sweep's _record: no handler of its own)
        run_id = store.create_run("ours")
        store.append_spans(_step_spans(0, 10), run_id=run_id)
        monkeypatch.setattr(derived, "compute", interrupted)
        try:
            store.finish_run(run_id, digest="d", summary={"requests": 1})
        finally:
            monkeypatch.setattr(derived, "compute", real_compute)
    info = read.run(db, run_id)
    assert (info["status"], info["num_spans"]) == ("failed", 10)
    assert info["summary"]["error"].startswith(stop.__name__)


def test_query_interrupted_without_a_stop_is_the_error_it_is(tmp_path, monkeypatch):
    """Without a Ctrl-C or SIGTERM the error is DuckDB's own, as before (a finish that failed)."""
    from kvtrace.store import derived

    db = tmp_path / "s.duckdb"
    store = Store.open(db)
    run_id = store.create_run("ours")

    def interrupted(con, run_id):
        raise RuntimeError("Query interrupted")

    monkeypatch.setattr(derived, "compute", interrupted)
    with pytest.raises(RuntimeError, match="Query interrupted"):
        store.finish_run(run_id)


def test_a_store_on_a_read_only_mount_is_refused_as_one_not_as_permission_denied(tmp_path, monkeypatch):
    """A 0644 store on a file system mounted read-only (a bind mount with ro, a read-only
    volume): refused, but as 'Permission denied (a read-only file)', which its mode is not."""
    from kvtrace.store import backend

    db = tmp_path / "s.duckdb"
    Store.open(db).close()
    real_statvfs = os.statvfs

    class _ReadOnlyMount:
        def __init__(self, st):
            self._st = st
            self.f_flag = st.f_flag | os.ST_RDONLY

    monkeypatch.setattr(backend, "read_only_file", lambda path: True)  # (what os.access says there, for root too)
    monkeypatch.setattr(os, "statvfs", lambda path: _ReadOnlyMount(real_statvfs(path)))
    assert backend.store_to_write_problem(str(db)) == backend.READ_ONLY_MOUNT_STORE
    monkeypatch.setattr(os, "statvfs", real_statvfs)
    assert backend.store_to_write_problem(str(db)) == backend.READ_ONLY_STORE


@pytest.mark.parametrize("how", ["renamed", "removed"])
def test_a_chdb_store_directory_renamed_or_removed_mid_run_is_said_so_and_not_made_again(tmp_path, how):
    """cff46b3 watched DuckDB files only: a chdb directory moved away mid-run gave ClickHouse's
    own 'Table default.spans_cache does not exist. Maybe you meant system.dns_cache?' and left
    a new tmp/ directory at the old path (the reD re-probe)."""
    pytest.importorskip("chdb")
    folder = tmp_path / "cdir"
    store = Store.open(f"chdb:{folder}")
    run_id = store.create_run("ours")
    store.append_spans(_step_spans(0, 10), run_id=run_id)
    store.flush()
    if how == "renamed":
        folder.rename(tmp_path / "moved")
    else:
        shutil.rmtree(folder)
    store.append_spans(_step_spans(10, 10), run_id=run_id)
    with pytest.raises(StoreError, match=r"was removed \(or renamed\) while this process wrote to it"):
        store.flush()
    with pytest.raises(StoreError, match="removed"):
        store.close()
    assert not folder.exists()  # (nothing made at the old path)
    if how == "renamed":  # (what was written before stays where it went)
        assert read.span_counts(f"chdb:{tmp_path / 'moved'}", run_id)["spans"].sum() == 10
