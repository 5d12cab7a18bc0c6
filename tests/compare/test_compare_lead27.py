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


def test_a_capture_diffed_with_a_replay_is_said_to_name_no_kinds_not_to_be_the_vllm_backend(tmp_path):
    """A live capture's publishes are `vllm_stored`: the note said "the vllm backend infers publish
    kinds" of a capture, which infers nothing."""
    from kvtrace.compare.source import diff_runs
    from kvtrace.replay.run import RunSpec, run_replay
    from kvtrace.store.writer import Store
    from tests.store.test_store_lead27 import capture_five_blocks

    db = tmp_path / "c.duckdb"
    with Store.open(db) as store:
        live = store.create_run("vllm", mode="live")
        capture_five_blocks(tmp_path, store, live)
        store.finish_run(live, summary={"requests": 0, "events": 7})
    replayed = run_replay(RunSpec("gen:mixed", preset="dense-attention", limit=20), db=str(db)).run_id
    assert replayed is not None
    notes = " ".join(diff_runs(db, live, replayed, force=True).notes)
    assert "A is a live capture: vLLM's KV events name no publish kind" in notes
    assert "the vllm backend infers" not in notes


@pytest.mark.timeout(300)
def test_a_swept_studys_table_shows_the_external_tiers_hit_rate_where_a_run_had_a_tier():
    """A sweep of external_capacity_blocks showed the local cache's columns alone (sweep probe)."""
    tiered = run_study("shared-prefix-pinning", limit=20, sweep="external_capacity_blocks=10,4096")
    headers = [str(c.header) for c in tiered.sweep_table().columns]
    assert "Δ external_prefix_cache_hit_rate" in headers
    plain = run_study("shared-prefix-pinning", limit=20, sweep="capacity_blocks=64,256")
    assert "Δ external_prefix_cache_hit_rate" not in [str(c.header) for c in plain.sweep_table().columns]


@pytest.mark.timeout(300)
def test_json_gives_each_percentile_one_verdict_in_both_of_its_rows():
    """`--json` said "same" of p50_itl_ms (delta 0) in `verdicts.metrics` and null in `verdicts.latency`."""
    verdicts = to_json(run_study("shared-prefix-pinning", limit=60).points[0].diff)["verdicts"]
    shared = set(verdicts["latency"]) & set(verdicts["metrics"])
    assert "p50_itl_ms" in shared and verdicts["latency"]["p50_itl_ms"] == "same"
    assert {k: verdicts["latency"][k] for k in shared} == {k: verdicts["metrics"][k] for k in shared}
