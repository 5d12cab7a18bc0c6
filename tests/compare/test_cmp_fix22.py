"""Fixes of what the re-probe of diff, study, demo, runs and export found (task cmpfix)."""

from __future__ import annotations


def test_a_latency_change_of_exactly_one_microsecond_is_a_change():
    """The `< 1e-3` ms check ran on float ms: 60.279851 - 60.280851 is -0.000999999... ms, a
    whole microsecond called "same" (and no finding in the percentiles, nor in a study's verdict)."""
    from kvtrace.compare.model import MetricDelta, PercentileShift
    from kvtrace.compare.study import TRANSIENT_CHECKPOINT_RETENTION, expected_effect

    a, b = 60.280851, 60.279851
    assert -(b - a) < 1e-3  # (the float difference lies under the resolution)
    assert MetricDelta("median_ttft_ms", a, b, b - a, None).verdict == "better"
    assert MetricDelta("median_ttft_ms", b, a, a - b, None).verdict == "worse"
    assert MetricDelta("median_ttft_ms", a, a - 999e-9, -999e-9, None).verdict == "same"  # (999 ns)
    shift = PercentileShift("ttft_ms", 50.0, a, b, b - a, -0.01, -0.0005)
    assert shift.significant
    assert not PercentileShift("ttft_ms", 50.0, a, a - 999e-9, -999e-9, -0.01, -0.0005).significant
    off = {"prefix_cache_hit_rate": 0.10, "median_ttft_ms": a}
    on = {"prefix_cache_hit_rate": 0.15, "median_ttft_ms": b}
    assert expected_effect(TRANSIENT_CHECKPOINT_RETENTION, on, off)["shown"] is True
