"""Twenty-sixth session's store probe: kills, concurrency and the read API."""

from __future__ import annotations

import fcntl
import os
import shutil

import duckdb
import pyarrow as pa
import pytest

from kvtrace.store import Store, instances, read
from kvtrace.store.errors import StoreError


def _step_spans(start: int, n: int) -> pa.Table:
    return pa.table({"name": ["kvtrace.engine.step"] * n, "start_ns": list(range(start, start + n))})


def _other_writers_store(path) -> None:
    """A finished store whose run r1 another process wrote (its writer record is not ours)."""
    store = Store.open(path)
    run_id = store.create_run("someone else's")
    store.append_spans(_step_spans(0, 1), run_id=run_id)
    store.finish_run(run_id, digest="theirs")
    store.close()
    con = duckdb.connect(str(path))
    try:
        con.execute("UPDATE runs SET writer_pid = writer_pid + 1")
    finally:
        con.close()


@pytest.mark.parametrize("hold", [False, True], ids=["connection-per-flush", "held-connection"])
def test_a_store_overwritten_in_place_while_a_run_is_written_is_refused_and_its_run_left_alone(tmp_path, hold):
    """``cp other.duckdb s.duckdb`` (the same inode, so no rename the file identity sees), or a
    second replay creating the store anew over the first's: the writer went on appending its
    spans to the other store's r1 and its finish marked that run with its digest (two replays
    racing to create one store both said "run r1 recorded", one r1 holding every seq twice)."""
    db, theirs = tmp_path / "s.duckdb", tmp_path / "theirs.duckdb"
    _other_writers_store(theirs)
    store = Store.open(db, hold=hold)
    run_id = store.create_run("ours")
    assert run_id == "r1"  # (the id the other store's run has too)
    store.append_spans(_step_spans(0, 10), run_id=run_id)
    store.flush()
    store.release()
    with open(theirs, "rb") as src, open(db, "r+b") as dst:  # in place: the inode stays
        dst.truncate(0)
        shutil.copyfileobj(src, dst)
    store.append_spans(_step_spans(10, 10), run_id=run_id)
    with pytest.raises(StoreError, match=r"was overwritten while this process wrote to it \(run r1 is another "):
        store.flush()
    with pytest.raises(StoreError, match="was overwritten while this process wrote to it"):
        store.finish_run(run_id, digest="ours", summary={"requests": 99})
    (row,) = read.runs(db).select("run_id", "name", "status", "num_spans").rows()
    assert row == ("r1", "someone else's", "complete", 1)
    assert read.run(db, "r1")["digest"] == "theirs"


def test_a_run_removed_from_its_store_mid_run_is_not_written_again(tmp_path):
    """The run's record gone (a store created anew over it, empty): nothing is written for it."""
    db = tmp_path / "s.duckdb"
    store = Store.open(db)
    run_id = store.create_run("ours")
    store.append_spans(_step_spans(0, 5), run_id=run_id)
    store.flush()
    con = duckdb.connect(str(db))
    try:
        con.execute("DELETE FROM spans_step")
        con.execute("DELETE FROM runs")
    finally:
        con.close()
    store.append_spans(_step_spans(5, 5), run_id=run_id)
    with pytest.raises(StoreError, match=r"\(run r1 is gone from it: "):
        store.flush()
    assert read.runs(db).height == 0


def test_the_writer_of_its_own_run_writes_and_finishes_as_before(tmp_path):
    db = tmp_path / "s.duckdb"
    store = Store.open(db, hold=True)
    run_id = store.create_run("ours")
    for start in (0, 10):
        store.append_spans(_step_spans(start, 10), run_id=run_id)
        store.flush()
        store.release()
    store.finish_run(run_id, digest="ours")
    store.close()
    (row,) = read.runs(db).select("run_id", "status", "num_spans", "digest").rows()
    assert row == ("r1", "complete", 20, "ours")


def _lock_held(lock) -> bool:
    """Whether another open file holds an exclusive flock on ``lock`` (False: no such file)."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_a_new_store_two_writers_start_on_is_created_once_and_holds_both_runs(tmp_path, monkeypatch):
    """Two replays starting on one new store: DuckDB, having found the path missing, writes a
    new database's header over the file another writer made there meanwhile (the first
    replay's store and run r1 wiped; both printed "run r1 recorded", one r1 holding every seq
    twice). Emulated as DuckDB does it: during this writer's first connect to the missing
    path, another writer creates its store there, unless this one holds the creation lock
    (then that writer waits for it, and opens the store made); the connect then writes a new
    database over whatever is there."""
    db = tmp_path / "s.duckdb"
    real_attach = instances.attach  # (where DuckDB opens, and creates, a store file)
    deferred = []

    def attach(path, *args, **kwargs):
        if deferred or str(path) != str(db):
            return real_attach(path, *args, **kwargs)
        missing = not os.path.exists(path)
        if _lock_held(f"{db}.creating"):
            deferred.append("waits for the lock")
        else:
            deferred.append("creates now")
            monkeypatch.setattr(instances, "attach", real_attach)  # (the other writer's own connects)
            try:
                _other_writers_store(db)
            finally:
                monkeypatch.setattr(instances, "attach", attach)
        if missing and os.path.exists(path):  # what DuckDB's creation of a new database does to it
            fresh = tmp_path / "fresh.duckdb"
            duckdb.connect(str(fresh)).close()
            with open(fresh, "rb") as src, open(path, "r+b") as dst:
                dst.truncate(0)
                shutil.copyfileobj(src, dst)
        return real_attach(path, *args, **kwargs)

    monkeypatch.setattr(instances, "attach", attach)
    store = Store.open(db)
    monkeypatch.setattr(instances, "attach", real_attach)
    if deferred == ["waits for the lock"]:
        _other_writers_store(db)  # (it had the lock once this writer let it go)
    run_id = store.create_run("ours")
    store.append_spans(_step_spans(0, 10), run_id=run_id)
    store.finish_run(run_id, digest="ours")
    store.close()
    rows = read.runs(db).select("name", "num_spans", "digest").sort("name").rows()
    assert rows == [("ours", 10, "ours"), ("someone else's", 1, "theirs")]
    assert not os.path.exists(f"{db}.creating")


def test_a_creation_lock_a_kill_left_is_removed_by_the_next_writer(tmp_path):
    db = tmp_path / "s.duckdb"
    Store.open(db).close()
    from kvtrace.store.writer import CREATION_LOCK_TEXT

    (tmp_path / "s.duckdb.creating").write_bytes(CREATION_LOCK_TEXT)  # (what a creation killed with -9 leaves)
    Store.open(db).close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.duckdb"]
    (tmp_path / "s.duckdb.creating").write_text("")  # (a user's empty file of that name: kept)
    Store.open(db).close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.duckdb", "s.duckdb.creating"]


@pytest.mark.parametrize("blocks", [[], [7]], ids=["reset-alone", "with-an-lru-eviction"])
def test_a_run_whose_evictions_name_no_blocks_reads_as_whole(tmp_path, blocks):
    """A captured AllBlocksCleared is one ``reset`` evict span naming no blocks, which gives
    evicted_blocks and evict_counts no row: a capture whose only evictions were resets was
    called a damaged store ("evict_counts holds none of its rows") by diff, the dashboard and
    every reader of its evictions. Rows deleted beside evicted blocks are still damage."""
    db = tmp_path / "s.duckdb"
    store = Store.open(db)
    run_id = store.create_run("capture", mode="vllm")
    ids = pa.array([[], blocks] if blocks else [[]], pa.list_(pa.int64()))
    hashes = pa.array([[], [f"h{b}" for b in blocks]] if blocks else [[]], pa.list_(pa.string()))
    reasons = ["reset", "lru"] if blocks else ["reset"]
    store.append_spans(pa.table({"name": ["kvtrace.cache.evict"] * len(reasons), "start_ns": [5] * len(reasons),
                                 "end_ns": [5] * len(reasons), "evict_reason": reasons, "block_ids": ids,
                                 "block_hashes": hashes}), run_id=run_id)
    store.finish_run(run_id)
    store.close()
    by_reason = dict(read.evictions_by_reason(db, run_id).select("reason", "blocks").iter_rows())
    assert by_reason == {"reset": 0, **({"lru": 1} if blocks else {})}
    assert int(read.evictions_over_time(db, run_id)["blocks"].sum() or 0) == len(blocks)
    if blocks:
        con = duckdb.connect(str(db))
        try:
            con.execute("DELETE FROM evict_counts")
        finally:
            con.close()
        with pytest.raises(StoreError, match="evict_counts holds none of its rows, beside its evict spans"):
            read.evictions_over_time(db, run_id)
