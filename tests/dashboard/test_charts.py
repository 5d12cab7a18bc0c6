"""The figure builders on hand-made frames: shapes the pages rely on, and the empty case."""

from __future__ import annotations

import polars as pl

from kvtrace.dashboard import charts


def test_request_delta_is_a_bar_per_request_coloured_by_sign():
    diff = pl.DataFrame({"request_id": ["a", "b", "c"], "hit_delta": [64, -32, 0]})
    (bars,) = charts.request_delta(diff).data
    assert list(bars.x) == ["a", "b", "c"] and list(bars.y) == [64, -32, 0]
    assert list(bars.marker.color) == ["#54A24B", "#E45756", "#BAB0AC"]


def test_request_delta_turns_into_a_histogram_past_the_bar_limit():
    n = charts.MAX_REQUEST_BARS + 1
    diff = pl.DataFrame({"request_id": [f"r{i}" for i in range(n)],
                         "hit_delta": [(i % 9) * 64 - 256 for i in range(n)]})
    (bars,) = charts.request_delta(diff).data
    assert len(bars.x) <= 80 and sum(bars.y) == n  # every request lands in one bin


def test_empty_frames_give_no_figure_so_the_page_shows_its_empty_state():
    empty = pl.DataFrame(schema={"window_start_ns": pl.Int64, "group_id": pl.Int32, "hit_rate": pl.Float64,
                                 "cum_hit_rate": pl.Float64})
    assert charts.hit_rate(empty, {}) is None
    assert charts.request_delta(pl.DataFrame(schema={"request_id": pl.String, "hit_delta": pl.Int64})) is None
    assert charts.attribution_sankey(pl.DataFrame(schema={"publish_kind": pl.String, "evict_reason": pl.String,
                                                          "prefix": pl.String, "misses": pl.UInt32})) is None


def test_sankey_links_publish_kind_to_reason_to_prefix_weighted_by_misses():
    flows = pl.DataFrame({"publish_kind": ["checkpoint", "full"], "evict_reason": ["lru", "lru"],
                          "prefix": ["abcdef0123456789", "other"], "misses": [5, 2]})
    (s,) = charts.attribution_sankey(flows).data
    labels = list(s.node.label)
    assert {"publish: checkpoint", "publish: full", "evict: lru", "prefix abcdef0123", "other prefixes"} == set(labels)
    into_prefix = [v for dst, v in zip(s.link.target, s.link.value) if labels[dst] == "prefix abcdef0123"]
    assert into_prefix == [5]
