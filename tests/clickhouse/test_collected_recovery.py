"""A chdb store's recovery of a dead collector's run keeps every span the collector
acknowledged: a collected run's spans keep their sender's ``kvtrace.seq``, whose gaps are no
partial flush (the trim at the first gap deleted acknowledged spans: collect2's finding)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

from kvtrace.store.read._sql import connect, query
from kvtrace.store.writer import Store
from tests.instrument.test_otlp_fix25 import _post, _span


def test_a_dead_collectors_run_keeps_the_spans_it_acknowledged_past_a_seq_gap(tmp_path):
    db = f"chdb:{tmp_path / 'ch'}"
    proc = subprocess.Popen([sys.executable, "-m", "kvtrace.cli", "collect", "--db", db, "--port", "0", "--no-grpc"],
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        url = re.search(r"http://\S+/v1/traces", proc.stderr.readline())
        assert url, "the collector printed no address"
        # seqs 0, 1 and 5: the requests holding 2-4 still in flight (or never delivered)
        assert _post(url.group(0), [_span(1, 0), _span(2, 1)])[0] == 200
        assert _post(url.group(0), [_span(5, 5)])[0] == 200
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    store = Store.open(db)
    try:
        assert store.recovered_runs == ["fix25"]
    finally:
        store.close()
    with connect(db) as con:
        seqs = [s for (s,) in query(con, "SELECT seq FROM spans WHERE run_id = 'fix25' ORDER BY seq", {}).rows()]
        status = query(con, "SELECT status FROM runs WHERE run_id = 'fix25'", {}).rows()
    assert seqs == [0, 1, 5] and status == [("incomplete",)]


_DIES_WITH_A_GAP = """
import os, sys
import pyarrow as pa
from kvtrace.store import Store
from kvtrace.store.schema import named_run_name

db, named = sys.argv[1], sys.argv[2] == "named"
store = Store.open(db, flush_interval_s=0.0)
run = store.create_run(named_run_name("x1") if named else "otlp collector 127.0.0.1:4318", mode="otlp",
                       **({"run_id": "x1"} if named else {}))
spans = pa.table({"name": ["op"] * 3, "start_ns": [1, 2, 3], "end_ns": [2, 3, 4]})
store.append_spans(spans, run_id=run, seq=pa.array([0, 1, 5], pa.int64()))
store.flush()
os._exit(9)  # (as a kill -9: the run left running)
"""


def test_a_collectors_own_run_is_still_trimmed_at_its_first_gap(tmp_path):
    """2eb9070 kept every collected run whole at recovery: the collector's own run, numbered by
    arrival as a replay's, then kept a partial flush no one acknowledged (re-probe C1). A run its
    sender named keeps its sender's gaps; the collector's own is trimmed at its first."""
    import subprocess
    import sys

    kept = {}
    for kind in ("named", "own"):
        db = f"chdb:{tmp_path / kind}"
        done = subprocess.run([sys.executable, "-c", _DIES_WITH_A_GAP, db, kind], capture_output=True, text=True,
                              timeout=120, check=False)
        assert done.returncode == 9, done.stderr[-2000:]
        Store.open(db).close()  # the dead writer's run recovered
        with connect(db) as con:
            kept[kind] = [s for (s,) in query(con, "SELECT seq FROM spans ORDER BY seq", {}).rows()]
    assert kept == {"named": [0, 1, 5], "own": [0, 1]}
