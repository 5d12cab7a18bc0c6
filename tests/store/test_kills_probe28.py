"""Probe 28 (kills): what a kill -9 of a replay loses, measured against the store's commits."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvtrace.instrument import BulkSpanProcessor, DuckDBSpanExporter, KVCacheInstrumentor, build_tracer_provider
from kvtrace.store.errors import StoreError
from kvtrace.store.writer import Store
from tests.instrument.helpers import store_rows
from tests.support.synthetic_spans import synthetic_steps

ROOT = str(Path(__file__).resolve().parents[2])


class _Watched(Store):
    """A store that says when a flush commits rows."""

    committed: threading.Event

    def flush(self) -> int:
        rows = super().flush()
        if rows:
            self.committed.set()
        return rows


def test_a_hand_over_is_committed_once_due_not_at_the_next_one(tmp_path):
    """The store commits once a second, but checked only when spans were appended: the spans
    of one hand-over waited for the next, which a slow engine (256 steps of 24 ms at
    dense-attention) brought 6 s later, and a kill -9 lost those 6 s. The export thread
    now commits them once they are due, with no hand-over after them."""
    db = tmp_path / "s.duckdb"
    with _Watched.open(db, hold=True, flush_interval_s=1.0) as store:
        store.committed = threading.Event()
        run_id = store.create_run("t")
        provider = build_tracer_provider(store=store, run_id=run_id, background=True)
        inst = KVCacheInstrumentor(provider, run_id=run_id)
        for batch in synthetic_steps(20, seed=3):
            inst(batch)
        store.flush()  # (nothing buffered: the once-a-second interval starts now)
        handed = inst.flush()
        assert handed > 0
        # no further hand-over: the engine is in a long step
        assert store.committed.wait(timeout=15), "the hand-over waited for another one to be committed"
        provider.force_flush()
        provider.shutdown()
        store.finish_run(run_id)
    assert len(store_rows(db, run_id)) == handed


def test_an_idle_commits_error_reaches_the_producer_as_an_exports_does(tmp_path):
    """A commit the export thread makes between hand-overs that fails (a full disk) is raised
    in the replay at its next call, as a failed export is, never lost on the thread."""
    failed = threading.Event()

    def idle_flush() -> bool:
        failed.set()
        raise StoreError("s.duckdb", "the disk refused a write")

    with Store.open(tmp_path / "s.duckdb") as store:
        run_id = store.create_run("t")
        proc = BulkSpanProcessor(DuckDBSpanExporter(store, run_id), background=True, idle_flush=idle_flush)
        inst = KVCacheInstrumentor(processors=[proc], run_id=run_id)
        for batch in synthetic_steps(5, seed=1):
            inst(batch)
        inst.flush()
        assert failed.wait(timeout=15)
        deadline = time.monotonic() + 15
        while proc._error is None and time.monotonic() < deadline:  # (set just after idle_flush raised)
            time.sleep(0.01)
        with pytest.raises(StoreError, match="disk refused"):
            proc.force_flush()
        proc.shutdown()


READER = """
import sys
from kvtrace.store.connection import fetch_value, read_connection
with read_connection(sys.argv[1], timeout_s=10) as con:
    print(fetch_value(con, "SELECT count(*) FROM spans"))
"""


def test_a_reader_gets_the_file_between_hand_overs(tmp_path):
    """A replay holds its file between commits and lets it go after one when a reader waits:
    with no hand-over coming (a slow engine step) the reader waited for the next one
    (`kvtrace runs` took 7.6 s beside a dense-attention replay). Now it is let go at once,
    and the reader sees what was committed."""
    db = tmp_path / "s.duckdb"
    with _Watched.open(db, hold=True, flush_interval_s=1.0) as store:
        store.committed = threading.Event()
        run_id = store.create_run("t")
        provider = build_tracer_provider(store=store, run_id=run_id, background=True)
        inst = KVCacheInstrumentor(provider, run_id=run_id)
        for batch in synthetic_steps(20, seed=5):
            inst(batch)
        handed = inst.flush()
        assert store.committed.wait(timeout=15)
        # no further hand-over; a reader in another process asks for the file
        reader = subprocess.run([sys.executable, "-c", READER, str(db)], capture_output=True, text=True,
                                timeout=60, check=False, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
        assert reader.returncode == 0, reader.stderr
        assert int(reader.stdout) == handed
        provider.force_flush()
        provider.shutdown()
        store.finish_run(run_id)
