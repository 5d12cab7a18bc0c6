"""Plotly figures built from the read API's frames. Pure functions: frames in, figure out
(None when there is nothing to draw, so the page shows its empty state)."""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go
import polars as pl
from plotly.subplots import make_subplots

NS = 1e9  # virtual ns -> s on time axes
MS = 1e6  # ns -> ms for latencies
COLORS = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#FF9DA6", "#9D755D"]


def _fig(title: str, x: str, y: str, **layout) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(title=title, xaxis_title=x, yaxis_title=y, hovermode="x unified", **layout)
    return fig


def _color(i: int) -> str:
    return COLORS[i % len(COLORS)]


def hit_rate(frame: pl.DataFrame, group_names: dict[int, str], belady: pl.DataFrame | None = None,
             belady_rate: tuple[str, float] | None = None) -> go.Figure | None:
    """Windowed (solid) and cumulative (dashed) token hit rate per group; the Belady bound
    as a curve (``belady``: its hit_rate_over_time) or a level (``belady_rate``: label, rate)."""
    if frame.height == 0:
        return None
    fig = _fig("Token hit rate over virtual time", "virtual time (s)", "hit rate")
    for i, (gid,) in enumerate(frame.select("group_id").unique().sort("group_id").iter_rows()):
        part = frame.filter(pl.col("group_id") == gid).sort("window_start_ns")
        t = (part["window_start_ns"] / NS).to_list()
        name = group_names.get(gid, f"group {gid}")
        fig.add_scatter(x=t, y=part["hit_rate"].to_list(), name=f"{name} (windowed)", mode="lines",
                        line=dict(color=_color(i)))
        fig.add_scatter(x=t, y=part["cum_hit_rate"].to_list(), name=f"{name} (cumulative)", mode="lines",
                        line=dict(color=_color(i), dash="dash"))
    if belady is not None and belady.height:
        part = belady.sort("window_start_ns")
        fig.add_scatter(x=(part["window_start_ns"] / NS).to_list(), y=part["cum_hit_rate"].to_list(),
                        name="Belady bound (cumulative, cache-only)", mode="lines",
                        line=dict(color="black", dash="dot"))
    elif belady_rate is not None and frame.height:
        label, rate = belady_rate
        starts = frame["window_start_ns"] / NS
        fig.add_scatter(x=[starts.min(), starts.max()], y=[rate, rate], name=label, mode="lines",
                        line=dict(color="black", dash="dot"))
    fig.update_yaxes(range=[0, 1.02], tickformat=".0%")
    return fig


def hit_sources(frame: pl.DataFrame) -> go.Figure | None:
    """Prompt tokens per window by where they came from, stacked."""
    if frame.height == 0:
        return None
    fig = _fig("Prompt tokens by source", "virtual time (s)", "tokens per window")
    t = (frame["window_start_ns"] / NS).to_list()
    sources = (("local_tokens", "local hit"), ("external_tokens", "external hit"), ("computed_tokens", "computed"))
    for i, (col, name) in enumerate(sources):
        fig.add_scatter(x=t, y=frame[col].to_list(), name=name, mode="lines", stackgroup="tokens",
                        line=dict(color=_color(i)))
    return fig


def usage(frame: pl.DataFrame, group_names: dict[int, str]) -> go.Figure | None:
    """Mean block-pool usage per KV group per window."""
    if frame.height == 0:
        return None
    fig = _fig("Block-pool usage", "virtual time (s)", "usage")
    for i, (gid,) in enumerate(frame.select("group_id").unique().sort("group_id").iter_rows()):
        part = frame.filter(pl.col("group_id") == gid).sort("window_start_ns")
        t = (part["window_start_ns"] / NS).to_list()
        name = group_names.get(gid, f"group {gid}")
        fig.add_scatter(x=t, y=part["mean_usage"].to_list(), name=f"{name} mean", mode="lines",
                        line=dict(color=_color(i)))
        fig.add_scatter(x=t, y=part["max_usage"].to_list(), name=f"{name} max", mode="lines",
                        line=dict(color=_color(i), dash="dot"))
    top = float(frame.select(pl.col("max_usage").max()).item() or 0.0)
    # the axis follows the peak, so a lightly used pool stays visible
    fig.update_yaxes(range=[0, min(1.02, max(0.01, 1.1 * top))], tickformat=".1%" if top < 0.1 else ".0%")
    return fig


def stacked_counts(frame: pl.DataFrame, title: str, y: str) -> go.Figure | None:
    """Blocks per window (columns window_start_ns, key, blocks), stacked by ``key``
    (evictions by reason or by publish kind)."""
    if frame.height == 0:
        return None
    fig = _fig(title, "virtual time (s)", y, barmode="stack", showlegend=True)
    for i, (k,) in enumerate(frame.select("key").unique().sort("key").iter_rows()):
        part = frame.filter(pl.col("key") == k).sort("window_start_ns")
        fig.add_bar(x=(part["window_start_ns"] / NS).to_list(), y=part["blocks"].to_list(), name=str(k),
                    marker_color=_color(i))
    return fig


def attribution_sankey(flows: pl.DataFrame) -> go.Figure | None:
    """publish kind -> eviction reason -> hot prefix, weighted by the later misses."""
    if flows.height == 0:
        return None
    labels: list[str] = []
    index: dict[str, int] = {}

    def node(text: str) -> int:
        if text not in index:
            index[text] = len(labels)
            labels.append(text)
        return index[text]

    src, dst, val = [], [], []
    for kind, reason, prefix, misses in flows.select("publish_kind", "evict_reason", "prefix", "misses").iter_rows():
        a, b = node(f"publish: {kind}"), node(f"evict: {reason}")
        c = node(f"prefix {prefix[:10]}" if prefix != "other" else "other prefixes")
        src += [a, b]
        dst += [b, c]
        val += [int(misses), int(misses)]
    fig = go.Figure(go.Sankey(node=dict(label=labels, pad=12), link=dict(source=src, target=dst, value=val),
                              name="attribution"))
    fig.update_layout(title="Which publishes evicted which hot prefixes (weighted by later misses)")
    return fig


def histograms(frame: pl.DataFrame, metrics: Sequence[tuple[str, str]]) -> go.Figure | None:
    """One panel per metric (their ranges differ by orders of magnitude) from
    (metric, bin_lo, bin_hi, count) rows."""
    present = [(m, name) for m, name in metrics if frame.filter(pl.col("metric") == m).height]
    if not present:
        return None
    fig = make_subplots(rows=1, cols=len(present), subplot_titles=[name for _, name in present])
    for i, (metric, name) in enumerate(present):
        part = frame.filter(pl.col("metric") == metric).sort("bin_lo")
        mid = ((part["bin_lo"] + part["bin_hi"]) / 2).to_list()
        width = (part["bin_hi"] - part["bin_lo"]).to_list()
        fig.add_bar(x=mid, y=part["count"].to_list(), width=width, name=name, marker_color=_color(i), row=1, col=i + 1)
        fig.update_xaxes(title_text="scheduler steps", row=1, col=i + 1)
    fig.update_layout(title="Block lifetime, idle-before-evict and reuse gap", showlegend=False)
    return fig


def correctness(frame: pl.DataFrame) -> go.Figure | None:
    """Stale hashes found, stale entries left, divergent outputs per window."""
    if frame.height == 0:
        return None
    fig = _fig("Stale hashes and divergent outputs", "virtual time (s)", "count per window", barmode="group")
    t = (frame["window_start_ns"] / NS).to_list()
    series = (("stale_found", "stale hash found"), ("stale_left", "stale entry left"),
              ("divergent_outputs", "divergent output"))
    for i, (col, name) in enumerate(series):
        fig.add_bar(x=t, y=frame[col].to_list(), name=name, marker_color=_color(i + 3))
    return fig


def cdf(curves: Sequence[tuple[str, pl.DataFrame]], title: str) -> go.Figure | None:
    """Quantile curves (q, value_ns) drawn as CDFs in ms."""
    fig = _fig(title, "ms", "fraction ≤ x")
    for i, (name, frame) in enumerate(curves):
        if frame.height:
            fig.add_scatter(x=(frame["value_ns"] / MS).to_list(), y=frame["q"].to_list(), name=name, mode="lines",
                            line=dict(color=_color(i)))
    fig.update_layout(hovermode="closest")
    return fig if fig.data else None


def latency_hist(frame: pl.DataFrame, title: str, name: str) -> go.Figure | None:
    if frame.height == 0:
        return None
    fig = _fig(title, "ms", "count")
    mid = (((frame["bin_lo"] + frame["bin_hi"]) / 2) / MS).to_list()
    width = ((frame["bin_hi"] - frame["bin_lo"]) / MS).to_list()
    fig.add_bar(x=mid, y=frame["count"].to_list(), width=width, name=name, marker_color=_color(0))
    return fig


def itl_over_time(frame: pl.DataFrame) -> go.Figure | None:
    if frame.height == 0:
        return None
    fig = _fig("ITL over virtual time", "virtual time (s)", "ms")
    t = (frame["window_start_ns"] / NS).to_list()
    series = (("mean_itl_ns", "mean ITL"), ("p50_itl_ns", "median of request p50"),
              ("max_p99_itl_ns", "max of request p99"))
    for i, (col, name) in enumerate(series):
        fig.add_scatter(x=t, y=(frame[col] / MS).to_list(), name=name, mode="lines", line=dict(color=_color(i)))
    return fig


_SEGMENT_COLORS = {"queue": "#BAB0AC", "prefill": "#4C78A8", "decode": "#54A24B"}
_MARKS = {"cache_hit": ("star", "#F58518"), "cow": ("diamond", "#B279A2"), "evict": ("x", "#E45756")}


def waterfall(frame: pl.DataFrame, request_id: str) -> go.Figure | None:
    """Queue, prefill chunks and decode as bars on a time axis; cache events as marks."""
    if frame.height == 0:
        return None
    t0 = frame["start_ns"].min()
    fig = _fig(f"Request {request_id}", "ms since arrival", "", barmode="overlay")
    rows = frame.to_dicts()
    for seg in ("queue", "prefill", "decode"):
        part = [r for r in rows if r["segment"] == seg and r["end_ns"] is not None]
        if part:
            fig.add_bar(
                y=[seg] * len(part), x=[(r["end_ns"] - r["start_ns"]) / MS for r in part],
                base=[(r["start_ns"] - t0) / MS for r in part], orientation="h", name=seg,
                marker_color=_SEGMENT_COLORS[seg],
                hovertext=[f"{r['num_tokens']} tokens" if r["num_tokens"] is not None else seg for r in part],
            )
    for mark, (symbol, color) in _MARKS.items():
        part = [r for r in rows if r["segment"] == mark]
        if part:
            fig.add_scatter(y=["prefill"] * len(part), x=[(r["start_ns"] - t0) / MS for r in part], mode="markers",
                            name=mark.replace("_", " "), marker=dict(symbol=symbol, size=14, color=color),
                            hovertext=[r["detail"] or mark for r in part])
    fig.update_layout(hovermode="closest")
    fig.update_yaxes(categoryorder="array", categoryarray=["decode", "prefill", "queue"])
    return fig


def overlay(curves: Sequence[tuple[str, pl.DataFrame]], x: str, y: str, title: str, ytitle: str, yscale: float = 1.0,
            percent: bool = False) -> go.Figure | None:
    """One line per run (compare page): A solid, B dashed."""
    fig = _fig(title, "virtual time (s)", ytitle)
    for i, (name, frame) in enumerate(curves):
        if frame.height:
            frame = frame.sort(x)
            fig.add_scatter(x=(frame[x] / NS).to_list(), y=(frame[y] / yscale).to_list(), name=name, mode="lines",
                            line=dict(color=_color(i), dash=("solid", "dash")[i % 2]))
    if percent:
        fig.update_yaxes(tickformat=".0%")
    return fig if fig.data else None


MAX_REQUEST_BARS = 2000


def request_delta(diff: pl.DataFrame) -> go.Figure | None:
    """Per-request hit-token difference B - A, coloured by sign: one bar per request, or,
    past MAX_REQUEST_BARS requests, a histogram of the differences (bars would not be legible)."""
    if diff.height == 0:
        return None
    if diff.height > MAX_REQUEST_BARS:
        fig = _fig(f"Per-request hit-token difference (B − A), {diff.height:,} requests", "hit tokens B − A",
                   "requests")
        hist = diff["hit_delta"].cast(pl.Float64).hist(bin_count=80, include_category=False)
        width = hist["breakpoint"].diff().fill_null(strategy="backward")
        mid = hist["breakpoint"] - width / 2
        fig.add_bar(x=mid.to_list(), y=hist["count"].to_list(), width=width.to_list(), name="hit tokens B − A",
                    marker_color=["#54A24B" if v > 0 else "#E45756" if v < 0 else "#BAB0AC" for v in mid.to_list()])
        fig.update_yaxes(type="log")
        fig.update_layout(hovermode="closest")
        return fig
    d = diff["hit_delta"].to_list()
    fig = _fig("Per-request hit-token difference (B − A)", "request", "hit tokens B − A")
    fig.add_bar(x=diff["request_id"].to_list(), y=d, name="hit tokens B − A",
                marker_color=["#54A24B" if v > 0 else "#E45756" if v < 0 else "#BAB0AC" for v in d])
    fig.update_layout(hovermode="closest")
    return fig


def capacity_curve(points: pl.DataFrame, marks: Sequence[tuple[str, float, float, bool]]) -> go.Figure | None:
    """Token hit rate against capacity (blocks, log axis), one line per policy, the
    unbounded cache as a level; ``marks``: (label, capacity, hit rate, is the selected run)."""
    bounded = points.filter(pl.col("capacity_blocks").is_not_null())
    if bounded.height == 0:
        return None
    fig = _fig("Token hit rate against capacity", "capacity (blocks, log scale)", "token hit rate")
    names = {"lru": "LRU", "belady": "Belady bound (offline optimum)"}
    for i, policy in enumerate(("lru", "belady")):
        part = bounded.filter(pl.col("policy") == policy).sort("capacity_blocks")
        if part.height:
            fig.add_scatter(x=part["capacity_blocks"].to_list(), y=part["token_hit_rate"].to_list(),
                            name=names[policy], mode="lines+markers",
                            line=dict(color=_color(i), dash="solid" if policy == "lru" else "dot"))
    unbounded = points.filter(pl.col("capacity_blocks").is_null())
    if unbounded.height:
        rate = float(unbounded["token_hit_rate"][0])
        xs = bounded["capacity_blocks"]
        fig.add_scatter(x=[xs.min(), xs.max()], y=[rate, rate], name="unbounded cache", mode="lines",
                        line=dict(color="black", dash="dash"))
    for label, x, y, selected in marks:
        fig.add_scatter(x=[x], y=[y], name=label, mode="markers+text", text=[label], textposition="top center",
                        marker=dict(size=14 if selected else 9, symbol="diamond" if selected else "circle",
                                    color="#E45756" if selected else "#9D755D"))
    top = float(bounded["token_hit_rate"].max() or 0.0)
    fig.update_xaxes(type="log")
    fig.update_yaxes(range=[0, min(1.02, max(0.05, 1.15 * max([top, *(m[2] for m in marks)])))], tickformat=".0%")
    return fig
