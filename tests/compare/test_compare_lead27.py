"""A study without a store is diffed from the runs kept in memory (``source.diff_results``)
as a stored pair is diffed: it had no per-request changes and no latency CIs, so its
median TTFT of -36.9% carried no verdict beside the same study's "better" with ``--db``."""

from __future__ import annotations

import pytest

from kvtrace.compare.render import to_json
from kvtrace.compare.source import diff_results
from kvtrace.compare.study import run_study

_STORE_ONLY = {"spans"}  # (a stored run counts its spans)


@pytest.mark.timeout(300)
def test_a_study_without_a_store_gives_the_stored_studys_verdicts_cis_and_request_changes(tmp_path):
    kept = to_json(run_study("shared-prefix-pinning", limit=60).points[0].diff)
    stored = to_json(run_study("shared-prefix-pinning", db=tmp_path / "s.duckdb", limit=60).points[0].diff)
    assert kept["latency"] and kept["latency"] == stored["latency"]
    assert kept["bootstrap"] == stored["bootstrap"] and kept["bootstrap"]["paired"]
    assert kept["requests"] == stored["requests"] and kept["requests"]["gained"] > 0
    assert kept["notes"] == stored["notes"]
    assert kept["verdicts"]["latency"] == stored["verdicts"]["latency"]
    metrics = {k: v for k, v in stored["verdicts"]["metrics"].items() if k not in _STORE_ONLY}
    assert kept["verdicts"]["metrics"] == metrics
    assert kept["verdicts"]["metrics"]["median_ttft_ms"] == "better"


def test_cache_only_results_kept_in_memory_are_diffed_without_latency_or_request_pairing():
    """As stored: a cache-only run keeps no latencies and no per-request hits to compare."""
    only = diff_results({"requests": 1}, [{"request_id": "a", "hit_tokens": 3}],
                        {"requests": 1}, [{"request_id": "a", "hit_tokens": 5}], run_a={}, run_b={})
    assert only.latency == [] and only.requests is None
