"""Damaged, foreign and half-made chdb stores meet every command as a DuckDB store would:
one line naming the store, exit 2, nothing written, and a store whose creation a kill -9
cut short is finished by the next writer, not refused for good."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.test_bad_input import assert_one_line
from tests.clickhouse.test_cli_errors import _chdb, _kvtrace

REPLAY = ("replay", "gen:chat", "--mode", "cache-only", "--limit", "3")


@pytest.fixture(scope="module")
def _recorded(tmp_path_factory) -> tuple[Path, Path]:
    """Two chdb stores recorded once for the module by real ``kvtrace replay`` processes
    (REPLAY): one holding r1, the other r1 and r2 (the same store after a second replay).
    Never written to: a case takes its own copy (``_copy``)."""
    root = tmp_path_factory.mktemp("recorded")
    one, two = root / "one", root / "two"
    assert _kvtrace(*REPLAY, "--db", f"chdb:{two}").returncode == 0
    shutil.copytree(two, one, symlinks=True)
    assert _kvtrace(*REPLAY, "--db", f"chdb:{two}").returncode == 0
    return one, two


def _copy(made: Path, to: Path) -> Path:
    """The case's own copy of a recorded store (chdb's table links are relative: the copy is
    a store of its own)."""
    shutil.copytree(made, to, symlinks=True)
    return to


def _files(path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def _parts(path) -> list[str]:
    """The data parts of a chdb directory's tables (a table's parts in store/, one per insert)."""
    return sorted(str(p.relative_to(path)) for p in path.glob("store/*/*/*_*_*"))


def test_a_writer_refuses_a_directory_of_other_files_and_writes_nothing_there(tmp_path):
    """`chdb:/` wrote data/, metadata/ and store/ into the root (a reader refused it as no
    store, a writer made one among the user's files)."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    proc = _kvtrace(*REPLAY, "--db", f"chdb:{mine}")
    assert_one_line(proc.returncode, proc.stderr, f"chdb:{mine}", "holds other files (notes.txt)", "no chdb store")
    assert _files(mine) == ["notes.txt"]
    left = tmp_path / "left"  # what a chdb killed as it started leaves: a store to make there
    (left / "tmp").mkdir(parents=True)
    assert _kvtrace(*REPLAY, "--db", f"chdb:{left}").returncode == 0


_KILLED_AT = """
import os, signal, sys
from kvtrace.store import Store
from kvtrace.store.clickhouse import client
seen = [0]
real = client.ClickHouseConnection.command
def command(self, *args, **kwargs):
    seen[0] += 1
    if seen[0] == int(sys.argv[2]):
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, *args, **kwargs)
client.ClickHouseConnection.command = command
Store.open(sys.argv[1]).close()
"""


def test_a_store_creation_killed_before_its_meta_rows_is_finished_by_the_next_writer(tmp_path):
    """ClickHouse has no transactions: a writer killed among a new store's CREATEs left an
    empty kvtrace_meta that every command refused for good ("kvtrace_meta.magic is None")."""
    store = f"chdb:{tmp_path / 's'}"
    killed = subprocess.run([sys.executable, "-c", _KILLED_AT, store, "40"], capture_output=True, text=True,
                            timeout=180, check=False)
    assert killed.returncode == -9, killed.stderr
    proc = _kvtrace("runs", "--db", store)
    assert_one_line(proc.returncode, proc.stderr, "not a kvtrace store", "no kvtrace_meta rows")
    made = _kvtrace(*REPLAY, "--db", store)
    assert made.returncode == 0, made.stderr
    listed = _kvtrace("runs", "--db", store, "--json")
    assert listed.returncode == 0 and '"run_id": "r1"' in listed.stdout, listed.stderr


def test_a_store_whose_meta_is_lost_is_not_written_into(tmp_path, _recorded):
    """As DuckDB's writer refuses tables without kvtrace_meta: a replay re-made the meta of
    a store whose meta was dropped and added its run beside records it could not vouch for."""
    store = f"chdb:{_copy(_recorded[0], tmp_path / 's')}"  # (r1 recorded)
    _chdb(tmp_path / "s", "DROP TABLE kvtrace_meta")
    parts = _parts(tmp_path / "s")
    proc = _kvtrace(*REPLAY, "--db", store)
    assert_one_line(proc.returncode, proc.stderr, "kvtrace_meta is lost", "yet runs, ")
    assert _parts(tmp_path / "s") == parts  # nothing inserted, nothing made
    proc = _kvtrace("runs", "--db", store)  # (no meta: no store to any reader either)
    assert_one_line(proc.returncode, proc.stderr, "not a kvtrace store")


@pytest.mark.parametrize(("damage", "needle"), [
    # ClickHouse keeps no primary key: `runs` listed r1 twice and an export wrote both records
    ("INSERT INTO runs SELECT * FROM runs WHERE run_id = 'r1'", "run r1 is recorded 2 times in runs"),
    # a column of ClickHouse's span tables alone: every reader failed on ClickHouse's own error
    ("ALTER TABLE spans_lookup DROP COLUMN time_offset_ns", "column spans_lookup.time_offset_ns is missing"),
])
def test_damage_of_the_clickhouse_layout_is_one_line_from_every_command(tmp_path, damage, needle, _recorded):
    store = f"chdb:{_copy(_recorded[1], tmp_path / 's')}"  # (r1 and r2 recorded)
    _chdb(tmp_path / "s", damage)
    out = tmp_path / "out"
    for argv in (["runs"], ["diff", "r1", "r2"], ["export", "--run", "r1", "--parquet", str(out)], list(REPLAY)):
        proc = _kvtrace(*argv, "--db", store)
        assert_one_line(proc.returncode, proc.stderr, f"{store}: damaged kvtrace store: {needle}")
    assert not out.exists()


def test_data_files_chdb_finds_damaged_only_when_read_are_a_damaged_store(tmp_path, _recorded):
    """A data file of the right size but wrong bytes passes chdb's open (no broken part) and
    fails the first query that reads it: ClickHouse's own error ("Code: 432 ... Unknown
    codec family code"), not the damaged store it is."""
    store = f"chdb:{_copy(_recorded[0], tmp_path / 's')}"  # (r1 recorded)
    runs = (tmp_path / "s" / "data" / "default" / "runs").resolve()
    for data in runs.glob("*/data.bin"):
        size = data.stat().st_size
        data.write_bytes((bytes(range(7, 256)) * (size // 249 + 1))[:size])
    for argv in (["runs"], ["export", "--run", "r1", "--parquet", str(tmp_path / "out")]):
        proc = _kvtrace(*argv, "--db", store)
        assert_one_line(proc.returncode, proc.stderr, f"{store}: damaged kvtrace store: ClickHouse cannot read store/",
                        "/data.bin of table runs (")
    assert not (tmp_path / "out").exists()


def test_writers_of_one_process_never_record_one_run_id_twice(tmp_path):
    """ClickHouse keeps no primary key: four writers creating runs in threads all read the
    same largest id, and r1 was recorded four times (a damaged store)."""
    import threading

    from kvtrace.store import Store, read

    db = f"chdb:{tmp_path / 's'}"
    stores = [Store.open(db) for _ in range(4)]
    start, made = threading.Barrier(len(stores)), []

    def create(store) -> None:
        start.wait()
        made.extend(store.create_run("x") for _ in range(3))

    threads = [threading.Thread(target=create, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in stores:
        s._open_runs.clear()  # (left running: nothing to finish)
    assert sorted(made, key=lambda r: int(r[1:])) == [f"r{i}" for i in range(1, 13)]
    assert read.runs(db).height == 12


def test_a_writer_that_finds_its_new_run_id_taken_takes_its_record_back(tmp_path):
    """A server's writers in two processes can read the same largest id: the one that finds
    the id recorded twice after its insert removes its own record and stops, so the store
    keeps one record of it (the other writer's)."""
    from kvtrace.store import Store
    from kvtrace.store.backend import clickhouse_target
    from kvtrace.store.clickhouse import client
    from kvtrace.store.clickhouse.writer import _give_up_a_shared_id
    from kvtrace.store.errors import StoreError

    db = f"chdb:{tmp_path / 's'}"
    with Store.open(db) as store:
        store.create_run("first")
        store._open_runs.clear()
    other = {"run_id": "r1", "writer_host": "elsewhere", "writer_pid": 4242, "writer_start": None}
    with client.connect(clickhouse_target(db)) as con:
        con.command("INSERT INTO runs (run_id, name, status, writer_host, writer_pid) "
                    "VALUES ('r1', 'second', 'running', 'elsewhere', 4242)")
        with pytest.raises(StoreError, match="run id r1 was taken by another writer at the same moment"):
            _give_up_a_shared_id(con, db, other)
        left = con.ch_frame("SELECT name FROM runs WHERE run_id = 'r1'")["name"].to_list()
        _give_up_a_shared_id(con, db, other)  # (alone now: nothing to give up)
    assert left == ["first"]
