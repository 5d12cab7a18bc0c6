"""A store the user hands kvtrace (``--db``) that is damaged, or a disk or directory that
refuses writes: one line ``kvtrace: error: FILE: ...``, exit 2, no traceback, and nothing
already written lost.

Real DuckDB files written by real ``kvtrace replay`` runs, damaged with the duckdb module
the way a user's hand (or another tool) would, then given to the real CLI.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest

from kvtrace import cli
from kvtrace.store import Store, StoreError, read
from kvtrace.store.connection import read_connection
from kvtrace.store.liveness import host_name, writer_alive
from tests.cli.support import assert_one_line
from tests.cli.support import run as kvtrace
from tests.conftest import MOONCAKE

ROOT = str(Path(__file__).resolve().parents[2])
REPLAY = ["replay", str(MOONCAKE), "--limit", "5", "--mode", "cache-only", "--capacity-blocks", "64"]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> bytes:
    """The bytes of a store holding the cache-only runs r1 and r2 of one trace."""
    db = tmp_path_factory.mktemp("store") / "s.duckdb"
    with pytest.MonkeyPatch.context() as mp:
        for _ in range(2):
            mp.setattr(sys, "argv", ["kvtrace", *REPLAY[:3], "20", *REPLAY[4:], "--db", str(db)])
            with contextlib.suppress(SystemExit):
                cli.main()
    assert read.runs(db)["run_id"].sort().to_list() == ["r1", "r2"]
    return db.read_bytes()


def _altered(tmp_path: Path, two_runs: bytes, *sql: str) -> Path:
    db = tmp_path / "s.duckdb"
    db.write_bytes(two_runs)
    con = duckdb.connect(str(db))
    for stmt in sql:
        con.execute(stmt)
    con.close()  # (checkpointed: the file alone is the store)
    return db


def _digest(db: Path) -> str:
    h = hashlib.sha256(db.read_bytes())
    wal = Path(f"{db}.wal")
    if wal.exists():
        h.update(wal.read_bytes())
    return h.hexdigest()


# (damage, what the error line names): tables, views and columns that are not what
# schema.py and derived.py declare
LAYOUT_DAMAGE = {
    "runs-table-dropped": (["DROP TABLE runs"], "table runs is missing"),
    "spans-view-dropped": (["DROP VIEW spans"], "view spans is missing"),
    "family-table-dropped": (["DROP TABLE spans_cache"], "table spans_cache is missing"),
    "family-table-and-views-dropped": (
        ["DROP VIEW otel_traces", "DROP VIEW spans", "DROP VIEW request_spans", "DROP TABLE spans_request"],
        "table spans_request is missing"),
    "family-view-dropped": (["DROP VIEW lookup_spans"], "view lookup_spans is missing"),
    "derived-table-dropped": (["DROP TABLE evicted_blocks"], "table evicted_blocks is missing"),
    "view-is-a-table": (["DROP VIEW step_spans", "CREATE TABLE step_spans (x INTEGER)"],
                        "step_spans is a table, expected a view"),
    **{f"runs-{col}-dropped": ([f"ALTER TABLE runs DROP COLUMN {col}"], f"column runs.{col} is missing")
       for col in ("summary", "status", "config", "trace_digest", "writer_pid")},
    "span-column-dropped": (["ALTER TABLE spans_lookup DROP COLUMN root_hash"], "column spans_lookup.root_hash"),
    "summary-retyped-not-json": (
        ["ALTER TABLE runs ALTER summary TYPE VARCHAR", "UPDATE runs SET summary = 'not json' WHERE run_id = 'r1'"],
        "column runs.summary is VARCHAR, expected JSON"),
    "writer-pid-retyped-huge": (
        ["ALTER TABLE runs ALTER writer_pid TYPE BIGINT",
         "UPDATE runs SET writer_pid = 99999999999, status = 'running' WHERE run_id = 'r1'"],
        "column runs.writer_pid is BIGINT, expected INTEGER"),
    "meta-column-dropped": (["ALTER TABLE kvtrace_meta DROP COLUMN value"], "kvtrace_meta"),
    # rebuilt without its key: r1 twice, and each reader took whichever row came first
    "runs-key-lost": (["CREATE TABLE r AS SELECT * FROM runs", "DROP TABLE runs",
                       "CREATE TABLE runs AS SELECT * FROM r", "DROP TABLE r",
                       "INSERT INTO runs SELECT * REPLACE ('failed' AS status) FROM runs WHERE run_id = 'r1'"],
                      "table runs has lost its primary key run_id"),
}


@pytest.mark.parametrize("damage", list(LAYOUT_DAMAGE))
def test_a_store_missing_a_table_view_or_column_is_refused_in_one_line(tmp_path, capsys, two_runs, damage):
    """runs, diff, export and a replay appending all refuse it before doing anything: one
    line naming the file and what is missing or wrong; the file is left as it was (a replay
    does not re-create a dropped runs table and reuse r1 next to the old run's spans), and
    an export writes nothing."""
    sql, needle = LAYOUT_DAMAGE[damage]
    db = _altered(tmp_path, two_runs, *sql)
    before = _digest(db)
    out = tmp_path / "export"
    for argv in (["runs"], ["diff", "r1", "r2"], ["export", "--run", "r1", "--parquet", str(out)], REPLAY):
        code, _, err = kvtrace([*argv, "--db", str(db)], capsys)
        assert_one_line(code, err, str(db), "damaged kvtrace store", needle)
    assert _digest(db) == before
    assert not out.exists() or not any(out.iterdir())


# (damage, what the error line names): values the columns' types allow but that are not
# what kvtrace writes, found where they are decoded (read.runs: JSON fields, writer_pid)
VALUE_DAMAGE = {
    "summary-json-null": (["UPDATE runs SET summary = 'null'"], "summary is null, expected a JSON object"),
    "summary-json-list": (["UPDATE runs SET summary = '[1,2,3]' WHERE run_id = 'r1'"], "run r1's summary is [1,2,3]"),
    "summary-json-number": (["UPDATE runs SET summary = '42' WHERE run_id = 'r2'"], "run r2's summary is 42"),
    "config-json-string": (["UPDATE runs SET config = '\"x\"' WHERE run_id = 'r2'"], "run r2's config"),
    "behaviours-not-names": (["UPDATE runs SET behaviours = '[1, 2]' WHERE run_id = 'r1'"], "run r1's behaviours"),
    "writer-pid-negative": (["UPDATE runs SET writer_pid = -1, status = 'running' WHERE run_id = 'r1'"],
                            "run r1's writer_pid -1 is not a process id"),
    "writer-pid-zero": (["UPDATE runs SET writer_pid = 0, status = 'running' WHERE run_id = 'r2'"],
                        "run r2's writer_pid 0 is not a process id"),
    # a status kvtrace never writes read as finished: derived tables never written were read
    "status-unknown": (["UPDATE runs SET status = 'finished' WHERE run_id = 'r1'"],
                       "run r1's status 'finished' is not one of running, complete, failed, incomplete"),
    "status-null": (["UPDATE runs SET status = NULL WHERE run_id = 'r2'"], "run r2's status None is not one of"),
}


@pytest.mark.parametrize("damage", list(VALUE_DAMAGE))
def test_a_run_record_with_values_kvtrace_never_writes_is_one_line(tmp_path, capsys, two_runs, damage):
    """A diff of the run is one line naming the damage; the store's other runs stay
    readable: `runs` lists the damaged one as such (one damaged record made every run of
    the store unreadable: `runs` and any diff failed)."""
    sql, needle = VALUE_DAMAGE[damage]
    db = _altered(tmp_path, two_runs, *sql)
    code, _, err = kvtrace(["diff", "r1", "r2", "--db", str(db)], capsys)
    assert_one_line(code, err, str(db), "damaged kvtrace store", needle)
    damaged = {r for r in ("r1", "r2") if f"run {r}'s" in needle} or {"r1", "r2"}
    code, out, err = kvtrace(["runs", "--json", "--db", str(db)], capsys)
    assert code == 0, err
    listed = {r["run_id"]: r for r in json.loads(out)["runs"]}
    assert set(listed) == {"r1", "r2"}
    for run_id, r in listed.items():
        assert (r["status"] == "damaged") == (run_id in damaged)
        assert (needle in (r["damage"] or "")) == (run_id in damaged)
    code, out, err = kvtrace(["runs", "--db", str(db)], capsys)
    assert code == 0 and "damaged" in out and needle in err and "Traceback" not in err
    for healthy in {"r1", "r2"} - damaged:
        assert read.run(db, healthy)["status"] == "complete"
    with pytest.raises(StoreError, match=re.escape(needle)):
        read.run(db, sorted(damaged)[0])


def test_a_writer_pid_that_is_no_process_id_is_a_store_error():
    """The one place a stored writer_pid is used checks it (os.kill overflows past a C int;
    0 and -1 would address a process group or every process)."""
    for pid in (99999999999, 2**31, 0, -1):
        with pytest.raises(StoreError, match=r"s\.duckdb: damaged kvtrace store: run r1's writer_pid"):
            writer_alive(pid, host_name(), None, db="s.duckdb", run_id="r1")
    assert writer_alive(os.getpid(), host_name(), None, db="s.duckdb", run_id="r1")


def test_what_a_newer_kvtrace_adds_may_be_missing(tmp_path, capsys, two_runs):
    """A store written before curves, runs.time_offset_ns and span_stats' extent is whole:
    it reads, and a replay appends to it (adding them)."""
    db = _altered(tmp_path, two_runs, "DROP TABLE curves", "ALTER TABLE runs DROP COLUMN time_offset_ns",
                  "ALTER TABLE span_stats DROP COLUMN start_ns", "ALTER TABLE span_stats DROP COLUMN end_ns")
    code, out, err = kvtrace(["runs", "--json", "--db", str(db)], capsys)
    assert code == 0, err
    code, _, err = kvtrace([*REPLAY, "--db", str(db)], capsys)
    assert code == 0, err
    assert read.runs(db)["run_id"].sort().to_list() == ["r1", "r2", "r3"]
    assert read.curves(db).height == 0


def test_damage_met_after_the_store_was_opened_is_one_line(tmp_path, two_runs):
    """The safety net behind the open-time check: a store query that meets a missing table
    or column (DuckDB's catalog and binder errors), reading or appending, is the same
    one-line StoreError naming the file."""
    db = _altered(tmp_path, two_runs)
    with pytest.raises(StoreError) as err, read_connection(db) as con:
        con.execute("SELECT no_such_column FROM runs")
    assert str(err.value).startswith(f"{db}: damaged kvtrace store (Binder Error")
    assert "\n" not in str(err.value)

    store = Store.open(db)  # (not held: the file is free between flushes)
    run_id = store.create_run("then damaged")
    _altered_in_place(db, "DROP VIEW spans", "DROP VIEW step_spans", "DROP TABLE spans_step")
    store.append_spans(pa.table({"name": ["kvtrace.engine.step"], "start_ns": [1]}), run_id=run_id,
                       flush_when_due=False)
    with pytest.raises(StoreError) as err:
        store.flush()
    assert str(err.value).startswith(f"{db}: damaged kvtrace store (Catalog Error")
    assert "spans_step" in str(err.value) and "\n" not in str(err.value)
    store.discard_buffer()
    store.release()


def _altered_in_place(db: Path, *sql: str) -> None:
    con = duckdb.connect(str(db))
    for stmt in sql:
        con.execute(stmt)
    con.close()


@pytest.fixture()
def immutable_dir(tmp_path):
    """A directory the OS refuses to add files to (no WAL can be created there), even for
    root: ``chattr +i``. Skipped only when the OS refuses to set that up."""
    d = tmp_path / "rod"
    d.mkdir()
    chattr = shutil.which("chattr")
    if chattr is None:
        pytest.skip("chattr is not installed: cannot make a directory immutable")

    def setup(*names: Path) -> None:
        for src in names:
            shutil.copy(src, d / src.name)
        done = subprocess.run([chattr, "+i", str(d)], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            pytest.skip(f"the OS refuses chattr +i here: {done.stderr.strip()}")

    yield d, setup
    subprocess.run([chattr, "-i", str(d)], capture_output=True, check=False)


def test_appending_in_a_read_only_directory_is_one_line_and_keeps_the_store(tmp_path, capsys, two_runs,
                                                                            immutable_dir):
    """DuckDB opens the file but cannot create its WAL at the first commit: one line naming
    the store and the reason, exit 2; the store is unchanged and still reads. A new store
    there is refused the same way."""
    src = _altered(tmp_path, two_runs)
    d, setup = immutable_dir
    setup(src)
    db = d / src.name
    before = _digest(db)
    code, _, err = kvtrace([*REPLAY, "--db", str(db)], capsys)
    assert_one_line(code, err, f"{db}: cannot write: ", "Operation not permitted", "(what was committed before stays)")
    assert _digest(db) == before
    assert read.runs(db)["run_id"].sort().to_list() == ["r1", "r2"]
    code, _, err = kvtrace([*REPLAY, "--db", str(d / "new.duckdb")], capsys)
    assert_one_line(code, err, f"{d / 'new.duckdb'}: cannot write: ")
    assert sorted(p.name for p in d.iterdir()) == [src.name]


FILE_SIZE_LIMIT = """
import resource, runpy, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), as on a full disk
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
sys.argv = ["kvtrace", *sys.argv[2:]]
runpy.run_module("kvtrace.cli", run_name="__main__")
"""


@pytest.mark.parametrize("limit", [0, 5_000, 20_000], ids=["no-byte", "mid-header", "at-schema-commit"])
def test_a_store_whose_creation_the_disk_refused_is_removed(tmp_path, capsys, limit):
    """Wherever the creation fails (the file's header, the schema's commit), the files this
    command created are removed: the next try, with room, works (before, a 0-byte or
    half-written file was left that every later run refused as not a DuckDB database)."""
    db = tmp_path / "new.duckdb"
    proc = subprocess.run([sys.executable, "-c", FILE_SIZE_LIMIT, str(limit), *REPLAY, "--db", str(db)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300, check=False,
                          env={**os.environ, "PYTHONPATH": ROOT})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"kvtrace: error: {db}: cannot write: File too large"), lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    code, _, err = kvtrace([*REPLAY, "--db", str(db)], capsys)
    assert code == 0, err
    assert read.runs(db)["run_id"].to_list() == ["r1"]


def test_a_failed_open_of_an_existing_store_removes_nothing(tmp_path, capsys, two_runs):
    """Only what this command created is removed: an existing store the disk refuses to
    append to stays, whole."""
    db = _altered(tmp_path, two_runs)
    proc = subprocess.run([sys.executable, "-c", FILE_SIZE_LIMIT, "0", *REPLAY, "--db", str(db)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300, check=False,
                          env={**os.environ, "PYTHONPATH": ROOT})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "cannot write" in lines[0] and str(db) in lines[0], lines[0]
    assert read.runs(db)["run_id"].sort().to_list() == ["r1", "r2"]


def test_a_run_whose_writer_pid_is_damaged_bars_no_replay_into_the_store(tmp_path, capsys, two_runs):
    """Recovery asked every `running` run whether its writer lived, and a pid that is no
    process id raised: every replay, study and sweep into the store was refused, where `runs`
    lists the run as damaged and reads the rest."""
    db = _altered(tmp_path, two_runs, "UPDATE runs SET writer_pid = -5, status = 'running' WHERE run_id = 'r1'")
    code, _, err = kvtrace([*REPLAY, "--db", str(db)], capsys)
    assert code == 0, err
    listed = {r: s for r, s in zip(read.runs(db)["run_id"], read.runs(db)["status"])}
    assert listed == {"r1": "damaged", "r2": "complete", "r3": "complete"}
