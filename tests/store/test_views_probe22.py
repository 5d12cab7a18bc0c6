"""Views of one metric probed by hand (session 22): a run's figures in the read API, `kvtrace
runs`, `kvtrace diff` and the dashboard's queries, on runs a user stops or a store a user edits."""

from __future__ import annotations

import json
import re

import duckdb
import pytest

from kvtrace.store import StoreError, read
from tests.cli.support import assert_one_line
from tests.cli.support import run as kvtrace

# engine mode with an external tier and the CoW fix off: divergent outputs and stale entries left
DIVERGING = dict(limit=35, capacity_blocks=40, external_capacity_blocks=4096, without=("external-hit-running-cow",))


@pytest.fixture(scope="module")
def diverging_store(tmp_path_factory):
    """A store of two engine runs of one trace: r1 checks content (and diverges), r2 does not.
    Returns (bytes of the store, r1's summary, r2's summary)."""
    from kvtrace.replay.run import RunSpec, run_replay

    db = tmp_path_factory.mktemp("diverging") / "d.duckdb"
    checked = run_replay(RunSpec("gen:mixed", **DIVERGING), db=db).summary  # type: ignore[arg-type]
    unchecked = run_replay(RunSpec("gen:mixed", content=False, **DIVERGING), db=db).summary  # type: ignore[arg-type]
    assert checked["divergent_outputs"] > 0 and checked["stale_hashes_left"] > 0  # what the test is about
    return db.read_bytes(), checked, unchecked


def _stopped(tmp_path, data: bytes, *run_ids: str):
    """The store with ``run_ids`` as SIGTERM leaves a run: failed, its summary the error alone."""
    db = tmp_path / "d.duckdb"
    db.write_bytes(data)
    with duckdb.connect(str(db)) as con:
        for run_id in run_ids:
            con.execute("UPDATE runs SET status = 'failed', summary = ? WHERE run_id = ?",
                        [json.dumps({"error": "Terminated: SIGTERM"}), run_id])
    return str(db)


def test_a_stopped_runs_divergent_outputs_are_its_spans_in_every_view(tmp_path, diverging_store, capsys):
    """Divergent outputs are counted as tokens are sampled: a stopped run's spans hold every
    one so far. Its summary from spans said null (not measured), so `diff` said null beside
    the divergent requests it listed, and the dashboard's Overview a dash beside its table of
    them. Stale entries left likewise (a cache event, as CoW copies are); stale hashes stay
    null (the audit of every key at a run's end never ran); a run without content checks
    measures no divergence: null."""
    data, checked, unchecked = diverging_store
    db = _stopped(tmp_path, data, "r1", "r2")
    summary = read.run_summary(db, "r1")
    assert summary["error"] == "Terminated: SIGTERM"
    assert summary["divergent_outputs"] == checked["divergent_outputs"] == read.divergent_outputs(db, "r1").height
    assert summary["stale_hashes_left"] == checked["stale_hashes_left"]
    assert summary.get("stale_hashes") is None
    assert read.run_summary(db, "r2")["divergent_outputs"] is None
    assert read.run_summary(db, "r2")["stale_hashes_left"] == unchecked["stale_hashes_left"]

    code, out, err = kvtrace(["diff", "r1", "r2", "--db", db, "--json"], capsys)
    assert code == 0, err
    diffed = json.loads(out)
    assert diffed["correctness"]["divergent_outputs"] == {"a": checked["divergent_outputs"], "b": None}
    listed = sum(r["divergent_tokens"] for r in diffed["correctness"]["divergent_requests"]["a"])
    assert listed == checked["divergent_outputs"]
    assert diffed["metrics"]["stale_hashes_left"]["a"] == checked["stale_hashes_left"]


def _edited(tmp_path, data: bytes, *sql: str) -> str:
    db = tmp_path / "d.duckdb"
    db.write_bytes(data)
    with duckdb.connect(str(db)) as con:
        for stmt in sql:
            con.execute(stmt)
    return str(db)


# (edit of a finished run's derived rows, the table the error names): each made a view give
# a wrong number (runs: 0 spans beside diff's 1,593; a stopped run's publishes and evictions 0
# beside thousands of evicted blocks by reason; an empty CDF beside the summary's latencies;
# no eviction by publish kind beside diff's evictions) or a TypeError
DERIVED_DAMAGE = {
    "span-stats-deleted": ("DELETE FROM span_stats WHERE run_id = 'r1'", "span_stats holds none of its rows"),
    "span-stats-null": ("UPDATE span_stats SET blocks = NULL WHERE run_id = 'r1'", "span_stats holds NULL"),
    "span-stats-negative": ("UPDATE span_stats SET spans = -3 WHERE run_id = 'r1'", "span_stats holds NULL or neg"),
    "latency-cdf-deleted": ("DELETE FROM latency_cdf WHERE run_id = 'r1'", "latency_cdf holds none of its rows"),
    "evict-counts-deleted": ("DELETE FROM evict_counts WHERE run_id = 'r1'", "evict_counts holds none of its rows"),
    "evicted-blocks-deleted": ("DELETE FROM evicted_blocks WHERE run_id = 'r1'", "evicted_blocks holds none"),
    "latency-cdf-null": ("UPDATE latency_cdf SET value_ns = NULL WHERE run_id = 'r1' AND q = 50",
                         "latency_cdf holds a NULL"),
    "evict-counts-null": ("UPDATE evict_counts SET blocks = NULL WHERE run_id = 'r1' AND reason = 'lru'",
                          "evict_counts holds a NULL"),
    "block-values-zero": ("UPDATE block_values SET n = 0 WHERE run_id = 'r1'", "block_values holds a NULL or a count"),
}


@pytest.mark.parametrize("stopped", [False, True], ids=["complete", "stopped"])
@pytest.mark.parametrize("damage", list(DERIVED_DAMAGE))
def test_a_finished_runs_derived_rows_edited_by_hand_are_one_line_never_a_number(tmp_path, diverging_store,
                                                                                 capsys, damage, stopped):
    """A finished run's derived rows are written with its status, in one transaction: a
    store where they are missing beside its spans, or hold NULL or negative counts, is
    damaged. Every read of them says so in one line naming the store, the run and the table
    (`diff`, the read API the dashboard calls); `runs` lists the run damaged where its span
    count is wrong, and the store's other run stays readable."""
    data, checked, _ = diverging_store
    edit, needle = DERIVED_DAMAGE[damage]
    db = _edited(tmp_path, data, edit)
    if stopped:  # (a stopped run's numbers come from its spans and derived rows)
        with duckdb.connect(db) as con:
            con.execute("UPDATE runs SET status = 'failed', summary = '{\"error\": \"Terminated: SIGTERM\"}' "
                        "WHERE run_id = 'r1'")
    code, _, err = kvtrace(["diff", "r1", "r2", "--db", db, "--json"], capsys)
    assert_one_line(code, err, db, "damaged kvtrace store", "run r1", needle)
    for name, args in (("span_counts", ()), ("latency_cdf", ("ttft",)), ("evictions_by_publish_kind", ()),
                       ("evictions_over_time", ()), ("block_histograms", ())):
        with pytest.raises(StoreError, match=re.escape(needle)):
            getattr(read, name)(db, "r1", *args)
    code, out, err = kvtrace(["runs", "--db", db, "--json"], capsys)
    assert code == 0, err
    listed = {r["run_id"]: r for r in json.loads(out)["runs"]}
    assert listed["r2"]["status"] == "complete" and listed["r2"]["damage"] is None
    if damage.startswith("span-stats") and (not stopped or damage != "span-stats-deleted"):
        assert listed["r1"]["status"] == "damaged" and needle in listed["r1"]["damage"]
    assert read.span_counts(db, "r2").height > 0


def test_a_finished_run_without_spans_has_no_derived_rows_to_miss(tmp_path):
    """A run that failed before recording any span has no derived rows, and is no damage."""
    from kvtrace.store import Store

    db = tmp_path / "e.duckdb"
    store = Store.open(db)
    run_id = store.create_run("empty", mode="engine")
    store.finish_run(run_id, status="failed", summary={"error": "ValueError: before any span"})
    store.close()
    assert read.span_counts(db, run_id).height == 0
    assert read.run_summary(db, run_id) == {"error": "ValueError: before any span"}
    assert read.runs(db)["status"].to_list() == ["failed"]


@pytest.mark.parametrize("values, q", [
    ([5493, 35768945296019518], 50), ([5278807835, 973191530868154311], 0.1),
    ([904, 895613192, 6803880664762, 989433863949655272], 90), ([2**62 + 1, 2**62 + 3], 99),
])
def test_one_percentile_of_gaps_past_2_to_the_53_is_numpys_to_the_last_digit(values, q):
    """A request span's ITL percentiles (``numeric.sorted_percentile``, through the span
    builder's columns) and the store's latency percentiles (numpy) are one definition: ints
    past 2^53 were subtracted exactly before numpy's float64 conversion, another last digit."""
    import numpy as np

    from kvtrace.instrument.arrow_columns import Ragged
    from kvtrace.numeric import percentile, sorted_percentile

    want = float(np.percentile(np.asarray(values, dtype=np.float64), q))
    assert sorted_percentile(sorted(values), q) == percentile(values, q) == want
    assert Ragged([tuple(values), ()]).percentiles(q).to_pylist() == [want, None]


@pytest.mark.parametrize("spans", ["'\"many\"'", "-5", "1e300"])
def test_a_summary_span_count_kvtrace_never_writes_is_a_damaged_record(tmp_path, diverging_store, capsys, spans):
    """A summary's ``spans`` is a count like its others (``metrics.SUMMARY_COUNTS``): diff
    showed -5 (and a dash for "many") beside the spans `runs` counted in the store; now the
    record is damaged in both, one line naming the key."""
    data, _, _ = diverging_store
    db = _edited(tmp_path, data, f"UPDATE runs SET summary = json_merge_patch(summary, json_object('spans', {spans})) "
                                 "WHERE run_id = 'r1'")
    code, _, err = kvtrace(["diff", "r1", "r2", "--db", db], capsys)
    assert_one_line(code, err, db, "damaged kvtrace store", "run r1's summary: spans: expected a count")
    code, out, err = kvtrace(["runs", "--db", db, "--json"], capsys)
    assert code == 0, err
    listed = {r["run_id"]: r for r in json.loads(out)["runs"]}
    assert listed["r1"]["status"] == "damaged" and "spans: expected a count" in listed["r1"]["damage"]
    assert listed["r2"]["status"] == "complete"


def test_a_stopped_belady_runs_publishes_and_evictions_are_unknown_not_zero(tmp_path, capsys):
    """A Belady bound records its lookups only (it has no cache manager): its finished summary
    counts publishes and evictions no span holds, and a stopped one's summary from spans said
    0 for them (7,069 evictions in the finished run). Now null, as not recorded; its hit
    counters are still its lookups'."""
    from kvtrace.replay.run import RunSpec, run_replay
    from tests.conftest import MOONCAKE

    db = tmp_path / "b.duckdb"
    done = run_replay(RunSpec(str(MOONCAKE), mode="cache-only", policy="belady", capacity_blocks=100, limit=60),
                      db=db).summary
    assert done["evictions"] > 0 and done["publishes"] > 0  # what the test is about
    data = db.read_bytes()
    (tmp_path / "s").mkdir()
    stopped = _stopped(tmp_path / "s", data, "r1")
    summary = read.run_summary(stopped, "r1")
    assert summary["evictions"] is None and summary["publishes"] is None
    assert "evictions_by_reason" not in summary
    assert summary["prefix_cache_hits"] == done["prefix_cache_hits"] and summary["requests"] == done["requests"]
    code, out, err = kvtrace(["runs", "--db", stopped, "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["runs"][0]["requests"] == done["requests"]


def test_a_stopped_runs_spans_that_end_before_they_arrive_are_a_damaged_record(tmp_path, diverging_store, capsys):
    """A stopped run's summary comes from its spans: a request span that ends before its
    arrival (an edit by hand; a collector refuses it) gave a negative median E2EL in `runs`
    and `diff`. Its summary from spans gets the check a stored one does: one line naming the
    run and the key; `runs` lists it damaged and the other run as it was."""
    data, _, _ = diverging_store
    db = _stopped(tmp_path, data, "r1")
    with duckdb.connect(db) as con:
        con.execute("UPDATE spans_request SET end_ns = 0 WHERE run_id = 'r1'")
    code, _, err = kvtrace(["diff", "r1", "r2", "--db", db], capsys)
    assert_one_line(code, err, db, "damaged kvtrace store", "run r1's spans hold values", "_ms: expected a time")
    code, out, err = kvtrace(["runs", "--db", db, "--json"], capsys)
    assert code == 0, err
    listed = {r["run_id"]: r for r in json.loads(out)["runs"]}
    assert listed["r1"]["status"] == "damaged" and "expected a time in ms" in listed["r1"]["damage"]
    assert listed["r1"]["median_ttft_ms"] is None
    assert listed["r2"]["status"] == "complete" and listed["r2"]["median_ttft_ms"] > 0


def test_a_collected_runs_derived_rows_may_lag_its_late_spans_but_hold_no_null(tmp_path, diverging_store):
    """A collector stores spans that come after a run's record a moment before it rebuilds
    the run's derived rows: a collected run (mode otlp) missing them is read as it is, and
    only a NULL count in them is damage."""
    data, _, _ = diverging_store
    db = _edited(tmp_path, data, "UPDATE runs SET mode = 'otlp' WHERE run_id = 'r1'",
                 "DELETE FROM span_stats WHERE run_id = 'r1'", "DELETE FROM latency_cdf WHERE run_id = 'r1'")
    assert read.span_counts(db, "r1").height == 0 and read.latency_cdf(db, "r1").height == 0
    with duckdb.connect(db) as con:
        con.execute("UPDATE evict_counts SET blocks = NULL WHERE run_id = 'r1'")
    with pytest.raises(StoreError, match="evict_counts holds a NULL"):
        read.evictions_over_time(db, "r1")


def test_a_summarys_percentiles_come_in_numeric_order_whatever_its_key_order():
    """A stored summary's keys came back in text order (p0, p100, p99.9) and the docstring
    promised the run's order: now numeric, for every caller."""
    from kvtrace.metrics import DEFAULT_PERCENTILES, summary_percentiles

    stored = {"p0_ttft_ms": 1.0, "p100_ttft_ms": 3.0, "p99.9_ttft_ms": 2.0, "p99.9_itl_ms": 2.0, "pX_ttft_ms": 0}
    assert summary_percentiles(stored) == (0.0, 99.9, 100.0)
    assert summary_percentiles({"requests": 1}) == DEFAULT_PERCENTILES


def test_request_spans_that_give_a_negative_counter_are_a_damaged_store_not_a_number(tmp_path):
    """A request span without num_prompt_tokens (hand-edited, or a sender's) gave queries 0,
    hits 11,840 and local_compute -11,840, shown as a number on the dashboard."""
    import duckdb

    from kvtrace.replay.run import RunSpec, run_replay
    from kvtrace.store import read
    from kvtrace.store.errors import StoreError

    db = tmp_path / "s.duckdb"
    run_replay(RunSpec("gen:chat", limit=20, content=False), db=db)
    whole = read.hit_counters(db, "r1")
    assert whole["prefix_cache_hits"] > 0 and min(v for v in whole.values() if isinstance(v, int)) >= 0
    with duckdb.connect(str(db)) as con:
        con.execute("UPDATE spans_request SET num_prompt_tokens = NULL WHERE run_id = 'r1'")
    with pytest.raises(StoreError, match="damaged kvtrace store: run r1's request spans give "
                                         r"prompt_tokens_by_source\.local_compute -"):
        read.hit_counters(db, "r1")


def test_an_engine_runs_steps_from_spans_are_its_summarys(tmp_path):
    """A stopped engine run's summary said steps null (diff a dash) though its step spans are
    stored, one a step, numbered 0..n-1."""
    from kvtrace.replay.run import RunSpec, run_replay
    from kvtrace.store import read

    db = tmp_path / "s.duckdb"
    result = run_replay(RunSpec("gen:chat", limit=8), db=db)
    assert read.summary_from_spans(db, "r1")["steps"] == result.summary["steps"] > 0
    run_replay(RunSpec("gen:chat", limit=8, mode="cache-only", capacity_blocks=30), db=db)
    assert "steps" not in read.summary_from_spans(db, "r2")  # (cache-only: its summary has none either)
