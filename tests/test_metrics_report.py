"""The terminal summary shows every rate of a run summary in one format."""

from __future__ import annotations

import io

from rich.console import Console

from kvtrace import metrics
from kvtrace.replay.report import format_value, summary_table


def test_every_rate_is_a_percentage_in_the_summary_table():
    requests = [{metrics.PROMPT: 1000, metrics.LOCAL_HIT: 520, metrics.EXTERNAL_QUERY: 480,
                 metrics.EXTERNAL_HIT: 137, metrics.PREEMPTED_QUERY: 300, metrics.PREEMPTED_HIT: 45}]
    summary = {**metrics.hit_summary(requests), **metrics.block_hits(7, 13)}
    assert set(metrics.SUMMARY_RATES) <= summary.keys()
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(summary_table(summary))
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in out.getvalue().splitlines()
            if line.count("│") == 3}
    for key in metrics.SUMMARY_RATES:
        assert rows[key] == f"{100 * summary[key]:.2f}%", key  # (external showed 0.285 beside 52.00%)
    assert rows["external_prefix_cache_hit_rate"] == "28.54%"
    assert rows["prefix_cache_queries"] == "1,000"  # counts stay counts


def test_a_missing_rate_is_a_dash_not_zero_percent():
    assert format_value("preempted_prefix_cache_hit_rate", None) == "-"
    assert format_value("external_prefix_cache_hit_rate", 0.0) == "0.00%"


def test_a_backend_label_names_the_vllm_a_run_drove_and_a_dirty_checkout():
    """Every view's label of a run's cache manager (metrics.backend_label): a long commit was
    cut to 12 characters with its -dirty mark, so two states of one checkout read alike."""
    from kvtrace.metrics import backend_label

    dirty = {"backend": "vllm", "vllm_version": "0.33.1.dev5", "vllm_commit": "a" * 40 + "-dirty"}
    assert backend_label("engine", dirty) == "vllm 0.33.1.dev5 @ aaaaaaaaaaaa-dirty"
    assert backend_label("engine", {**dirty, "vllm_commit": "a" * 40}) == "vllm 0.33.1.dev5 @ aaaaaaaaaaaa"
    assert backend_label("engine", {}) == "kvtrace" and backend_label("live", None) == "vllm"
    assert backend_label("otlp", {}) is None  # (a collector cannot know its sender's manager)


def test_a_trace_path_in_the_summary_table_is_shown_as_typed():
    """`kvtrace replay $'esc\\x1b[31mRED.jsonl'` put the escape sequence on the terminal
    through the table's trace row, and a path with [red] in it recoloured the row."""
    out = io.StringIO()
    summary = {"trace": "t\x1b[31mRED[red]x.jsonl", "requests": 3}
    Console(file=out, width=200, color_system="truecolor", force_terminal=True).print(summary_table(summary))
    text = out.getvalue()
    assert "\x1b[31m" not in text and "\\x1b[31mRED[red]x.jsonl" in text
