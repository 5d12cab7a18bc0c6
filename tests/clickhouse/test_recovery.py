"""A chdb writer killed halfway through a flush: recovery keeps the contiguous seq prefix."""

from __future__ import annotations

import subprocess
import sys

from kvtrace.store import Store, read
from kvtrace.store.backend import clickhouse_target
from kvtrace.store.clickhouse import client
from tests.conftest import TRACES

TRACE = str(TRACES / "mooncake_synthetic_trace.jsonl")


def _seqs(db: str) -> list[int]:
    with client.connect(clickhouse_target(db)) as con:
        return con.ch_frame("SELECT seq FROM spans WHERE run_id = 'r1' ORDER BY seq")["seq"].to_list()


def test_a_flush_cut_between_its_inserts_leaves_no_seq_gap(tmp_path):
    """A flush is one insert per family table (ClickHouse has no transactions): a kill -9
    between two kept part of the last batch, and the run's seq had a gap for good."""
    db, marker = f"chdb:{tmp_path / 'ch'}", tmp_path / "committed"
    proc = subprocess.run([sys.executable, "-m", "tests.clickhouse.partial_flush_driver", TRACE, "40", db,
                           str(marker), "3"], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 9, proc.stderr
    committed = int(marker.read_text())
    before = _seqs(db)
    assert len(before) > committed > 0 and before != list(range(len(before)))  # the cut left a gap

    with Store.open(db) as store:  # a writer that finds the dead one's run recovers it
        assert store.recovered_runs == ["r1"]
    assert read.run(db, "r1")["status"] == "incomplete"
    assert _seqs(db) == list(range(committed))  # every fully committed flush, nothing of the cut one
