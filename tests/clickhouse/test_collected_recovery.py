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
