"""Fixes the lead made from the re-probe of the last hour's diff, study and dashboard fixes."""

from __future__ import annotations

from kvtrace.compare import study as S
from kvtrace.compare.model import diff_summaries
from kvtrace.compare.render import fmt_rel, shows_no_change, to_markdown
from kvtrace.dashboard import ui


def test_a_small_rate_change_and_its_relative_change_agree():
    """`| prefix_cache_hit_rate | 0.2306 | 0.2305 | -3.85e-05 | +0.0% | ❌ worse |`: the Δ kept its
    digits, the Δ% read it as no change (re-probe F)."""
    md = to_markdown(diff_summaries({"prefix_cache_hit_rate": 0.2306}, {"prefix_cache_hit_rate": 0.2306 - 3.85e-5}))
    row = next(line for line in md.splitlines() if line.startswith("| prefix_cache_hit_rate |"))
    assert "| -3.85e-05 | -0.0% |" in row
    assert not shows_no_change(-3.85e-5, fine=True) and shows_no_change(-3e-6)  # (a sub-µs time: none)
    assert fmt_rel(-1e-4, -3e-6) == "+0.0%"


def test_a_refuted_expectation_is_not_shown_even_where_a_latency_is_not_judged():
    """A hit rate that fell with the behaviour on read "not measured" beside a TTFT without a CI
    (re-probe F)."""
    off = {"prefix_cache_hit_rate": 0.3, "median_ttft_ms": 20.0}
    on = {"prefix_cache_hit_rate": 0.2, "median_ttft_ms": 10.0}
    effect = S.StudyPoint(on=on, off=off, diff=diff_summaries(off, on, ci_verdicts=True)).effect(
        S.TRANSIENT_CHECKPOINT_RETENTION)
    assert effect["shown"] is False
    assert any("a median needs 50" in u for u in effect["unmet"])  # (not "a study with --db resamples")


def test_the_dashboard_shows_tiny_rates_and_changes_in_their_digits():
    """16 hit tokens in 416,000 read 0.0% beside them; a -3.85e-05 change "-0.000 pp" (re-probe F)."""
    assert ui.pct(16 / 416_000) == "0.0038%" and ui.pct(0.5) == "50.0%" and ui.pct(0) == "0.0%"
    assert ui.pp(-3.85e-7) == "-3.9e-05 pp" and ui.pp(0.039) == "+3.9 pp" and ui.pp(0) == "0.0 pp"
