from __future__ import annotations

import pytest

from kvtrace.replay.run import RunSpec, run_replay
from kvtrace.store import Store
from tests.store.scenario import scenario_table


@pytest.fixture()
def scenario_db(tmp_path):
    """A finished run ``sc`` holding the hand-built scenario; returns (path, run_id)."""
    return make_scenario_db(tmp_path / "scenario.duckdb")


@pytest.fixture(scope="module")
def scenario_db_once(tmp_path_factory):
    """``scenario_db`` made once for a module whose tests only read it; returns (path, run_id)."""
    return make_scenario_db(tmp_path_factory.mktemp("scenario") / "scenario.duckdb")


def make_scenario_db(path):
    """The store of ``scenario_db`` at ``path``: (path, run_id)."""
    store = Store.open(path)
    run_id = store.create_run("scenario", run_id="sc", trace_source="hand-built", trace_digest="t1",
                              config={"capacity": 8}, behaviours={"checkpoint_retention": True},
                              mode="engine", created="2026-01-02T03:04:05Z")
    store.append_spans(scenario_table(), run_id=run_id)
    store.finish_run(run_id, digest="abc", summary={"prefix_cache_hit_rate": 0.25})
    return path, run_id


@pytest.fixture()
def small_replay(tmp_path):
    """A small engine replay (gen:mixed: 40 requests, no content, 64 blocks)
    recorded into a new store; returns (path, run_id)."""
    db = tmp_path / "s.duckdb"
    result = run_replay(RunSpec("gen:mixed", limit=40, content=False, capacity_blocks=64), db=db)
    assert result.run_id is not None
    return db, result.run_id
