"""Every read function on the hand-built scenario (tests/store/scenario.py), known answers."""

from __future__ import annotations

import re

import numpy as np
import polars as pl
import pytest

from kvtrace import metrics
from kvtrace.errors import KVTraceError
from kvtrace.store import Store, derived, read
from tests.store.scenario import scenario_rows, scenario_table


def _series(frame: pl.DataFrame, group: int, col: str) -> list:
    return frame.filter(pl.col("group_id") == group).sort("window_start_ns")[col].to_list()


def test_runs_and_run(scenario_db_once):
    db, run_id = scenario_db_once
    runs = read.runs(db)
    assert runs["run_id"].to_list() == ["sc"]
    row = runs.row(0, named=True)
    assert (row["status"], row["digest"], row["mode"], row["num_spans"]) == ("complete", "abc", "engine", 21)
    one = read.run(db, run_id)
    assert one["summary"] == {"prefix_cache_hit_rate": 0.25}
    assert one["config"] == {"capacity": 8}
    assert one["behaviours"] == {"checkpoint_retention": True}
    assert one["created"] == "2026-01-02T03:04:05Z"


def test_unknown_run_is_a_user_error(scenario_db_once):
    db, _ = scenario_db_once
    with pytest.raises(KVTraceError, match="no run with id 'nope'") as err:
        read.hit_counters(db, "nope")
    assert str(db) in str(err.value)


def test_span_counts(scenario_db_once):
    counts = dict(read.span_counts(*scenario_db_once).select("name", "spans").iter_rows())
    assert counts["kvtrace.cache.lookup"] == 6 and counts["kvtrace.cache.evict"] == 2
    assert counts["kvtrace.verify.stale_hash"] == 1 and counts["kvtrace.request"] == 2


def test_hit_counters_count_each_request_once_at_its_first_schedule(scenario_db_once):
    # vLLM's counters (kvtrace.metrics) from the request spans: A first scheduled at 100
    # (no hit, asked 64 of the external tier, preempted once: 66 re-looked-up, 32 hit), B
    # at 1000 (32 local, 8 of its 32 external). The six lookup spans do not count.
    frame = read.hit_counters_over_time(*scenario_db_once, window_ns=1000)
    assert frame["window_start_ns"].to_list() == [0, 1000]
    assert frame["prefix_cache_queries"].to_list() == [64, 64]
    assert frame["prefix_cache_hits"].to_list() == [0, 32]
    assert frame["cum_prefix_cache_hit_rate"].to_list() == [0.0, pytest.approx(32 / 128)]
    whole = read.hit_counters(*scenario_db_once)
    assert whole == {
        "requests": 2, "prefix_cache_queries": 128, "prefix_cache_hits": 32,
        "preempted_prefix_cache_queries": 66, "preempted_prefix_cache_hits": 32,
        "external_prefix_cache_queries": 96, "external_prefix_cache_hits": 8,
        "prompt_tokens_by_source.local_compute": 88, "prompt_tokens_by_source.local_cache_hit": 32,
        "prompt_tokens_by_source.external_kv_transfer": 8,
        "prefix_cache_hit_rate": 0.25, "external_prefix_cache_hit_rate": 8 / 96,
        "preempted_prefix_cache_hit_rate": 32 / 66,
    }
    # by source: the three sum to the prompt tokens, as vLLM's PromptTokenStats invariant says
    assert sum(whole[k] for k in metrics.SOURCE_KEYS) == whole["prefix_cache_queries"]
    # a time range holds the requests first scheduled in it
    later = read.hit_counters(*scenario_db_once, start_ns=1000)
    assert (later["requests"], later["prefix_cache_hits"], later["prefix_cache_queries"]) == (1, 32, 64)
    assert read.hit_counters(*scenario_db_once, end_ns=1000)["prefix_cache_hits"] == 0


def test_group_hit_rates_read_the_lookup_that_admitted_each_request(scenario_db_once):
    # B's lookup at 1000 admitted it ([32, 16] of 64 tokens); A's lookup at 0 came before its
    # first schedule (100): a lookup that did not admit counts nothing.
    assert read.group_hit_rates(*scenario_db_once) == {0: 0.5, 1: 0.25}
    frame = read.group_hit_rate_over_time(*scenario_db_once, window_ns=1000)
    assert frame.select("window_start_ns", "group_id", "group_hit_tokens").rows() == [(1000, 0, 32), (1000, 1, 16)]


def test_cache_only_runs_count_their_one_lookup_per_request(tmp_path):
    rows = [r for r in scenario_rows() if r["name"] == "kvtrace.cache.lookup"]
    store = Store.open(tmp_path / "co.duckdb")
    run_id = store.create_run("cache-only", mode="cache-only/lru")
    store.append_spans(scenario_table(rows), run_id=run_id)
    store.finish_run(run_id)
    got = read.hit_counters(store.path, run_id)
    assert (got["requests"], got["prefix_cache_queries"], got["prefix_cache_hits"]) == (6, 256, 64)
    assert read.group_hit_rates(store.path, run_id) == {0: 64 / 256, 1: 32 / 256}
    store.close()


def test_default_window_covers_run(scenario_db_once):
    frame = read.hit_counters_over_time(*scenario_db_once)  # run spans 0..5000 ns: window 50 ns (100 windows max)
    assert frame["prefix_cache_hits"].sum() == 32
    assert frame["window_start_ns"].to_list() == sorted(frame["window_start_ns"].to_list())


def test_usage_over_time(scenario_db_once):
    frame = read.usage_over_time(*scenario_db_once, window_ns=1000)
    assert _series(frame, 0, "mean_usage") == pytest.approx([0.1, 0.5, 0.9])
    assert _series(frame, 1, "max_usage") == pytest.approx([0.2, 0.5, 0.4])


def test_evictions_by_reason_and_publish_kind(scenario_db_once):
    by_reason = dict(read.evictions_by_reason(*scenario_db_once).select("reason", "blocks").iter_rows())
    assert by_reason == {"lru": 2, "stale_hash": 1}
    by_kind = dict(read.evictions_by_publish_kind(*scenario_db_once).select("publish_kind", "blocks").iter_rows())
    # block 1 -> C's partial tail; block 2 never republished; block 1 again -> E's checkpoint
    assert by_kind == {"partial_tail": 1, "none": 1, "checkpoint": 1}
    over = read.evictions_over_time(*scenario_db_once, window_ns=1000, by="publish_kind")
    assert over.filter(pl.col("window_start_ns") == 3000)["key"].to_list() == ["checkpoint"]
    over_reason = read.evictions_over_time(*scenario_db_once, window_ns=1000, by="reason")
    assert over_reason.select("window_start_ns", "key", "blocks").rows() == [(1000, "lru", 2), (3000, "stale_hash", 1)]
    with pytest.raises(ValueError):
        read.evictions_over_time(*scenario_db_once, by="colour")


def test_eviction_attribution_chain(scenario_db_once):
    att = read.eviction_attribution(*scenario_db_once)
    # misses on h3 / h7 (never cached) and A's cold miss on h1 (evicted only later) are not attributed
    assert att["miss_seq"].to_list() == [10, 11, 20]
    d, e, g = att.rows(named=True)
    assert (d["miss_request_id"], d["missed_hash"], d["evict_reason"], d["block_id"]) == ("D", "h1", "lru", 1)
    assert (d["publish_kind"], d["publish_request_id"], d["evict_request_id"]) == ("partial_tail", "C", "C")
    assert (e["missed_hash"], e["block_id"], e["publish_kind"]) == ("h2", 2, None)
    assert (g["missed_hash"], g["evict_reason"], g["age"], g["publish_kind"], g["publish_request_id"]) == (
        "h9", "stale_hash", 2, "checkpoint", "E")
    flows = read.eviction_attribution_flows(*scenario_db_once)
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


def test_block_histograms(scenario_db_once):
    frame = read.block_histograms(*scenario_db_once)
    got = {(m, lo): c for m, lo, c in frame.select("metric", "bin_lo", "count").iter_rows()}
    assert got == {("lifetime", 1): 2, ("lifetime", 2): 1, ("idle_before_evict", 0): 2,
                   ("idle_before_evict", 1): 1, ("reuse_gap", 1): 2}


def test_per_prefix_reuse(scenario_db_once):
    frame = read.per_prefix_reuse(*scenario_db_once, top=2)
    assert frame["root_hash"].to_list() == ["h1", "h2"]
    h1 = frame.row(0, named=True)
    assert (h1["lookups"], h1["hit_lookups"], h1["miss_lookups"], h1["hit_tokens"]) == (4, 2, 2, 48)


def test_stale_hashes_and_divergent_outputs(scenario_db_once):
    over = read.stale_hashes_over_time(*scenario_db_once, window_ns=1000)
    assert over.rows() == [(2000, 1, 1, 1)]
    stale = read.stale_hashes(*scenario_db_once).row(0, named=True)
    assert (stale["block_id"], stale["block_hash"], stale["expected_fingerprint"], stale["actual_fingerprint"]) == (
        10, "h2", 11, 22)
    div = read.divergent_outputs(*scenario_db_once).row(0, named=True)
    assert (div["request_id"], div["position"], div["expected_token"], div["actual_token"]) == ("E", 3, 5, 6)


def test_stale_hash_chain(scenario_db_once):
    in_group = read.stale_hash_chain(*scenario_db_once, "h2", group_id=1)
    assert in_group.select("seq", "role").rows() == [
        (3, "publish"), (11, "lookup"), (13, "overwrite"), (14, "stale_hit")]
    everywhere = read.stale_hash_chain(*scenario_db_once, "h2")
    assert everywhere["role"].to_list() == ["publish", "publish", "evict", "cow", "lookup", "overwrite", "stale_hit"]


def test_requests_and_latency(scenario_db_once):
    req = read.requests(*scenario_db_once)
    assert req["request_id"].to_list() == ["A", "B"]
    assert req["ttft_ns"].to_list() == [900, 1000]
    assert req["e2el_ns"].to_list() == [5000, 2500]
    assert req["queue_ns"].to_list() == [100, 500]
    hits = read.per_request_hits(*scenario_db_once)
    assert hits.filter(pl.col("request_id") == "B").row(0, named=True)["num_cached_tokens"] == 40
    # samples as vllm bench serve defines them; TPOT = (E2EL - TTFT) / (outputs - 1)
    assert read.latency_samples(*scenario_db_once, "itl").tolist() == [1000, 1100, 1500, 2000]
    assert read.latency_samples(*scenario_db_once, "tpot").tolist() == [pytest.approx(4100 / 3), 1500]
    assert read.latency_percentiles(*scenario_db_once, "itl", (50,)) == {50: 1300.0}  # numpy's linear
    stats = read.latency_stats(*scenario_db_once, "ttft", (90,))
    assert stats == {"mean_ttft_ms": 950 / 1e6, "median_ttft_ms": 950 / 1e6, "std_ttft_ms": 50 / 1e6,
                     "p90_ttft_ms": pytest.approx(990 / 1e6)}
    assert read.latency_summary(*scenario_db_once)["p99_e2el_ms"] == pytest.approx(
        np.percentile([5000, 2500], 99) / 1e6)
    cdf = read.latency_cdf(*scenario_db_once, "ttft")
    assert cdf.height == len(derived.CDF_PERCENTILES)
    assert (cdf["value_ns"][0], cdf["value_ns"][-1], cdf["n"][0]) == (900.0, 1000.0, 2)
    assert cdf.filter(pl.col("q") == 25.0)["value_ns"].item() == 925.0
    hist = read.latency_histogram(*scenario_db_once, "itl", bins=4)
    assert hist["count"].to_list() == [2, 0, 1, 1] and hist["bin_lo"][0] == 1000.0  # exact counts
    gaps = read.itl_gaps(*scenario_db_once, "A")
    assert gaps.select("index", "token_ns", "gap_ns").rows() == [(1, 1900, 1000), (2, 3900, 2000), (3, 5000, 1100)]
    assert read.itl_gaps(*scenario_db_once).height == 4
    over = read.itl_over_time(*scenario_db_once, window_ns=1000)  # by the time each token came out
    assert over.select("window_start_ns", "gaps", "p50_itl_ns", "max_itl_ns").rows() == [
        (1000, 1, 1000.0, 1000.0), (3000, 2, 1750.0, 2000.0), (5000, 1, 1100.0, 1100.0)]
    with pytest.raises(ValueError):
        read.latency_cdf(*scenario_db_once, "ttlt")


def test_request_waterfall(scenario_db_once):
    wf = read.request_waterfall(*scenario_db_once, "A")
    # A's one lookup (at 0) came before its first schedule (100): it did not admit A, so no mark
    assert wf.select("segment", "start_ns", "end_ns").rows() == [
        ("queue", 0, 100), ("prefill", 100, 500), ("prefill", 500, 900), ("decode", 900, 5000)]
    marks = read.request_waterfall(*scenario_db_once, "B").filter(pl.col("segment") == "cache_hit")
    assert marks.select("start_ns", "num_tokens").rows() == [(1000, 32)]
    assert marks["detail"][0] == "32/64 tokens hit at admission, 8 external"
    assert read.request_waterfall(*scenario_db_once, "no-such-request").height == 0


@pytest.mark.parametrize("call, needle", [
    (lambda db, run: read.hit_counters(db, 0), "hit_counters: run_id: expected str, got 0"),  # (DuckDB's INT32 error)
    (lambda db, run: read.evictions_over_time(db, run, window_ns="1000"),
     "window_ns: expected int or None, got '1000'"),
    (lambda db, run: read.block_histograms(db, run, bins=None), "block_histograms: bins: expected int, got None"),
    (lambda db, run: read.eviction_attribution(db, run, limit=float("nan")), "limit: expected int or None, got nan"),
    (lambda db, run: read.per_prefix_reuse(db, run, top=True), "per_prefix_reuse: top: expected int, got True"),
    (lambda db, run: read.latency_cdf(db, run, metric=[1]), "latency_cdf: metric: expected str, got [1]"),
    (lambda db, run: read.prefix_families(db, run, ["a", 1]), "root_hashes: expected a list of str"),
    (lambda db, run: read.runs(None), "runs: db: expected str or Path, got None"),
    (lambda db, run: read.run(db), "run: arguments: missing a required argument: 'run_id'"),
    (lambda db, run: read.hit_counters_over_time(db, run, window_ns=0),
     "hit_counters_over_time: window_ns: expected 1 to"),
    # counts and percentiles out of range: DuckDB's LIMIT error blamed on the store, an
    # IndexError, a MemoryError, numpy's and polars' errors
    (lambda db, run: read.per_prefix_reuse(db, run, top=-1), "per_prefix_reuse: top: expected 0 to 1,000,000, got -1"),
    (lambda db, run: read.eviction_attribution(db, run, limit=-1), "limit: expected 0 to 100,000,000, got -1"),
    (lambda db, run: read.eviction_attribution_flows(db, run, top_prefixes=-1), "top_prefixes: expected 0 to"),
    (lambda db, run: read.latency_histogram(db, run, bins=2**63), "bins: expected 1 to 100,000, got 9223372036"),
    (lambda db, run: read.latency_histogram(db, run, bins=10**9), "bins: expected 1 to 100,000"),
    (lambda db, run: read.latency_percentiles(db, run, qs=[101]), "qs: expected percentiles from 0 to 100, got 101"),
    (lambda db, run: read.latency_stats(db, run, percentiles=[-1]), "percentiles: expected percentiles from 0"),
    (lambda db, run: read.latency_stats(db, run, percentiles=None), "expected a list of percentiles, got None"),
    (lambda db, run: read.itl_over_time(db, run, qs=[50] * 10_000), "qs: expected 1 to 1,001 percentiles"),
    (lambda db, run: read.itl_over_time(db, run, qs=[50, 50]), "qs: expected distinct percentiles"),
])
def test_the_read_api_names_an_argument_it_cannot_take(scenario_db_once, call, needle):
    """A notebook's wrong type got DuckDB's, polars' or Python's error from deep inside."""
    with pytest.raises(KVTraceError, match=re.escape(needle)) as err:
        call(*scenario_db_once)
    assert isinstance(err.value, ValueError)


def test_a_request_span_without_times_has_no_segments_to_draw(tmp_path):
    """A collected request span may carry only its id and token counts: no queue or decode
    segment without both ends, and the dashboard's waterfall draws nothing (a TypeError on
    None - int before)."""
    import pyarrow as pa

    from kvtrace.dashboard import charts

    path = tmp_path / "bare.duckdb"
    with Store.open(path) as store:
        run_id = store.create_run("bare", run_id="b")
        store.append_spans(pa.table({"name": ["kvtrace.request"], "request_id": ["q"], "start_ns": [10],
                                     "end_ns": [20], "num_prompt_tokens": [64]}), run_id=run_id)
        store.finish_run(run_id)
    wf = read.request_waterfall(path, "b", "q")
    assert wf.height == 0
    assert charts.waterfall(wf, "q") is None
    mixed = pl.DataFrame({"segment": ["queue", "decode", "evict"], "start_ns": [5, None, 7],
                          "end_ns": [9, 30, None], "num_tokens": [None, 3, 1], "detail": [None, None, "x"]})
    fig = charts.waterfall(mixed, "q")
    assert fig is not None and [t.name for t in fig.data] == ["queue", "evict"]


@pytest.mark.parametrize("backend", ["duckdb", "chdb"])
def test_a_miss_on_a_hash_one_span_evicted_twice_is_attributed_to_the_lower_block(tmp_path, backend):
    """vLLM keeps duplicate blocks of one hash; one eviction span can free both. The ASOF
    match picked either row, and DuckDB and ClickHouse picked differently (block id, age)."""
    from tests.store.scenario import EVICT, PUB, STEP, _with_ids, at, lookup, scenario_table

    rows = _with_ids([
        at(0, name=STEP, usage=[0.1], num_running=1, num_waiting=0),
        at(0, name=EVICT, group_id=0, evict_reason="lru", block_ids=[5, 3, 7, 7],
           block_hashes=["hx", "hx", "hy", "hz"], ages=[7, 2, 1, 1], idle=[1, 1, 1, 1], request_id="A"),
        at(1, name=STEP, usage=[0.1], num_running=1, num_waiting=0),
        lookup(1, "B", 32, 0, [0], "hx", "hx", 0),
        at(1, name=PUB, request_id="B", group_id=0, publish_kind="full", block_ids=[7], block_hashes=["hw"],
           num_tokens=16),
    ])
    db = str(tmp_path / "s.duckdb") if backend == "duckdb" else f"chdb:{tmp_path / 'ch'}"
    with Store.open(db) as store:
        run_id = store.create_run("dup", mode="engine")
        store.append_spans(scenario_table(rows), run_id=run_id)
        store.finish_run(run_id)
    (row,) = read.eviction_attribution(db, run_id).rows(named=True)
    assert (row["missed_hash"], row["block_id"], row["age"]) == ("hx", 3, 2)
    # and an export lists that span's blocks in one order on every backend (its block ids')
    import pyarrow.parquet as pq

    from kvtrace.store import export_parquet

    out = export_parquet(db, run_id, tmp_path / "export")
    evicted = pq.read_table(out["evicted_blocks"]).to_pylist()
    assert [(r["block_id"], r["block_hash"]) for r in evicted] == [(3, "hx"), (5, "hx"), (7, "hy"), (7, "hz")]
    # one span evicting one block's two keys: both rows name the publish that follows (lead()
    # gave one of them its own span, so which row lost it depended on the backend's sort)
    assert [r["next_publish_seq"] for r in evicted if r["block_id"] == 7] == [4, 4]
