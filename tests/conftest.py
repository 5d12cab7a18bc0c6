"""Fixtures shared across packages.

``replayed_store``: a small REAL replay (generated workload, kimi-hybrid engine, spans
through the instrumentor into a DuckDB file) holding two runs of the same trace: all
behaviours on (run_on) and shared-prefix-pinning off (run_off). Session-scoped: it is
built once and read by the dashboard, diff and notebook tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

# Public traces shipped in the repository (provenance and licences: tests/data/README.md).
TRACES = Path(__file__).resolve().parent / "data"
MOONCAKE = TRACES / "mooncake_synthetic_trace.jsonl"

REPLAYED_TRACE = "gen:study-shared-prefix-pinning"
REPLAYED_LIMIT = 60  # requests over three system prompts; pinning off loses their reuse
REPLAYED_OFF = "shared-prefix-pinning"


@dataclass(frozen=True)
class ReplayedStore:
    path: str
    run_on: str
    run_off: str
    summary_on: dict
    summary_off: dict


@pytest.fixture(scope="session")
def replayed_store(tmp_path_factory) -> ReplayedStore:
    from kvtrace.replay.run import RunSpec, run_replay

    db = tmp_path_factory.mktemp("replayed") / "runs.duckdb"
    on = run_replay(RunSpec(REPLAYED_TRACE, limit=REPLAYED_LIMIT, name="pinning on"), db=db)
    off = run_replay(
        RunSpec(REPLAYED_TRACE, limit=REPLAYED_LIMIT, without=(REPLAYED_OFF,), name=f"pinning without {REPLAYED_OFF}"),
        db=db,
    )
    return ReplayedStore(str(db), on.run_id, off.run_id, on.summary, off.summary)


@pytest.fixture(scope="session")
def vllm_api():
    """vLLM 0.33's scheduler-side API, imported once for the whole session (10-25 s).

    The suite requires vLLM (``make test`` installs it with ``make vllm``): a missing or
    wrong install fails here with the one-line reason instead of skipping."""
    from kvtrace.engine.backends.vllm import load_vllm

    return load_vllm()
