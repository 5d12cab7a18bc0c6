"""The figure builders on hand-made frames: shapes the pages rely on, and the empty case."""

from __future__ import annotations

import polars as pl
import pytest

from kvtrace.dashboard import charts


def test_request_delta_is_a_bar_per_request_coloured_by_sign():
    diff = pl.DataFrame({"request_id": ["a", "b", "c"], "cached_delta": [64, -32, 0]})
    (bars,) = charts.request_delta(diff).data
    assert list(bars.x) == ["a", "b", "c"] and list(bars.y) == [64, -32, 0]
    assert list(bars.marker.color) == ["#54A24B", "#E45756", "#BAB0AC"]


def test_request_delta_turns_into_a_histogram_past_the_bar_limit():
    n = charts.MAX_REQUEST_BARS + 1
    diff = pl.DataFrame({"request_id": [f"r{i}" for i in range(n)],
                         "cached_delta": [(i % 9) * 64 - 256 for i in range(n)]})
    (bars,) = charts.request_delta(diff).data
    assert len(bars.x) <= 80 and sum(bars.y) == n  # every request lands in one bin


def test_empty_frames_give_no_figure_so_the_page_shows_its_empty_state():
    empty = pl.DataFrame(schema={"window_start_ns": pl.Int64, "prefix_cache_queries": pl.Int64,
                                 "prefix_cache_hit_rate": pl.Float64, "cum_prefix_cache_hit_rate": pl.Float64})
    assert charts.hit_rate(empty) is None
    assert charts.request_delta(pl.DataFrame(schema={"request_id": pl.String, "cached_delta": pl.Int64})) is None
    assert charts.attribution_sankey(pl.DataFrame(schema={"publish_kind": pl.String, "evict_reason": pl.String,
                                                          "prefix": pl.String, "misses": pl.UInt32})) is None


def test_the_hit_rate_axis_fits_the_data():
    frame = pl.DataFrame({"window_start_ns": [0, 10**9], "prefix_cache_queries": [10, 10],
                          "prefix_cache_hit_rate": [0.30, 0.40], "cum_prefix_cache_hit_rate": [0.30, 0.35]})
    fig = charts.hit_rate(frame, ("Belady bound", 0.5))
    lo, hi = fig.layout.yaxis.range
    assert 0.2 <= lo < 0.3 and 0.5 < hi <= 0.6  # not 0..100% around a band of 30-50%
    names = [t.name for t in fig.data]
    assert names == ["prefix cache hit rate (per window)", "prefix cache hit rate (cumulative)", "Belady bound"]


def test_sankey_links_publish_kind_to_reason_to_prefix_weighted_by_misses():
    flows = pl.DataFrame({"publish_kind": ["checkpoint", "full", "none"], "evict_reason": ["lru", "lru", "lru"],
                          "prefix": ["abcdef0123456789", "other", "abcdef0123456789"], "misses": [5, 2, 4]})
    names = {"abcdef0123456789": "abcdef01 · first r3 (2,752 tokens) · longest hit 2,688"}
    (s,) = charts.attribution_sankey(flows, names).data
    labels = list(s.node.label)
    assert set(labels) == {"checkpoint published", "full block published", "no publish (block reused uncached)",
                           "LRU eviction", names["abcdef0123456789"], "other prefixes"}
    into_prefix = [v for dst, v in zip(s.link.target, s.link.value) if labels[dst] == names["abcdef0123456789"]]
    assert into_prefix == [5, 4]
    # a node has its kind's or its reason's one colour
    colours = dict(zip(labels, s.node.color))
    assert colours["checkpoint published"] == charts.KIND_COLORS["checkpoint"]
    assert colours["LRU eviction"] == charts.REASON_COLORS["lru"]


@pytest.mark.parametrize("key", ["lru", "stale_hash", "full", "checkpoint", "none"])
def test_a_reason_or_kind_keeps_its_colour_whatever_else_is_in_the_chart(key):
    def colour_of(keys: list[str]) -> str:
        frame = pl.DataFrame({"window_start_ns": [0] * len(keys), "key": keys, "blocks": [1] * len(keys)})
        fig = charts.stacked_counts(frame, "t", "y")
        return next(t.marker.color for t in fig.data if t.name == key)

    assert colour_of([key]) == colour_of(["zz-other", "replaced", key, "boundary"])


def test_literal_text_escapes_every_string_a_figure_draws():
    from plotly.subplots import make_subplots

    from kvtrace.dashboard import ui

    mark = "<b>x</b>&"
    fig = make_subplots(rows=1, cols=2, subplot_titles=[mark, "plain"])
    fig.add_bar(x=[mark, "r2"], y=[1, 2], name=mark, hovertext=[mark, None], row=1, col=1)
    fig.add_scatter(x=[1, 2], y=[3, 4], text=mark, mode="markers+text", row=1, col=2)
    fig.update_layout(title=mark, xaxis_title=mark)
    out = ui.literal_text(fig).to_plotly_json()
    escaped = "&lt;b&gt;x&lt;/b&gt;&amp;"
    assert out["data"][0]["name"] == escaped and list(out["data"][0]["x"]) == [escaped, "r2"]
    assert list(out["data"][0]["hovertext"]) == [escaped, None] and out["data"][1]["text"] == escaped
    assert list(out["data"][1]["x"]) == [1, 2]  # numbers untouched
    assert out["layout"]["title"]["text"] == escaped and out["layout"]["xaxis"]["title"]["text"] == escaped
    assert [a["text"] for a in out["layout"]["annotations"]] == [escaped, "plain"]
