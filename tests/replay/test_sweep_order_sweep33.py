"""A sweep's runs are listed in one order wherever they ran (sweep33).

``created`` was the time each replay began in its worker: a Ray task (or a second local
worker) that began a later combination's replay a second earlier than an earlier one's
gave the later run the older time, and ``kvtrace runs`` ("newest first") listed r1 above
r2 on Ray where the sequential sweep listed r2 above r1.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvtrace.replay.run import RunSpec
from kvtrace.replay.sweep import run_sweep
from kvtrace.store import read
from tests.conftest import MOONCAKE

BASE = RunSpec(str(MOONCAKE), mode="cache-only", limit=60)


def test_a_later_combination_whose_replay_began_first_is_still_listed_as_the_newer_run(tmp_path, monkeypatch):
    import kvtrace.store.schema as schema

    # the replays' start times as a parallel sweep can see them: the second began first
    starts = iter(["2026-01-01T00:00:09+00:00", "2026-01-01T00:00:08+00:00", "2026-01-01T00:00:08+00:00"])
    real = schema.created_now
    monkeypatch.setattr(schema, "created_now", lambda: next(starts, None) or real())
    db = tmp_path / "s.duckdb"
    result = run_sweep(replace(BASE), [("capacity_blocks", [20, 40, 80])], db=db, workers=1)
    assert [r.run_id for r in result.runs] == ["r1", "r2", "r3"]
    listed = read.runs(db)
    assert listed["run_id"].to_list() == ["r3", "r2", "r1"]  # newest first, as the sequential sweep lists them
    created = [read.run(db, f"r{i}")["created"] for i in (1, 2, 3)]
    assert created == sorted(created)  # no run older than one stored before it
    assert created[0] == "2026-01-01T00:00:09+00:00"  # (the first replay's own start)


@pytest.mark.parametrize("workers", [1, 2])
def test_the_listing_is_the_same_for_any_number_of_workers(tmp_path, workers):
    db = tmp_path / f"w{workers}.duckdb"
    run_sweep(replace(BASE), [("capacity_blocks", [20, 40, 80, 160])], db=db, workers=workers)
    assert read.runs(db)["run_id"].to_list() == ["r4", "r3", "r2", "r1"]
