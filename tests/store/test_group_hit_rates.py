"""Per-group hit rates and a summary read from spans, each as its one definition says: a group
hit rate is what one KV group alone found (kvtrace.metrics.GROUP_HIT_RATE_DOC),
never the request hit rate under another label."""

from __future__ import annotations

import json

import pytest

from kvtrace.replay.run import RunSpec, run_replay
from kvtrace.store import read


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same hybrid workload through kvtrace's manager and vLLM's, in a pool small
    enough that the groups' own hits part from the request's."""
    db = str(tmp_path_factory.mktemp("groups") / "g.duckdb")
    spec = dict(capacity_blocks=60, content=False)
    own = run_replay(RunSpec("gen:mixed", name="kvtrace", **spec), db=db)
    theirs = run_replay(RunSpec("gen:mixed", name="vllm", backend="vllm", **spec), db=db)
    return db, own, theirs


def test_kvtrace_backend_reports_each_groups_own_hits(runs):
    db, own, _ = runs
    rates = read.group_hit_rates(db, own.run_id)
    assert len(rates) == 2
    assert rates[0] > own.summary["prefix_cache_hit_rate"]  # the attention group alone hits more


def test_vllm_backend_has_the_kvtrace_backends_group_hit_rates(runs):
    """The vllm backend asks vLLM's coordinator for each group's own hit: its group hit rates are
    kvtrace's on the same requests (they were left out, vLLM's common hit marked inferred)."""
    db, own, theirs = runs
    assert theirs.summary["prefix_cache_hits"] == own.summary["prefix_cache_hits"]  # the same run otherwise
    assert read.group_hit_rates(db, theirs.run_id) == read.group_hit_rates(db, own.run_id) != {}
    assert read.group_hit_rate_over_time(db, theirs.run_id).equals(read.group_hit_rate_over_time(db, own.run_id))


def test_per_group_hits_marked_inferred_are_left_out_of_the_group_hit_rates(runs, tmp_path):
    """A vllm-backend run recorded by an older kvtrace wrote vLLM's common hit into every group,
    marked inferred: it read as the request hit rate labelled "attention group hit rate" (16.3%
    where kvtrace's backend said 46.4%). Such lookups stay out of every per-group figure."""
    import shutil

    import duckdb

    db, own, theirs = runs
    old = str(tmp_path / "old.duckdb")
    shutil.copy(db, old)
    con = duckdb.connect(old)
    con.execute("""UPDATE spans_lookup SET extra_attributes = map_concat(extra_attributes,
                   MAP {'kvtrace.inferred': '["kvtrace.lookup.hit_tokens_per_group"]'})
                   WHERE run_id = ? AND len(hit_tokens_per_group) > 1""", [theirs.run_id])
    con.close()
    assert read.group_hit_rates(old, theirs.run_id) == {}
    assert read.group_hit_rate_over_time(old, theirs.run_id).height == 0
    assert read.hit_counters(old, theirs.run_id)["prefix_cache_hits"] == theirs.summary["prefix_cache_hits"]
    assert read.group_hit_rates(old, own.run_id) == read.group_hit_rates(db, own.run_id)


def test_a_run_without_a_summary_reads_its_request_totals_from_its_spans(runs):
    """What ``runs``, ``diff`` and the dashboard read for a killed run (summary_from_spans)
    holds the request spans' prompt tokens, output tokens and preemptions, as a finished
    run's summary defines them: a SIGTERM'd run showed its requests and hit rate, and "–"
    for these."""
    db, own, theirs = runs
    for res in (own, theirs):
        spans = read.summary_from_spans(db, res.run_id)
        assert res.summary["preemptions"] > 0
        for key in ("prompt_tokens", "output_tokens", "preemptions", "requests", "prefix_cache_queries"):
            assert spans[key] == res.summary[key], key


def test_a_cache_only_run_summed_from_its_spans_counts_no_copies(tmp_path):
    """Cache-only replay makes no copies: its summary says cow_copies null (not measured),
    and the summary from its spans said 0, so a killed run read otherwise than a finished one."""
    db = str(tmp_path / "c.duckdb")
    res = run_replay(RunSpec("gen:chat", mode="cache-only", capacity_blocks=50, limit=20), db=db)
    spans = read.summary_from_spans(db, res.run_id)
    assert res.summary["cow_copies"] is None and spans["cow_copies"] is None
    for key in ("requests", "prefix_cache_queries", "prefix_cache_hits", "evictions", "publishes"):
        assert spans[key] == res.summary[key], key


@pytest.mark.parametrize("mode", ["engine", "otlp"])
def test_an_engine_run_killed_before_any_request_finished_counts_no_lookup_as_a_request(runs, tmp_path, mode):
    """An engine run's lookups include the retries of requests waiting for blocks: with no
    request span (killed before any request finished) the counters read every lookup as a
    request, as cache-only's one lookup per request is (7 requests and 60.7% from 4). A
    collected run's record names no engine mode (``otlp``): its step spans say it is one (306
    requests and 944,972 queries of a 60-request trace were read from its retries)."""
    import shutil

    import duckdb

    db, own, _ = runs
    copy = str(tmp_path / "killed.duckdb")
    shutil.copy(db, copy)
    with duckdb.connect(copy) as con:
        lookups = con.execute("SELECT count(*) FROM spans_lookup WHERE run_id = ?", [own.run_id]).fetchone()[0]
        con.execute("DELETE FROM spans_request WHERE run_id = ?", [own.run_id])
        con.execute("UPDATE runs SET mode = ? WHERE run_id = ?", [mode, own.run_id])
    assert lookups > own.summary["requests"]  # (retries: the pool is tight)
    counters = read.hit_counters(copy, own.run_id)
    assert counters["requests"] == 0 and counters["prefix_cache_queries"] == 0
    assert read.group_hit_rates(copy, own.run_id) == {}


def test_a_run_without_a_summary_summarises_its_latencies_at_its_own_percentiles(tmp_path):
    """A killed run keeps no summary; its summary from spans gave p50/p90/p99 whatever the
    run's --percentiles were (`runs` and the dashboard showed no p25/p75 of a run replayed at
    25,75). The percentiles are no setting of the replay: a pair differing in them alone is
    no pair differing in anything."""
    from kvtrace.compare import pairing

    db = str(tmp_path / "p.duckdb")
    custom = run_replay(RunSpec("gen:chat", limit=12, content=False, percentiles=(25.0, 75.0)), db=db)
    default = run_replay(RunSpec("gen:chat", limit=12, content=False), db=db)
    spans = read.summary_from_spans(db, custom.run_id)
    assert spans["p25_ttft_ms"] == custom.summary["p25_ttft_ms"] is not None
    assert spans["p75_itl_ms"] == custom.summary["p75_itl_ms"]
    assert "p99_ttft_ms" not in spans
    assert "p99_ttft_ms" in read.summary_from_spans(db, default.run_id)
    assert pairing.differences(read.run(db, custom.run_id), read.run(db, default.run_id)) == []
    import duckdb  # a damaged record (a bool, which float() took as p1): the default percentiles

    with duckdb.connect(db) as con:
        con.execute("UPDATE runs SET config = '{\"percentiles\": [true]}' WHERE run_id = ?", [custom.run_id])
    spans = read.summary_from_spans(db, custom.run_id)
    assert "p99_ttft_ms" in spans and "p1_ttft_ms" not in spans
    # more percentiles than the read API takes (recorded before the CLI bounded them, or
    # damaged): the defaults, not "latency_summary: percentiles: expected 1 to 1,001" from
    # every runs and diff of the store
    many = json.dumps({"percentiles": [i / 20 for i in range(2001)]})
    with duckdb.connect(db) as con:
        con.execute("UPDATE runs SET config = ? WHERE run_id = ?", [many, custom.run_id])
    spans = read.summary_from_spans(db, custom.run_id)
    assert "p99_ttft_ms" in spans and "p0.05_ttft_ms" not in spans
