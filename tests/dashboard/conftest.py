"""Fixtures for the dashboard tests.

``dashboard_db`` is the store every dashboard test reads: two runs of one trace, a
behaviour on and off. Until the lead's ``replayed_store`` (a real small replay) exists,
it is written by ``synthetic_run`` through the store's real writer into a real DuckDB
file. To swap, make ``dashboard_db`` return the replayed store's path: the tests read
every expected value (run ids, summaries) back from the store itself.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

APP = str(Path(__file__).resolve().parents[2] / "kvtrace" / "dashboard" / "app.py")


@pytest.fixture(scope="session")
def dashboard_db(tmp_path_factory) -> str:
    import synthetic_run

    db = tmp_path_factory.mktemp("dashboard") / "runs.duckdb"
    synthetic_run.write_runs(str(db))
    return str(db)
