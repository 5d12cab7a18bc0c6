"""regression_analysis.ipynb on real study runs: its numbers equal diff_runs' and the store's."""

from __future__ import annotations

import re

import pytest

from kvtrace.compare.render import to_json, to_text
from kvtrace.compare.source import diff_runs
from kvtrace.compare.study import SHARED_PREFIX_PINNING, run_study
from kvtrace.store import read


@pytest.fixture(scope="module")
def study_db(tmp_path_factory):
    db = tmp_path_factory.mktemp("nb-study") / "study.duckdb"
    res = run_study(SHARED_PREFIX_PINNING, db=db, seed=0, limit=40)
    return db, res


def test_notebook_on_given_runs_matches_diff_runs(run_notebook, study_db, tmp_path):
    db, res = study_db
    a, b = res.first.run_off, res.first.run_on
    out, nb = run_notebook("regression_analysis", db_path=str(db), run_a=a, run_b=b, seed=5,
                           result_path=str(tmp_path / "result.json"))
    d = diff_runs(db, a, b, seed=5)
    assert (out["run_a"], out["run_b"]) == (a, b)
    assert out["prefix_cache_hit_rate_delta"] == pytest.approx(d.metric("prefix_cache_hit_rate").delta)
    assert out["prefix_cache_hit_rate_delta"] == pytest.approx(
        res.on["prefix_cache_hit_rate"] - res.off["prefix_cache_hit_rate"])
    assert out["prefix_cache_hits_delta"] == d.metric("prefix_cache_hits").delta
    # The same seed gives the same bootstrap intervals in the notebook as `kvtrace diff --json` (null: none).
    for name, s in to_json(d)["latency"].items():
        assert out["latency"][name]["ci"] == [None if v is None else pytest.approx(v) for v in s["ci"]]
    assert (out["requests_gained"], out["requests_lost"]) == (d.requests.gained, d.requests.lost)
    printed = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert d.requests.gained and f"{d.requests.gained} requests gained cached tokens (local + external hits" in printed
    # The per-request table sums to the diff's net change (both read per_request_hits).
    assert out["per_request_delta_sum"] == d.requests.cached_tokens_delta
    # The per-request table leads with the requests that changed most.
    moved = sorted(d.requests.top_gained + d.requests.top_lost, key=lambda c: (-abs(c.delta), c.request_id))
    k = min(3, len(moved))
    assert k and out["per_request_first"][:k] == [c.request_id for c in moved][:k]
    # The cumulative hit rate at the end of the time series is the whole run's: the store's and the summary's.
    assert out["cum_hit_rate_end"]["b"] == pytest.approx(read.hit_counters(db, b)["prefix_cache_hit_rate"])
    assert out["cum_hit_rate_end"]["b"] == pytest.approx(res.on["prefix_cache_hit_rate"])
    # evictions are never called worse (evicting a stale entry is a fix)
    assert "evictions" not in out["worse"] and "evictions" not in out["better"]
    # The verdict is computed: pinning on raises the hit rate, so B is not worse on it.
    assert "prefix_cache_hit_rate" in out["better"] and "prefix_cache_hit_rate" not in out["worse"]
    assert out["verdict"].startswith(out["overall"])
    assert "raises the prefix cache hit rate" in out["verdict"]
    assert (tmp_path / "result.json").exists()
    plots = [o for c in nb.cells for o in c.get("outputs", [])
             if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert len(plots) >= 4  # deltas, hit rate over time, per-request scatter, latency CDFs


def test_notebook_study_mode_runs_its_own_study(run_notebook):
    out, _ = run_notebook("regression_analysis", behaviour=SHARED_PREFIX_PINNING, limit=30, seed=0)
    # Study mode: A = off, B = on, into a temp store the notebook made.
    direct = run_study(SHARED_PREFIX_PINNING, seed=0, limit=30)
    assert out["metrics"]["prefix_cache_hits"]["a"] == direct.off["prefix_cache_hits"]
    assert out["metrics"]["prefix_cache_hits"]["b"] == direct.on["prefix_cache_hits"]
    assert out["same_trace"] is True


@pytest.mark.parametrize("given", [{"run_a": "r1"}, {"run_b": "r2"}, {"run_a": "r1", "run_b": "r2", "no_db": True}])
def test_a_store_without_both_run_ids_is_refused_and_left_alone(run_notebook, study_db, tmp_path, given):
    """With db_path and only run_a, the notebook ran a study INTO the user's store (4 runs
    more, and `kvtrace demo` then refused that store); run ids without a store were ignored."""
    import shutil

    from papermill.exceptions import PapermillExecutionError

    db = tmp_path / "mine.duckdb"
    shutil.copy(study_db[0], db)
    before = db.read_bytes()
    params = {k: v for k, v in given.items() if k != "no_db"}
    if not given.get("no_db"):
        params["db_path"] = str(db)
    with pytest.raises(PapermillExecutionError, match="give a store and both run ids"):
        run_notebook("regression_analysis", **params)
    assert db.read_bytes() == before


@pytest.fixture(scope="module")
def cache_only_db(tmp_path_factory):
    """Two cache-only runs of one trace (bounded LRU, unbounded): no clock, no request spans, no
    content checks."""
    from kvtrace.replay.run import RunSpec, run_replay

    db = tmp_path_factory.mktemp("nb-cache-only") / "co.duckdb"
    for capacity in (64, None):
        run_replay(RunSpec("gen:chat", mode="cache-only", capacity_blocks=capacity, limit=30), db=db)
    return db


def test_two_cache_only_runs_are_compared_and_what_they_lack_is_said(run_notebook, cache_only_db):
    """Its conclusion asked diff.metric('stale_hashes'), which a cache-only run does not have: the
    notebook ended in UnknownMetric (so did a killed run against a SIGTERM'd one)."""
    out, nb = run_notebook("regression_analysis", db_path=str(cache_only_db), run_a="r1", run_b="r2")
    d = diff_runs(cache_only_db, "r1", "r2")
    assert not d.latency and "stale_hashes" not in {m.name for m in d.metrics}  # (what the notebook met)
    assert out["metrics"] == {m.name: {"a": m.a, "b": m.b, "delta": m.delta} for m in d.metrics}
    assert out["prefix_cache_hit_rate_b"] == read.hit_counters(cache_only_db, "r2")["prefix_cache_hit_rate"]
    assert out["prefix_cache_hit_rate_delta"] > 0  # the unbounded cache hits more
    assert "prefix_cache_hit_rate" in out["better"] and out["overall"] == "B is better than A"
    printed = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "no latency percentiles to compare" in printed
    assert "no per-request comparison" in printed and "0 unchanged" not in printed
    assert "Times: none (no clock" in printed  # the words `kvtrace diff` prints
    # (it went on "latency percentiles: modelled times": times neither run has, given a kind)
    assert "modelled" not in printed and "latency percentiles:" not in printed


def test_runs_without_a_hit_rate_are_said_to_have_none(run_notebook, tmp_path):
    """A live capture that received nothing has a summary without a hit rate: the conclusion
    ended in UnknownMetric for 'prefix_cache_hit_rate'."""
    from kvtrace.store import Store

    db = tmp_path / "live.duckdb"
    with Store.open(db) as s:
        for _ in range(2):  # (the summary a capture that received nothing keeps)
            s.finish_run(s.create_run("vllm tcp://127.0.0.1:5557", mode="live"), summary={"requests": 0, "events": 0})
    out, nb = run_notebook("regression_analysis", db_path=str(db), run_a="r1", run_b="r2")
    assert out["prefix_cache_hit_rate_a"] is None and out["prefix_cache_hit_rate_delta"] is None
    assert out["metrics"]["requests"] == {"a": 0, "b": 0, "delta": 0}
    assert "The prefix cache hit rate is not in both runs (A none, B none)" in out["verdict"]


def test_a_numeric_run_id_from_papermill_is_read_as_the_text_it_was(run_notebook, cache_only_db):
    """`papermill -p run_a 12345` passes an int: the notebook ended in polars' TypeError."""
    from papermill.exceptions import PapermillExecutionError

    with pytest.raises(PapermillExecutionError, match=re.escape("no run with id '12345'")):
        run_notebook("regression_analysis", db_path=str(cache_only_db), run_a=12345, run_b="r1")


def test_a_result_path_that_is_the_store_is_refused_and_the_store_kept(run_notebook, cache_only_db, tmp_path):
    """result_path was opened with open(..., 'w'): naming the store there replaced it with JSON."""
    import shutil

    from papermill.exceptions import PapermillExecutionError

    db = tmp_path / "mine.duckdb"
    shutil.copy(cache_only_db, db)
    before = db.read_bytes()
    with pytest.raises(PapermillExecutionError, match=re.escape(f"KVTraceError: {db}: is also {db}")):
        run_notebook("regression_analysis", db_path=str(db), run_a="r1", run_b="r2", result_path=str(db))
    assert db.read_bytes() == before


def test_force_that_is_not_a_bool_is_refused(run_notebook, cache_only_db):
    """`papermill -p force no` passes the text 'no', which is true: runs of different traces were compared."""
    from papermill.exceptions import PapermillExecutionError

    said = "KVTraceError: force: expected True or False, got 'no'"
    with pytest.raises(PapermillExecutionError, match=re.escape(said)):
        run_notebook("regression_analysis", db_path=str(cache_only_db), run_a="r1", run_b="r2", force="no")


def test_collected_replays_times_are_called_what_diff_calls_them(run_notebook, tmp_path):
    """The notebook called a collected run's latencies 'modelled' where `kvtrace diff` said
    they were the sender's own. A collected kvtrace replay now keeps its record's config, and
    both say its times were modelled by the cost model that made them."""
    from kvtrace.instrument.otlp.collector import OTLPCollector
    from kvtrace.replay.run import RunSpec, run_replay

    db = tmp_path / "collected.duckdb"
    collector = OTLPCollector(db, port=0, grpc_port=None).start()
    try:
        sent = [run_replay(RunSpec("gen:chat", limit=3), otlp_endpoint=collector.url).otlp_run_id for _ in range(2)]
    finally:
        collector.stop()
    out, nb = run_notebook("regression_analysis", db_path=str(db), run_a=sent[0], run_b=sent[1])
    printed = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    said = to_text(diff_runs(str(db), sent[0], sent[1]), width=200)
    times = next(line for line in said.splitlines() if line.startswith("Times: "))
    assert times.startswith("Times: modelled by cost model") and times in printed
    assert "as received" not in printed and "recorded times" not in printed


def test_study_mode_reads_a_trace_at_its_trace_block_size(run_notebook, tmp_path):
    """`kvtrace study --trace T --trace-block-size 64` studies a Mooncake trace of 64-token ids;
    the notebook had no such parameter, and refused the trace (512 tokens an id)."""
    from kvtrace.compare.study import study_base
    from kvtrace.replay.run import RunSpec

    path = tmp_path / "mooncake64.jsonl"
    rows = [(0, 300, [1, 2, 3, 4, 5]), (5, 320, [1, 2, 3, 4, 6]), (9, 200, [1, 2, 3, 7])]
    path.write_text("".join(f'{{"timestamp": {t}, "input_length": {n}, "output_length": 2, "hash_ids": {ids}}}\n'
                            for t, n, ids in rows))
    out, _ = run_notebook("regression_analysis", behaviour=SHARED_PREFIX_PINNING, trace=str(path), trace_block_size=64)
    base = study_base(SHARED_PREFIX_PINNING, RunSpec(trace=str(path), trace_block_size=64))
    direct = run_study(SHARED_PREFIX_PINNING, trace=str(path), base=base)
    assert out["metrics"]["prompt_tokens"]["a"] == direct.off["prompt_tokens"] == 820
    off, on = direct.off["prefix_cache_hits"], direct.on["prefix_cache_hits"]
    assert out["metrics"]["prefix_cache_hits"] == {"a": off, "b": on, "delta": on - off}


@pytest.mark.parametrize(("given", "said"), [
    ({"seed": "x"}, "seed: expected an int from 0 to 18,446,744,073,709,551,615, got 'x'"),
    ({"limit": 0}, "limit: expected an int from 1 to 18,446,744,073,709,551,615, got 0"),
    ({"trace_block_size": 0}, "trace_block_size: expected an int from 1 to 18,446,744,073,709,551,615, got 0"),
    # a study of a generated workload, which has no block size to give (it named --trace-block-size)
    ({"trace_block_size": 64}, "trace_block_size: 64: the study's workload is generated"),
    # a store's runs with study settings beside them (ignored unsaid)
    ({"db_path": "x.duckdb", "run_a": "r1", "run_b": "r2", "limit": 5}, "limit: study settings, for a study "
                                                                         "without db_path"),
])
def test_a_count_it_cannot_use_is_one_error_naming_the_parameter(run_notebook, given, said):
    """The study and the diff named their own flags ("--seed: x", "--limit: 0"), which a notebook has none of."""
    from papermill.exceptions import PapermillExecutionError

    with pytest.raises(PapermillExecutionError, match=re.escape(f"KVTraceError: {said}")):
        run_notebook("regression_analysis", **given)


def test_a_block_size_for_a_native_trace_names_the_parameter(run_notebook, tmp_path):
    """A native trace carries its own block size: the study refused trace_block_size naming its
    CLI flag (--trace-block-size)."""
    from papermill.exceptions import PapermillExecutionError

    trace = tmp_path / "t.jsonl"
    trace.write_text('{"kvtrace_trace": 1}\n{"request_id": "a", "arrival_ns": 0, "input_length": 4, '
                     '"output_length": 1, "token_ids": [1, 2, 3, 4]}\n')
    with pytest.raises(PapermillExecutionError, match=re.escape(f"KVTraceError: trace_block_size: 64: {trace} is a "
                                                                "native trace")):
        run_notebook("regression_analysis", trace=str(trace), trace_block_size=64)


def test_notebook_verdict_cautions_a_pair_recorded_under_other_definitions(run_notebook, study_db, tmp_path):
    """The notebook called B worse on a number whose meaning changed between the runs, its
    RESULT without a word of it (re-probe B): the verdict cautions, RESULT carries the notes."""
    import json
    import shutil

    import duckdb

    study, res = study_db  # (a copy of the module's study store: its off run's config is edited below)
    db = tmp_path / "old.duckdb"
    shutil.copy(study, db)
    con = duckdb.connect(str(db))
    (config,) = con.execute("SELECT config FROM runs WHERE run_id = ?", [res.first.run_off]).fetchone()
    config = json.loads(config)
    del config["definitions"]
    con.execute("UPDATE runs SET config = ? WHERE run_id = ?", [json.dumps(config), res.first.run_off])
    con.close()
    out, _ = run_notebook("regression_analysis", db_path=str(db), run_a=res.first.run_off, run_b=res.first.run_on)
    assert "recorded under different metric definitions" in out["verdict"]
    from kvtrace.metrics import DEFINITIONS

    assert out["definitions"] == {"a": 0, "b": DEFINITIONS}
    assert any(n.startswith("runs A and B were recorded under different metric definitions") for n in out["notes"])
