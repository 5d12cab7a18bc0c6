"""One writer process, readers in another: reads succeed while a replay writes."""

from __future__ import annotations

import os
import subprocess
import sys

import duckdb
import pyarrow as pa
import pytest

from kvtrace.store import Store, read
from tests.store.test_crash import ROOT, _start, _wait_for


def test_reader_sees_each_flush_while_writer_process_is_alive(tmp_path):
    db = tmp_path / "lockstep.duckdb"
    proc = _start(db, "lockstep", 4, 250)
    try:
        for i in range(1, 5):
            assert proc.stdout.readline().strip() == f"flushed {i * 250}"
            runs = read.runs(db)  # the writer process is alive and mid-run
            assert runs.select("status", "num_spans").rows() == [("running", i * 250)]
            steps = read.usage_over_time(db, "child", window_ns=1000)
            assert steps.filter(steps["group_id"] == 0).height == i * 250
            proc.stdin.write("\n")
            proc.stdin.flush()
        _wait_for(proc, "done")
    finally:
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
    assert read.run(db, "child")["status"] == "complete"


@pytest.mark.parametrize("hold", [False, True], ids=["connection-per-flush", "held-connection"])
def test_reads_in_a_loop_never_fail_while_writer_streams(tmp_path, hold):
    """A writer that holds the file between flushes lets go at its next flush once a reader
    waits, so the reads in a loop all get in, as with a connection per flush."""
    db = tmp_path / "stream.duckdb"
    Store.open(db)  # create the file so the first read finds a store
    proc = _start(db, "stream", 15, 200, hold)
    seen = []
    while proc.poll() is None:
        frame = read.runs(db)
        if frame.height:
            seen.append(frame["num_spans"][0])
    assert proc.wait() == 0
    final = read.runs(db).row(0, named=True)
    assert (final["status"], final["num_spans"]) == ("complete", 3000)
    assert seen == sorted(seen)  # committed flushes only ever grow
    assert all(n % 200 == 0 for n in seen)  # never a half-written batch


HOLDER = """
import sys, time
from kvtrace.store.connection import read_connection
with read_connection(sys.argv[1]):
    print("holding", flush=True)
    time.sleep(1.0)
print("released", flush=True)
"""


def test_writer_waits_for_a_reader_process_holding_the_file(tmp_path):
    db = tmp_path / "held.duckdb"
    store = Store.open(db)
    run_id = store.create_run("held")
    store.append_spans(pa.table({"name": ["kvtrace.engine.step"] * 3, "start_ns": [1, 2, 3]}), run_id=run_id)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(db)], stdout=subprocess.PIPE, text=True,
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert holder.stdout.readline().strip() == "holding"
    # the reader process holds DuckDB's shared lock now: a read-write open must wait for it
    with pytest.raises(duckdb.IOException, match="lock"):
        duckdb.connect(str(db))
    store.flush()  # retries until the reader lets go, then commits
    assert holder.stdout.readline().strip() == "released"
    assert holder.wait() == 0
    assert read.runs(db)["num_spans"].to_list() == [3]


def test_read_only_open_fails_fast_without_store(tmp_path):
    missing = tmp_path / "missing.duckdb"
    try:
        read.runs(missing)
    except Exception as err:
        assert str(missing) in str(err)
    else:
        raise AssertionError("expected an error")
    assert not missing.exists()


SECOND_WRITER = """
import sys
from kvtrace.store import Store
store = Store.open(sys.argv[1], lock_timeout_s=20)
run_id = store.create_run("second", run_id="second")
store.finish_run(run_id)
print("written", flush=True)
"""


def test_a_second_writer_gets_in_while_a_held_writer_streams(tmp_path):
    db = tmp_path / "two.duckdb"
    proc = _start(db, "lockstep", 3, 100, hold=True)
    try:
        assert proc.stdout.readline().strip() == "flushed 100"  # the child holds the file now
        with pytest.raises(duckdb.IOException, match="lock"):
            duckdb.connect(str(db), read_only=True)
        second = subprocess.Popen([sys.executable, "-c", SECOND_WRITER, str(db)], stdout=subprocess.PIPE,
                                  text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
        marker = f"{db}.writer-waiting"
        while not os.path.exists(marker):  # the second writer found the file held and said so
            assert second.poll() is None, "the second writer got in while the file was held"
        proc.stdin.write("\n")  # the child's next flush sees the marker and lets go after it
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "flushed 200"
        assert second.stdout.readline().strip() == "written" and second.wait(timeout=60) == 0
        proc.stdin.write("\n\n")  # the third flush, then finish_run
        proc.stdin.flush()
        _wait_for(proc, "done")
    finally:
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
    assert dict(read.runs(db).select("run_id", "status").iter_rows()) == {"child": "complete", "second": "complete"}


def test_a_held_store_lets_go_of_the_file_when_its_spans_are_flushed(tmp_path):
    from kvtrace.instrument import DuckDBSpanExporter

    db = tmp_path / "release.duckdb"
    store = Store.open(db, hold=True)
    run_id = store.create_run("held")
    exporter = DuckDBSpanExporter(store, run_id)
    store.append_spans(pa.table({"name": ["kvtrace.engine.step"] * 2, "start_ns": [1, 2]}), run_id=run_id)
    store.flush()
    assert store._held is not None and store._held.held  # kept between flushes
    store.append_spans(pa.table({"name": ["kvtrace.engine.step"], "start_ns": [3]}), run_id=run_id)
    exporter.force_flush()
    assert not store._held.held
    assert read.runs(db)["num_spans"].to_list() == [3]  # a reader gets in at once
    store.append_spans(pa.table({"name": ["kvtrace.engine.step"], "start_ns": [4]}), run_id=run_id)
    store.finish_run(run_id)  # (opens the file again to flush)
    assert read.runs(db).select("status", "num_spans").rows() == [("complete", 4)]
