"""The re-probe of the store's creation lock (``<db>.creating``, 5441f00): a file of that name
the user keeps, or a link, is left alone."""

from __future__ import annotations

import os

from kvtrace.store.writer import Store


def _replay_into(path) -> str:
    with Store.open(path) as store:
        run_id = store.create_run("x")
        store.finish_run(run_id)
    return run_id


def test_a_file_of_the_lock_files_name_is_kept_when_a_writer_opens_the_store(tmp_path):
    """Opening an existing store removed `<db>.creating` whatever it was: the user's file went."""
    db = tmp_path / "a.duckdb"
    _replay_into(db)
    kept = tmp_path / "a.duckdb.creating"
    kept.write_text("precious\n")
    _replay_into(db)
    assert kept.read_text() == "precious\n"


def test_a_file_of_the_lock_files_name_is_kept_when_a_writer_creates_the_store(tmp_path):
    db = tmp_path / "b.duckdb"
    kept = tmp_path / "b.duckdb.creating"
    kept.write_text("precious\n")
    _replay_into(db)
    assert kept.read_text() == "precious\n" and db.exists()


def test_a_link_at_the_lock_files_name_makes_no_file_at_its_target(tmp_path):
    """A symlink at `<db>.creating` made an empty file appear at its target."""
    db, link, target = tmp_path / "c.duckdb", tmp_path / "c.duckdb.creating", tmp_path / "victim"
    os.symlink(target, link)
    _replay_into(db)
    assert not target.exists() and os.path.islink(link) and db.exists()


def test_request_extent_is_the_requests_frames_first_arrival_last_finish_and_count(tmp_path):
    """The dashboard read the whole requests frame (0.5 s at 424k requests) for three numbers;
    ``read.request_extent`` gives them in one aggregate, as the frame has them."""
    from kvtrace.replay.run import RunSpec, run_replay
    from kvtrace.store import read

    db = str(tmp_path / "e.duckdb")
    engine = run_replay(RunSpec("gen:mixed", preset="dense-attention", limit=40), db=db).run_id
    cache_only = run_replay(RunSpec("gen:mixed", mode="cache-only", limit=40), db=db).run_id
    frame = read.requests(db, engine)
    assert read.request_extent(db, engine) == (frame["arrival_ns"].min(), frame["finish_ns"].max(), 40)
    assert read.request_extent(db, cache_only) == (None, None, 0)


def test_a_users_empty_file_at_the_creation_locks_name_is_kept_when_a_writer_creates_the_store(tmp_path):
    """An empty file there was taken for a lock and removed (re-probe E, twenty-seventh session)."""
    db = tmp_path / "e.duckdb"
    kept = tmp_path / "e.duckdb.creating"
    kept.write_text("")
    _replay_into(db)
    assert kept.exists() and db.exists()
