"""An API caller's store of another type than a path or URL is one ConfigError at ``--db``,
before anything runs or is written: ``run_demo(0)`` and ``run_sweep(..., db=0)`` wrote a
DuckDB file named "0" (None, True, 1.5, a list: theirs) in the current directory, a sweep's
only after all its replays (re-probe 30)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvtrace.compare.demo import run_demo
from kvtrace.errors import ConfigError
from kvtrace.replay.run import RunSpec
from kvtrace.replay.sweep import run_sweep

NOT_A_STORE = [0, 1.5, True, ["x"], np.array(["a.duckdb"]), b"s.duckdb"]


@pytest.mark.parametrize("db", [None, *NOT_A_STORE], ids=repr)
def test_a_demo_into_what_is_no_store_is_refused_and_writes_nothing(tmp_path, monkeypatch, db):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^--db: .*: expected a store's path or URL, a string$"):
        run_demo(db, progress=False, limit=2)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("db", NOT_A_STORE, ids=repr)
def test_a_sweep_into_what_is_no_store_is_refused_before_its_replays(tmp_path, monkeypatch, db):
    monkeypatch.chdir(tmp_path)
    replayed = []
    with pytest.raises(ConfigError, match=r"^--db: .*: expected a store's path or URL, a string$"):
        run_sweep(RunSpec("gen:chat", limit=2, mode="cache-only"), [("capacity_blocks", [10, 20])], db=db,
                  workers=1, on_done=replayed.append)
    assert replayed == [] and os.listdir(tmp_path) == []
