"""Writers take turns at a store under a POSIX lock on ``<db>.write-lock``, held from each
read-write open to its close: DuckDB 2.0.1 now and then loses a committed transaction when
processes take turns writing one file (``bench/store_writer_race.py`` measures it)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtrace.store import Store, read
from kvtrace.store.connection import _WriterLock, write_connection, write_lock_path
from kvtrace.store.errors import StoreBusyError
from tests.store.test_crash import ROOT

_HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.lockf(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.readline()  # (held until the test closes our stdin)
"""


def _made(path) -> str:
    with Store.open(path) as store:
        run_id = store.create_run("x")
        store.finish_run(run_id)
    return run_id


def _hold_lock_elsewhere(lock: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, lock], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_writer_waits_for_the_process_holding_the_write_lock_and_names_it(tmp_path):
    db = str(tmp_path / "s.duckdb")
    _made(db)
    holder = _hold_lock_elsewhere(write_lock_path(db))
    try:
        with pytest.raises(StoreBusyError, match=r"s\.duckdb\.write-lock"), write_connection(db, timeout_s=0.3):
            pass
    finally:
        holder.communicate("")
    with write_connection(db, timeout_s=5) as con:  # (its turn, once the holder is gone)
        assert con.execute("SELECT count(*) FROM runs").fetchall() == [(1,)]


def test_the_lock_is_held_from_open_to_close_and_its_file_then_removed(tmp_path):
    db = str(tmp_path / "s.duckdb")
    _made(db)
    with write_connection(db) as con:
        con.execute("SELECT 1").fetchall()
        assert os.path.exists(write_lock_path(db))
        probe = subprocess.run([sys.executable, "-c", (
            "import fcntl, os, sys\n"
            "fd = os.open(sys.argv[1], os.O_RDWR)\n"
            "try:\n    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept OSError:\n    print('busy')\n"
            "else:\n    print('free')\n"), write_lock_path(db)], capture_output=True, text=True, check=True)
        assert probe.stdout.strip() == "busy"
    assert not os.path.exists(write_lock_path(db))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.duckdb"]


def test_two_connections_of_one_process_share_its_turn(tmp_path):
    """A second connection in the process that holds the turn takes it too (no wait on
    itself), and the lock stays until the last one closes."""
    db = str(tmp_path / "s.duckdb")
    _made(db)
    with write_connection(db, timeout_s=0.5):
        with write_connection(db, timeout_s=0.5) as inner:
            inner.execute("SELECT 1").fetchall()
        assert os.path.exists(write_lock_path(db))  # (the outer connection still holds it)
    assert not os.path.exists(write_lock_path(db))


def test_a_link_to_the_store_takes_the_same_turn(tmp_path):
    """One lock whatever name a writer opens the file by: a link's writer waits too."""
    db = str(tmp_path / "s.duckdb")
    _made(db)
    link = tmp_path / "link.duckdb"
    os.symlink(db, link)
    holder = _hold_lock_elsewhere(write_lock_path(db))
    try:
        with pytest.raises(StoreBusyError), write_connection(str(link), timeout_s=0.3):
            pass
    finally:
        holder.communicate("")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_does_not_inherit_its_parents_turn(tmp_path):
    """POSIX locks are not inherited, so a child must not believe it holds its parent's."""
    db = str(tmp_path / "s.duckdb")
    _made(db)
    with write_connection(db):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover (the child)
            os.close(read_end)
            got = _WriterLock.acquire(db)
            os.write(write_end, b"1" if got else b"0")
            os._exit(0)
        os.close(write_end)
        answer = os.read(read_end, 1)
        os.waitpid(pid, 0)
        os.close(read_end)
    assert answer == b"0"  # (the parent holds it: the child waits its turn)


def test_a_writer_killed_holding_the_lock_leaves_a_file_the_next_writer_takes_and_removes(tmp_path):
    db = str(tmp_path / "s.duckdb")
    _made(db)
    code = ("import sys, time\nfrom kvtrace.store.connection import write_connection\n"
            "with write_connection(sys.argv[1]) as con:\n    print('open', flush=True)\n    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, db], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "open"
    proc.kill()
    proc.wait()
    assert os.path.exists(write_lock_path(db))
    started = time.monotonic()
    run_id = _made(db)
    assert time.monotonic() - started < 10 and read.runs(db).height == 2 and run_id
    assert not os.path.exists(write_lock_path(db))


def test_a_users_file_or_link_at_the_locks_name_is_left_alone(tmp_path):
    db = str(tmp_path / "s.duckdb")
    kept = tmp_path / "s.duckdb.write-lock"
    kept.write_text("precious\n")
    _made(db)
    assert kept.read_text() == "precious\n"
    kept.write_text("")  # (an empty one too: the lock files kvtrace makes say so in their text)
    _made(db)
    assert kept.exists()
    kept.unlink()
    victim = tmp_path / "victim"
    os.symlink(victim, kept)
    _made(db)
    assert not victim.exists() and os.path.islink(kept) and read.runs(db).height == 3



def test_a_file_put_in_the_locks_place_while_it_is_held_is_not_removed_at_the_release(tmp_path):
    """`kvtrace generate -o <db>.write-lock` during a replay wrote 75 KB there; the replay's
    release removed it (re-probe A)."""
    db = str(tmp_path / "s.duckdb")
    _made(db)
    lock = write_lock_path(db)
    with write_connection(db):
        replacement = tmp_path / "new"
        replacement.write_text("the user's\n")
        os.replace(replacement, lock)
    assert Path(lock).read_text() == "the user's\n"


def test_an_output_onto_a_stores_lock_or_marker_is_refused(tmp_path, capsys):
    from tests.cli.support import run

    db = str(tmp_path / "s.duckdb")
    _made(db)
    for suffix in (".write-lock", ".writer-waiting", ".creating"):
        code, _, err = run(["generate", "chat", "-o", db + suffix, "--requests", "2"], capsys)
        assert code == 2 and "is a lock or marker file of the DuckDB database" in err, err
        assert not os.path.exists(db + suffix)


def test_a_writer_through_a_link_gets_its_turn_from_a_held_writer(tmp_path):
    """Its waiting marker was named after the link, which the held writer (a replay's) never
    looked at: it waited 30 s and was refused, naming a lock under the link's name (re-probe A)."""
    db = str(tmp_path / "s.duckdb")
    _made(db)
    link = tmp_path / "link.duckdb"
    os.symlink(db, link)
    code = ("import sys, time\nfrom kvtrace.store.connection import HeldConnection\n"
            "held = HeldConnection(sys.argv[1])\nprint('held', flush=True)\n"
            "for _ in range(400):\n    with held.use() as con:\n        con.execute('SELECT 1').fetchall()\n"
            "    time.sleep(0.05)\nheld.release()\n")
    proc = subprocess.Popen([sys.executable, "-c", code, db], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        time.sleep(0.3)
        started = time.monotonic()
        with write_connection(str(link), timeout_s=15) as con:
            assert con.execute("SELECT count(*) FROM runs").fetchall() == [(1,)]
        assert time.monotonic() - started < 10
    finally:
        proc.kill()
        proc.wait()


def test_a_fifo_or_a_directory_at_the_locks_name_leaves_writers_unguarded_not_hung(tmp_path):
    """A FIFO there took the POSIX lock, was no regular file, and the writer tried again for ever."""
    for kind in ("fifo", "dir"):
        db = str(tmp_path / f"{kind}.duckdb")
        lock = write_lock_path(db)
        os.mkfifo(lock) if kind == "fifo" else os.mkdir(lock)
        _made(db)
        _made(db)
        assert read.runs(db).height == 2 and os.path.exists(lock)


def test_a_fifo_at_a_waiting_markers_name_does_not_hold_a_reader(tmp_path):
    """`_touch` opened `<db>.reader-waiting` with open(..., "a"): a FIFO there blocked the
    reader for good, long after the writer let go (re-probe E)."""
    from kvtrace.store.connection import read_connection, reader_marker

    db = str(tmp_path / "s.duckdb")
    _made(db)
    os.mkfifo(reader_marker(db))
    code = ("import sys, time\nfrom kvtrace.store.connection import write_connection\n"
            "with write_connection(sys.argv[1]):\n    print('open', flush=True)\n    time.sleep(2)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, db], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "open"
        started = time.monotonic()
        with read_connection(db, timeout_s=20) as con:
            assert con.execute("SELECT count(*) FROM runs").fetchall() == [(1,)]
        assert time.monotonic() - started < 15
    finally:
        proc.kill()
        proc.wait()
