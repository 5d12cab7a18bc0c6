"""Fixtures for the dashboard tests.

``dashboard_db``: the lead's ``replayed_store`` (tests/conftest.py), a small REAL replay
with two runs of one trace, a behaviour on and off. Every expected value (run ids,
summaries, series) is read back from the store itself.

``stale_db``: that replay's behaviour switch produces no stale hashes or divergent
outputs, so the correctness drill-down is also tested on ``synthetic_run``: the same span
kinds written through the store's real writer into a real DuckDB file, with
``transient-checkpoint-retention`` off leaving stale hashes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def dashboard_db(replayed_store) -> str:
    return replayed_store.path


@pytest.fixture(scope="session")
def stale_db(tmp_path_factory) -> str:
    import synthetic_run

    db = tmp_path_factory.mktemp("dashboard") / "synthetic.duckdb"
    synthetic_run.write_runs(str(db))
    return str(db)
