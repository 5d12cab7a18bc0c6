"""Every read function on the hand-built scenario (tests/store/scenario.py), known answers."""

from __future__ import annotations

import polars as pl
import pytest

from kvtrace.errors import KVTraceError
from kvtrace.store import Store, read
from tests.store.scenario import scenario_table


def _series(frame: pl.DataFrame, group: int, col: str) -> list:
    return frame.filter(pl.col("group_id") == group).sort("window_start_ns")[col].to_list()


def test_runs_and_run(scenario_db):
    db, run_id = scenario_db
    runs = read.runs(db)
    assert runs["run_id"].to_list() == ["sc"]
    row = runs.row(0, named=True)
    assert (row["status"], row["digest"], row["mode"], row["num_spans"]) == ("complete", "abc", "engine", 21)
    one = read.run(db, run_id)
    assert one["summary"] == {"token_hit_rate": 0.25}
    assert one["config"] == {"capacity": 8}
    assert one["behaviours"] == {"checkpoint_retention": True}
    assert one["created"] == "2026-01-02T03:04:05Z"


def test_unknown_run_is_a_user_error(scenario_db):
    db, _ = scenario_db
    with pytest.raises(KVTraceError, match="no run with id 'nope'") as err:
        read.hit_rate_over_time(db, "nope")
    assert str(db) in str(err.value)


def test_span_counts(scenario_db):
    counts = dict(read.span_counts(*scenario_db).select("name", "spans").iter_rows())
    assert counts["kvtrace.cache.lookup"] == 6 and counts["kvtrace.cache.evict"] == 2
    assert counts["kvtrace.verify.stale_hash"] == 1 and counts["kvtrace.request"] == 2


def test_hit_rate_over_time_overall_and_per_group(scenario_db):
    frame = read.hit_rate_over_time(*scenario_db, window_ns=1000)
    assert _series(frame, -1, "query_tokens") == [64, 64, 96, 32]
    assert _series(frame, -1, "hit_tokens") == [0, 32, 16, 16]
    assert _series(frame, -1, "cum_hit_rate")[-1] == pytest.approx(64 / 256)
    assert _series(frame, 0, "hit_tokens") == [0, 32, 16, 16]
    assert _series(frame, 1, "hit_tokens") == [0, 16, 16, 0]
    assert _series(frame, 1, "cum_hit_rate")[-1] == pytest.approx(32 / 256)
    only = read.hit_rate_over_time(*scenario_db, window_ns=2000, group=1)
    assert only["group_id"].unique().to_list() == [1]
    assert only["hit_tokens"].to_list() == [16, 16]


def test_hit_token_sources(scenario_db):
    frame = read.hit_token_sources(*scenario_db, window_ns=1000)
    assert frame.row(1, named=True) == {"window_start_ns": 1000, "local_tokens": 32, "external_tokens": 8,
                                        "computed_tokens": 24}


def test_default_window_covers_run(scenario_db):
    frame = read.hit_token_sources(*scenario_db)  # run spans 0..5000 ns: window 50 ns (100 windows max)
    assert frame["local_tokens"].sum() == 64
    assert frame["window_start_ns"].to_list() == sorted(frame["window_start_ns"].to_list())


def test_usage_over_time(scenario_db):
    frame = read.usage_over_time(*scenario_db, window_ns=1000)
    assert _series(frame, 0, "mean_usage") == pytest.approx([0.1, 0.5, 0.9])
    assert _series(frame, 1, "max_usage") == pytest.approx([0.2, 0.5, 0.4])


def test_evictions_by_reason_and_publish_kind(scenario_db):
    by_reason = dict(read.evictions_by_reason(*scenario_db).select("reason", "blocks").iter_rows())
    assert by_reason == {"lru": 2, "stale_hash": 1}
    by_kind = dict(read.evictions_by_publish_kind(*scenario_db).select("publish_kind", "blocks").iter_rows())
    # block 1 -> C's partial tail; block 2 never republished; block 1 again -> E's checkpoint
    assert by_kind == {"partial_tail": 1, "none": 1, "checkpoint": 1}
    over = read.evictions_over_time(*scenario_db, window_ns=1000, by="publish_kind")
    assert over.filter(pl.col("window_start_ns") == 3000)["key"].to_list() == ["checkpoint"]
    over_reason = read.evictions_over_time(*scenario_db, window_ns=1000, by="reason")
    assert over_reason.select("window_start_ns", "key", "blocks").rows() == [(1000, "lru", 2), (3000, "stale_hash", 1)]
    with pytest.raises(ValueError):
        read.evictions_over_time(*scenario_db, by="colour")


def test_eviction_attribution_chain(scenario_db):
    att = read.eviction_attribution(*scenario_db)
    # misses on h3 / h7 (never cached) and A's cold miss on h1 (evicted only later) are not attributed
    assert att["miss_seq"].to_list() == [10, 11, 20]
    d, e, g = att.rows(named=True)
    assert (d["miss_request_id"], d["missed_hash"], d["evict_reason"], d["block_id"]) == ("D", "h1", "lru", 1)
    assert (d["publish_kind"], d["publish_request_id"], d["evict_request_id"]) == ("partial_tail", "C", "C")
    assert (e["missed_hash"], e["block_id"], e["publish_kind"]) == ("h2", 2, None)
    assert (g["missed_hash"], g["evict_reason"], g["age"], g["publish_kind"], g["publish_request_id"]) == (
        "h9", "stale_hash", 2, "checkpoint", "E")
    flows = read.eviction_attribution_flows(*scenario_db)
    assert set(flows.select("publish_kind", "evict_reason", "prefix").rows()) == {
        ("partial_tail", "lru", "h1"), ("none", "lru", "h2"), ("checkpoint", "stale_hash", "h1")}


LIVE_OR_MATERIALISED = (
    read.eviction_attribution,
    read.eviction_attribution_flows,
    read.evictions_by_publish_kind,
    lambda db, r: read.evictions_over_time(db, r, 1000, by="publish_kind"),
    read.block_histograms,
    read.span_counts,
    lambda db, r: read.latency_cdf(db, r, "itl"),
    lambda db, r: read.runs(db).select("run_id", "num_spans"),
)


def test_running_run_answers_equal_finished_run(tmp_path):
    """A running run computes the derived tables on the fly: same answers as materialised."""
    store = Store.open(tmp_path / "live.duckdb")
    run_id = store.create_run("live")
    store.append_spans(scenario_table(), run_id=run_id)
    store.flush()
    assert read.runs(store.path)["status"].to_list() == ["running"]
    live = [f(store.path, run_id) for f in LIVE_OR_MATERIALISED]
    assert live[0].height == 3 and live[-1]["num_spans"].to_list() == [21]
    store.finish_run(run_id)
    for f, before in zip(LIVE_OR_MATERIALISED, live):
        assert f(store.path, run_id).equals(before)


def test_block_histograms(scenario_db):
    frame = read.block_histograms(*scenario_db)
    got = {(m, lo): c for m, lo, c in frame.select("metric", "bin_lo", "count").iter_rows()}
    assert got == {("lifetime", 1): 2, ("lifetime", 2): 1, ("idle_before_evict", 0): 2,
                   ("idle_before_evict", 1): 1, ("reuse_gap", 1): 2}


def test_per_prefix_reuse(scenario_db):
    frame = read.per_prefix_reuse(*scenario_db, top=2)
    assert frame["root_hash"].to_list() == ["h1", "h2"]
    h1 = frame.row(0, named=True)
    assert (h1["lookups"], h1["hit_lookups"], h1["miss_lookups"], h1["hit_tokens"]) == (4, 2, 2, 48)


def test_stale_hashes_and_divergent_outputs(scenario_db):
    over = read.stale_hashes_over_time(*scenario_db, window_ns=1000)
    assert over.rows() == [(2000, 1, 1, 1)]
    stale = read.stale_hashes(*scenario_db).row(0, named=True)
    assert (stale["block_id"], stale["block_hash"], stale["expected_fingerprint"], stale["actual_fingerprint"]) == (
        10, "h2", 11, 22)
    div = read.divergent_outputs(*scenario_db).row(0, named=True)
    assert (div["request_id"], div["position"], div["expected_token"], div["actual_token"]) == ("E", 3, 5, 6)


def test_stale_hash_chain(scenario_db):
    in_group = read.stale_hash_chain(*scenario_db, "h2", group_id=1)
    assert in_group.select("seq", "role").rows() == [
        (3, "publish"), (11, "lookup"), (13, "overwrite"), (14, "stale_hit")]
    everywhere = read.stale_hash_chain(*scenario_db, "h2")
    assert everywhere["role"].to_list() == ["publish", "publish", "evict", "cow", "lookup", "overwrite", "stale_hit"]


def test_requests_and_latency(scenario_db):
    req = read.requests(*scenario_db)
    assert req["request_id"].to_list() == ["A", "B"]
    assert req["ttft_ns"].to_list() == [900, 1000]
    assert req["e2e_ns"].to_list() == [5000, 2500]
    assert req["queue_ns"].to_list() == [100, 500]
    hits = read.per_request_hits(*scenario_db)
    assert hits.filter(pl.col("request_id") == "B").row(0, named=True)["num_hit_tokens"] == 40
    assert read.latency_percentiles(*scenario_db, "itl", (0.5,)) == {0.5: pytest.approx(1300.0)}
    cdf = read.latency_cdf(*scenario_db, "ttft")
    assert cdf.height == read.QUANTILE_GRID + 1
    assert (cdf["value_ns"][0], cdf["value_ns"][-1], cdf["n"][0]) == (900.0, 1000.0, 2)
    hist = read.latency_histogram(*scenario_db, "itl", bins=4)
    assert hist["count"].sum() == pytest.approx(4) and hist["bin_lo"][0] == 1000.0
    # gaps 1000, 1100, 1500, 2000: the interpolated CDF at 1250 is 1/3 + (150 / 400) / 3
    assert hist["count"][0] == pytest.approx(4 * (1 / 3 + 150 / 400 / 3))
    gaps = read.itl_gaps(*scenario_db, "A")
    assert gaps.select("index", "token_ns", "gap_ns").rows() == [(1, 1900, 1000), (2, 3900, 2000), (3, 5000, 1100)]
    assert read.itl_gaps(*scenario_db).height == 4
    over = read.itl_over_time(*scenario_db, window_ns=1000)
    assert over["requests"].sum() == 2
    with pytest.raises(ValueError):
        read.latency_cdf(*scenario_db, "tpot")


def test_request_waterfall(scenario_db):
    wf = read.request_waterfall(*scenario_db, "A")
    assert wf.select("segment", "start_ns", "end_ns").rows() == [
        ("queue", 0, 100), ("cache_hit", 0, 1000), ("prefill", 100, 500), ("prefill", 500, 900),
        ("decode", 900, 5000)]
    assert read.request_waterfall(*scenario_db, "no-such-request").height == 0
