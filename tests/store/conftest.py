from __future__ import annotations

import pytest

from kvtrace.store import Store
from tests.store.scenario import scenario_table


@pytest.fixture()
def scenario_db(tmp_path):
    """A finished run ``sc`` holding the hand-built scenario; returns (path, run_id)."""
    path = tmp_path / "scenario.duckdb"
    store = Store.open(path)
    run_id = store.create_run("scenario", run_id="sc", trace_source="hand-built", trace_digest="t1",
                              config={"capacity": 8}, behaviours={"checkpoint_retention": True},
                              mode="engine", created="2026-01-02T03:04:05Z")
    store.append_spans(scenario_table(), run_id=run_id)
    store.finish_run(run_id, digest="abc", summary={"prefix_cache_hit_rate": 0.25})
    return path, run_id
