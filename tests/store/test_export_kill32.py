"""Probe 32 (kills): an export killed with -9 in its rename phase leaves nothing behind once
the next export into the folder is done."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kvtrace.store import Store, export_parquet
from tests.store.scenario import scenario_rows, scenario_table

ROOT = str(Path(__file__).resolve().parents[2])


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
def test_an_export_killed_while_it_renames_leaves_no_hidden_file_after_the_next(scenario_db, tmp_path, k):
    """The rename phase sets each earlier file aside (``.<table>.<pid>-<hex>.parquet.tmp.old``)
    before it renames the new one in; a kill -9 there left that file for good: the next export's
    clean-up of a dead export's files knew the ``.tmp`` names alone."""
    db, first = scenario_db
    with Store.open(db) as store:
        second = store.create_run("other")
        store.append_spans(scenario_table(scenario_rows()[:3]), run_id=second)
        store.finish_run(second)
    out = tmp_path / "out"
    export_parquet(db, first, out)
    proc = subprocess.run([sys.executable, "-m", "tests.store.export_kill32_driver", str(db), second, str(out),
                           str(k)], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert any(name.startswith(".") for name in os.listdir(out))  # (the kill left its files)
    written = export_parquet(db, first, out)
    assert sorted(os.listdir(out)) == ["evicted_blocks.parquet", "runs.parquet", "spans.parquet"]
    assert pq.read_table(written["runs"]).column("run_id").to_pylist() == [first]
    assert set(pq.read_table(written["spans"]).column("run_id").to_pylist()) == {first}
