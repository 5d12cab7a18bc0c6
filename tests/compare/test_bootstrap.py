"""The request-level bootstrap: linear percentiles (kvtrace.numeric's definition) of
resampled multisets, exact against a reference and numpy; seeded, paired CIs."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrace.compare import bootstrap as BS
from kvtrace.compare import model as M
from kvtrace.numeric import percentile
from tests.support.oracles import weighted_percentiles

# ------------------------------------------------------------- linear percentiles


def _expanded_percentiles(values, weights, qs):
    """np.percentile of each row's expanded multiset (NaN rows for empty ones)."""
    rows = []
    for w in weights:
        expanded = np.repeat(values, w)
        rows.append(np.percentile(expanded, qs) if expanded.size else np.full(len(qs), np.nan))
    return np.array(rows)


def test_reference_matches_numpy_linear_on_expanded_multisets():
    rng = np.random.default_rng(3)
    values = np.sort(rng.gamma(2.0, 10.0, size=37))
    weights = rng.integers(0, 4, size=(25, 37))
    weights[5] = 0  # an empty multiset -> NaN
    ps = (0, 1, 33.3, 50, 90, 99, 100)
    got = weighted_percentiles(values, weights, ps)
    assert np.isnan(got[5]).all()
    np.testing.assert_array_equal(got, _expanded_percentiles(values, weights, ps))


def test_linear_interpolates_between_neighbouring_ranks():
    # Four items 10, 20, 30, 40: p50 sits halfway between ranks 1 and 2 (nearest rank: 20).
    values = np.array([10.0, 20.0, 30.0, 40.0])
    owner = np.arange(4)
    counts = np.array([[1, 1, 1, 1], [2, 1, 0, 1], [0, 0, 3, 0]])
    got = BS.chunked_weighted_percentiles(values, owner, counts, (0, 50, 90, 100))
    np.testing.assert_allclose(got[0], [10.0, 25.0, 37.0, 40.0])
    np.testing.assert_allclose(got[1], [10.0, 15.0, 34.0, 40.0])  # multiset 10, 10, 20, 40
    np.testing.assert_array_equal(got[2], [30.0, 30.0, 30.0, 30.0])


@pytest.mark.parametrize("m, n, chunks", [(1, 1, None), (37, 9, 4), (500, 40, 16), (2000, 100, None), (999, 50, 7)])
def test_chunked_weighted_percentiles_equal_the_reference(m, n, chunks):
    rng = np.random.default_rng(m + n)
    values = np.sort(np.round(rng.gamma(2.0, 5.0, size=m), 1))  # ties included
    owner = rng.integers(0, n, size=m)
    counts = rng.integers(0, 3, size=(30, n))
    counts[0] = 0
    ps = (0, 50, 90, 99, 99.9, 100)
    fast = BS.chunked_weighted_percentiles(values, owner, counts, ps, chunks=chunks)
    assert np.isnan(fast[0]).all()
    np.testing.assert_array_equal(fast, weighted_percentiles(values, counts[:, owner], ps))
    np.testing.assert_array_equal(fast, _expanded_percentiles(values, counts[:, owner], ps))


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    m=st.integers(1, 60),
    n=st.integers(1, 8),
    replicates=st.integers(1, 6),
    qs=st.lists(st.floats(0, 100, allow_nan=False), min_size=1, max_size=5),
)
def test_chunked_equals_reference_and_numpy_on_random_multisets(data, m, n, replicates, qs):
    # Few distinct values, so that ties and runs of equal values are common.
    values = np.sort(np.array(data.draw(st.lists(st.integers(0, 12), min_size=m, max_size=m)), dtype=np.float64) / 4)
    owner = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=m, max_size=m)))
    counts = np.array(data.draw(st.lists(st.lists(st.integers(0, 4), min_size=n, max_size=n),
                                         min_size=replicates, max_size=replicates)))
    chunks = data.draw(st.none() | st.integers(1, m + 1))
    fast = BS.chunked_weighted_percentiles(values, owner, counts, qs, chunks=chunks)
    np.testing.assert_array_equal(fast, weighted_percentiles(values, counts[:, owner], qs))
    np.testing.assert_allclose(fast, _expanded_percentiles(values, counts[:, owner], qs), rtol=1e-12, atol=1e-12)


def test_chunked_is_exact_in_small_expansion_blocks_and_with_heavy_weights(monkeypatch):
    rng = np.random.default_rng(9)
    values = np.sort(rng.gamma(2.0, 5.0, size=300))
    owner = rng.integers(0, 20, size=300)
    counts = rng.integers(0, 4, size=(12, 20))
    ps = (1, 50, 97.5)
    want = weighted_percentiles(values, counts[:, owner], ps)
    monkeypatch.setattr(BS, "_BLOCK", 5)  # many expansion blocks, some of one row each
    np.testing.assert_array_equal(BS.chunked_weighted_percentiles(values, owner, counts, ps, chunks=9), want)
    # Chunk weights beyond float32's exact integers take the float64 product.
    heavy = counts * (1 << 22)
    np.testing.assert_array_equal(BS.chunked_weighted_percentiles(values, owner, heavy, ps, chunks=3),
                                  weighted_percentiles(values, heavy[:, owner], ps))


# ------------------------------------------------------------------- resampling


def test_resample_counts_are_seeded_and_sum_to_n():
    c1 = BS.resample_counts(np.random.Generator(np.random.PCG64(7)), 50, 200)
    c2 = BS.resample_counts(np.random.Generator(np.random.PCG64(7)), 50, 200)
    c3 = BS.resample_counts(np.random.Generator(np.random.PCG64(8)), 50, 200)
    assert c1.shape == (200, 50)
    assert (c1.sum(axis=1) == 50).all()
    assert np.array_equal(c1, c2)
    assert not np.array_equal(c1, c3)
    assert BS.resample_counts(np.random.Generator(np.random.PCG64(7)), 0, 3).shape == (3, 0)


def _latency_frames(seed: int, n: int, shift_ms: float, itl_per_req: int = 8):
    rng = np.random.default_rng(seed)
    ids = [f"req-{i:04d}" for i in range(n)]
    ttft = rng.gamma(2.0, 25.0, size=n)
    itl_ids = np.repeat(ids, itl_per_req)
    itl = rng.gamma(4.0, 1.5, size=n * itl_per_req)
    a = {"ttft_ms": pl.DataFrame({"request_id": ids, "ttft_ms": ttft}),
         "itl_ms": pl.DataFrame({"request_id": itl_ids, "itl_ms": itl})}
    b = {"ttft_ms": pl.DataFrame({"request_id": ids, "ttft_ms": ttft + shift_ms}),
         "itl_ms": pl.DataFrame({"request_id": itl_ids, "itl_ms": itl})}
    return a, b


def test_bootstrap_is_deterministic_for_a_seed_and_varies_with_it():
    a, b = _latency_frames(1, 600, shift_ms=0.0)  # (600: 6 TTFTs beyond p99, enough for its CI)
    b["ttft_ms"] = b["ttft_ms"].with_columns(pl.col("ttft_ms") * 1.3)
    s1, info1 = BS.latency_shifts(a, b, seed=11, resamples=400)
    s2, _ = BS.latency_shifts(a, b, seed=11, resamples=400)
    s3, _ = BS.latency_shifts(a, b, seed=12, resamples=400)
    assert [(s.name, s.ci_low, s.ci_high) for s in s1] == [(s.name, s.ci_low, s.ci_high) for s in s2]
    assert [(s.ci_low, s.ci_high) for s in s1] != [(s.ci_low, s.ci_high) for s in s3]
    assert info1 == {"seed": 11, "resamples": 400, "paired": True, "requests_a": 600, "requests_b": 600, "no_ci": []}
    assert [s.name for s in s1] == ["p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
                                    "p50_itl_ms", "p90_itl_ms", "p99_itl_ms"]
    # A 30% slower TTFT: every TTFT percentile rises, with an interval above 0.
    assert all(s.delta > 0 and s.ci_low > 0 for s in s1[:3])


def test_point_estimates_are_the_one_percentile_definition():
    a, b = _latency_frames(6, 100, shift_ms=3.0)
    shifts, _ = BS.latency_shifts(a, b, seed=0, resamples=50)
    by = {s.name: s for s in shifts}
    for metric, frames in (("ttft_ms", a), ("itl_ms", a), ("ttft_ms", b)):
        side = "a" if frames is a else "b"
        values = frames[metric][metric].to_numpy()
        for q in (50, 90, 99):
            got = getattr(by[f"p{q}_{metric.removesuffix('_ms')}_ms"], side)
            assert got == pytest.approx(percentile(values, q), rel=1e-15)
            assert got == pytest.approx(float(np.percentile(values, q)), rel=1e-15)
    # Linear, not nearest rank: of 100 TTFTs, p50 is halfway between ranks 49 and 50, p90
    # a tenth of the way from rank 89 to 90.
    ttft = np.sort(a["ttft_ms"]["ttft_ms"].to_numpy())
    assert by["p50_ttft_ms"].a == pytest.approx((ttft[49] + ttft[50]) / 2)
    assert by["p90_ttft_ms"].a == pytest.approx(ttft[89] + 0.1 * (ttft[90] - ttft[89]))


def test_paired_bootstrap_brackets_a_constant_shift_and_zero_for_no_change():
    a, b = _latency_frames(2, 600, shift_ms=10.0)
    shifts, _ = BS.latency_shifts(a, b, seed=0, resamples=300)
    by = {s.name: s for s in shifts}
    # A constant +10 ms on every request: each TTFT percentile moves by 10, and the paired
    # bootstrap (same requests in both arms) gives a degenerate interval at 10.
    for q in ("p50", "p90", "p99"):
        s = by[f"{q}_ttft_ms"]
        assert s.delta == pytest.approx(10.0)
        assert s.ci_low == pytest.approx(10.0) and s.ci_high == pytest.approx(10.0)
        assert s.significant
    # ITL unchanged: delta 0 and CI [0, 0], not significant.
    s = by["p90_itl_ms"]
    assert s.delta == 0.0 and s.ci_low == 0.0 and s.ci_high == 0.0 and not s.significant
    assert by["p99_itl_ms"].a == percentile(a["itl_ms"]["itl_ms"].to_numpy(), 99)


def test_unpaired_bootstrap_when_request_sets_differ():
    a, _ = _latency_frames(4, 200, 0.0)
    b, _ = _latency_frames(5, 150, 0.0)
    shifts, info = BS.latency_shifts(a, b, seed=0, resamples=300)
    assert info["paired"] is False and (info["requests_a"], info["requests_b"]) == (200, 150)
    s = {x.name: x for x in shifts}["p50_ttft_ms"]
    assert s.ci_low < s.delta < s.ci_high  # a real interval around the point estimate
    # Both runs draw from one distribution: the interval holds 0 and the shift is no finding.
    assert s.ci_low < 0 < s.ci_high and not s.significant


def test_runs_without_request_timing_have_no_shifts():
    empty = {"ttft_ms": pl.DataFrame(schema={"request_id": pl.Utf8, "ttft_ms": pl.Float64}),
             "itl_ms": pl.DataFrame(schema={"request_id": pl.Utf8, "itl_ms": pl.Float64})}
    shifts, info = BS.latency_shifts(empty, empty, seed=0, resamples=10)
    assert shifts == [] and info["requests_a"] == 0
    # One side without observations (a cache-only run has no clock): nothing is set against
    # the other side's latencies, no shift at all.
    a, _ = _latency_frames(3, 20, 0.0)
    assert BS.latency_shifts(a, empty, seed=0, resamples=10)[0] == []
    assert BS.latency_shifts(empty, a, seed=0, resamples=10)[0] == []


# ------------------------------------------------------ where no interval is honest


def test_one_or_two_requests_get_no_interval_and_the_diff_says_so():
    # One request: every paired replicate is that request, so the "interval" was the single
    # point [delta, delta], and called significant.
    for n in (1, 2):
        a, b = _latency_frames(8, n, shift_ms=4.0)
        shifts, info = BS.latency_shifts(a, b, seed=0, resamples=200)
        assert [s.delta for s in shifts[:3]] == pytest.approx([4.0] * 3)  # the point estimates stand
        assert all(np.isnan(s.ci_low) and np.isnan(s.ci_high) and not s.significant for s in shifts)
        assert info["no_ci"] == [s.name for s in shifts]
    note = BS.ci_note(info["no_ci"])
    assert note is not None and note.startswith("no 95% CI for p50_ttft_ms, p90_ttft_ms, p99_ttft_ms, p50_itl_ms")
    assert "10 requests" in note and BS.ci_note([]) is None


@pytest.mark.parametrize("requests, observations, q, ok", [
    (10, 11, 50, True), (10, 10, 50, False), (9, 1000, 50, False),  # 5 on each side of a median; 10 requests
    (100, 51, 90, True), (100, 50, 90, False), (501, 501, 99, True), (500, 500, 99, False),
    (10, 10**6, 0, False), (10, 10**6, 100, False), (10, 10**6, 99.9, True),  # (a minimum or maximum: never)
])
def test_ci_estimable_needs_ten_requests_and_five_observations_beyond_the_percentile(requests, observations, q, ok):
    assert BS.ci_estimable(requests, observations, q) is ok


def test_a_tail_percentile_of_a_small_run_has_no_interval_the_rest_have():
    # 100 requests with 8 gaps each: TTFT's p99 has one TTFT beyond it (no CI: paired, such
    # intervals covered the true shift 68-79% of the time), ITL's p99 has 8 gaps (a CI).
    a, b = _latency_frames(10, 100, shift_ms=2.0)
    b["ttft_ms"] = b["ttft_ms"].with_columns(pl.col("ttft_ms") * 1.1)
    by = {s.name: s for s in BS.latency_shifts(a, b, seed=0, resamples=200)[0]}
    assert np.isnan(by["p99_ttft_ms"].ci_low) and by["p99_ttft_ms"].delta > 0
    assert all(not np.isnan(by[k].ci_low) for k in ("p50_ttft_ms", "p90_ttft_ms", "p50_itl_ms", "p99_itl_ms"))


def test_paired_intervals_cover_a_known_shift_near_their_level():
    """A small seeded coverage check (the report's simulations are larger): 30% of requests
    get a cache hit that quarters their TTFT; the true percentile shifts come from 10**6 draws."""
    rng = np.random.default_rng(21)

    def draw(n):
        a = rng.gamma(2.0, 25.0, size=n)
        return a, np.where(rng.random(n) < 0.3, a / 4, a) + rng.normal(0, 0.5, size=n)

    big_a, big_b = draw(10**6)
    true = {q: np.percentile(big_b, q) - np.percentile(big_a, q) for q in (50, 90)}
    covered = dict.fromkeys(true, 0)
    reps, n = 60, 80
    for r in range(reps):
        ta, tb = draw(n)
        ids = [f"r{i}" for i in range(n)]
        fa = {"ttft_ms": pl.DataFrame({"request_id": ids, "ttft_ms": ta})}
        fb = {"ttft_ms": pl.DataFrame({"request_id": ids, "ttft_ms": tb})}
        for s in BS.latency_shifts(fa, fb, seed=r, resamples=300, percentiles=(50, 90))[0]:
            covered[int(s.percentile)] += s.ci_low <= true[s.percentile] <= s.ci_high
    assert all(covered[q] >= 0.85 * reps for q in true), covered


def test_a_shift_below_the_latency_resolution_is_no_finding():
    # Every request 0.1 ns later: the paired CI excludes 0, but the summary table calls a
    # change under a microsecond "same", and the latency table must not call it worse.
    s = M.PercentileShift("ttft_ms", 50, 10.0, 10.0000001, 1e-7, 1e-7, 1e-7)
    assert not s.significant
    assert M.MetricDelta(s.name, s.a, s.b, s.delta, None).verdict == "same"
    assert M.PercentileShift("ttft_ms", 50, 10.0, 10.002, 0.002, 0.001, 0.003).significant
