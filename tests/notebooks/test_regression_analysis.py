"""regression_analysis.ipynb on real study runs: its numbers equal diff_runs' and the store's."""

from __future__ import annotations

import pytest

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
    # The same seed gives the same bootstrap intervals in the notebook as here.
    for s in d.latency:
        assert out["latency"][s.name]["ci"] == [pytest.approx(s.ci_low), pytest.approx(s.ci_high)]
    assert (out["requests_gained"], out["requests_lost"]) == (d.requests.gained, d.requests.lost)
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
