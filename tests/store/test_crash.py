"""Crash safety with a real writer process: kill -9 and Ctrl-C mid-run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from kvtrace.store import Store, read
from kvtrace.store.errors import StoreError

CHILD = str(Path(__file__).with_name("writer_child.py"))
ROOT = str(Path(__file__).resolve().parents[2])


def _start(db, mode, batches, rows, hold=False):
    return subprocess.Popen(
        [sys.executable, CHILD, str(db), mode, str(batches), str(rows)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT, "WRITER_CHILD_HOLD": "1" if hold else "0"},
    )


def _wait_for(proc, word):
    lines = []
    for line in proc.stdout:
        lines.append(line.strip())
        if line.strip() == word:
            return lines
    raise AssertionError(f"child exited before {word!r}: {lines}, rc={proc.wait()}")


@pytest.mark.parametrize("hold", [False, True], ids=["connection-per-flush", "held-connection"])
def test_kill_9_keeps_flushed_batches_and_marks_run_incomplete(tmp_path, hold):
    """Held or not, a committed flush survives the kill (a held connection's are in the WAL)."""
    db = tmp_path / "crash.duckdb"
    proc = _start(db, "hang", 5, 1000, hold)
    lines = _wait_for(proc, "ready")
    assert lines[-2] == "flushed 5000"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    # readers see every flushed span (the unflushed sixth batch is gone) and a dead writer
    runs = read.runs(db)
    assert runs.select("run_id", "status", "num_spans").rows() == [("child", "incomplete", 5000)]
    assert read.usage_over_time(db, "child", window_ns=10**9)["mean_usage"].to_list() == [0.5, 0.25]
    # reopening for writing works, persists the status and accepts new runs
    store = Store.open(db)
    assert store.recovered_runs == ["child"]
    assert read.run(db, "child")["status"] == "incomplete"
    run_id = store.create_run("after-crash")
    store.append_spans(pa.table({"name": ["kvtrace.engine.step"], "start_ns": [1]}), run_id=run_id)
    store.finish_run(run_id)
    assert dict(read.runs(db).select("run_id", "num_spans").iter_rows()) == {"child": 5000, run_id: 1}


def test_ctrl_c_flushes_and_marks_run_failed(tmp_path):
    db = tmp_path / "sigint.duckdb"
    proc = _start(db, "sigint", 3, 700)
    _wait_for(proc, "ready")
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) != 0  # KeyboardInterrupt propagates after the cleanup
    info = read.run(db, "child")
    assert info["status"] == "failed"
    assert "KeyboardInterrupt" in info["summary"]["error"]
    assert info["num_spans"] == 2100
    assert Store.open(db).recovered_runs == []  # already final: nothing to recover


def test_ctrl_c_as_a_committed_flush_lets_the_file_go_stores_its_rows_once(tmp_path, monkeypatch):
    """Ctrl-C while a committed flush's connection closes (DuckDB checkpoints there; a sweep's
    store closes one after every commit): the interrupt's own flush committed the same rows
    again, every seq twice."""
    import contextlib

    from kvtrace.store import writer
    from kvtrace.store.read._sql import connect, query
    from tests.store.writer_child import batch

    opened, armed = writer.write_connection, [False]

    @contextlib.contextmanager
    def interrupted_as_it_closes(path, timeout_s):
        with opened(path, timeout_s=timeout_s) as con:
            yield con
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt  # (as the signal's handler raises it once close() returns)

    db = tmp_path / "s.duckdb"
    monkeypatch.setattr(writer, "write_connection", interrupted_as_it_closes)
    with pytest.raises(KeyboardInterrupt), Store.open(db) as store:
        run_id = store.create_run("sweep-like")
        store.append_spans(batch(0, 500), run_id=run_id, flush_when_due=False)
        armed[0] = True
        store.flush()
    with connect(db) as con:
        seq = query(con, "SELECT seq FROM spans WHERE run_id = $r ORDER BY seq", {"r": run_id})["seq"]
    assert seq.to_list() == list(range(500))
    assert read.run(db, run_id)["status"] == "failed"


INTERRUPTED_CHDB_FLUSH = """
import os, signal, sys
from kvtrace import cli
from kvtrace.store.clickhouse import client

insert, families = client.ClickHouseConnection.insert_arrow, []

def insert_arrow(self, table, rows):
    insert(self, table, rows)
    if "seq" in rows.column_names:
        families.append(table)
        if len(families) == 1:  # Ctrl-C between the first and second family insert of a flush
            os.kill(os.getpid(), signal.SIGINT)

client.ClickHouseConnection.insert_arrow = insert_arrow
sys.argv = ["kvtrace", *sys.argv[1:]]
cli.main()
"""


def test_ctrl_c_between_a_chdb_flushs_inserts_stores_its_rows_once(tmp_path):
    """A ClickHouse flush is one insert per family table, no transaction: Ctrl-C between two
    (a sweep's writer flushes in the main thread) had the interrupt's own flush insert the
    first families again."""
    from kvtrace.store.backend import clickhouse_target
    from kvtrace.store.clickhouse import client
    from tests.conftest import MOONCAKE

    db = f"chdb:{tmp_path / 'ch'}"
    proc = subprocess.run([sys.executable, "-c", INTERRUPTED_CHDB_FLUSH, "sweep", str(MOONCAKE), "--limit", "40",
                           "--param", "capacity_blocks=3000,4000", "--workers", "1", "--db", db],
                          capture_output=True, text=True, cwd=ROOT, timeout=300, check=False)
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr
    with client.connect(clickhouse_target(db)) as con:
        seq = con.ch_frame("SELECT seq FROM spans WHERE run_id = 'r1' ORDER BY seq")["seq"].to_list()
    assert seq and seq == list(range(len(seq)))


FULL_DISK = """
import resource, runpy, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (2_500_000, 2_500_000))
sys.argv = ["kvtrace", *sys.argv[1:]]
runpy.run_module("kvtrace.cli", run_name="__main__")
"""


def test_a_disk_that_refuses_writes_is_one_line_and_keeps_what_was_committed(tmp_path):
    """The store's file may grow to 2.5 MB: the replay's spans outgrow it. One line naming the
    file, exit 2, no traceback; the store still opens, its run is not complete, and the
    spans committed before the refusal are an exact prefix (contiguous seq from 0)."""
    from kvtrace.store.read._sql import connect, query
    from tests.conftest import MOONCAKE

    db = tmp_path / "full.duckdb"
    proc = subprocess.run([sys.executable, "-c", FULL_DISK, "replay", str(MOONCAKE), "--limit", "300", "--db", str(db)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"kvtrace: error: {db}: cannot write: "), lines[0]
    runs = read.runs(db)
    assert runs.height == 1 and runs["status"][0] != "complete"
    with connect(db) as con:
        seq = query(con, "SELECT seq FROM spans WHERE run_id = $r ORDER BY seq", {"r": runs["run_id"][0]})["seq"]
    assert seq.to_list() == list(range(seq.len()))


KILLED_WHILE_CREATING = """
import os, sys, time
from kvtrace.store import Store, writer

def init_schema(con, path):  # DuckDB has made the file: hang before the schema's transaction commits
    print("ready", flush=True)
    time.sleep(60)

writer._init_schema = init_schema
Store.open(sys.argv[1])
"""


def test_a_store_whose_creation_was_killed_9_is_said_so_and_a_writer_creates_it(tmp_path):
    """kill -9 between DuckDB making the file and the schema's commit leaves an empty DuckDB
    file that nothing can remove: readers called it "not a kvtrace store (DuckDB file without
    a kvtrace_meta table)", as if it were another program's database."""
    from kvtrace.store.connection import EMPTY_DATABASE

    db = tmp_path / "new.duckdb"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WHILE_CREATING, str(db)], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    finally:
        proc.kill()
        proc.wait()
    with pytest.raises(StoreError) as err:
        read.runs(db)
    assert str(err.value) == f"{db}: {EMPTY_DATABASE}"
    with Store.open(db) as store:  # the next writer makes the store there
        store.finish_run(store.create_run("after"))
    assert read.runs(db)["status"].to_list() == ["complete"]
