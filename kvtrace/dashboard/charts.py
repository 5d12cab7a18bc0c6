"""Plotly figures built from the read API's frames. Pure functions: frames in, figure out
(None when there is nothing to draw, so the page shows its empty state)."""

from __future__ import annotations

import contextvars
from collections.abc import Sequence

import plotly.graph_objects as go
import polars as pl
from plotly.subplots import make_subplots

from kvtrace.metrics import MODELLED

NS = 1e9  # virtual ns -> s on time axes
MS = 1e6  # ns -> ms for latencies
COLORS = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#FF9DA6", "#9D755D"]


VIRTUAL_TIME = "virtual time (s)"
# The time axis's title for the run the page shows (``set_time_axis``, each script run): an
# engine replay's modelled clock, else what its times are (a cache-only run has none: its
# spans are 1 ms a request apart, which every chart called virtual time).
_TIME_AXIS: contextvars.ContextVar[str] = contextvars.ContextVar("kvtrace_time_axis", default=VIRTUAL_TIME)


def set_time_axis(title: str) -> None:
    _TIME_AXIS.set(title)


def time_axis() -> str:
    return _TIME_AXIS.get()


def _fig(title: str, x: str, y: str, **layout) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(title=title, xaxis_title=x, yaxis_title=y, hovermode="x unified", **layout)
    return fig


def _color(i: int) -> str:
    return COLORS[i % len(COLORS)]


def _fit_rates(fig: go.Figure, values: Sequence[float | None]) -> None:
    """A rate axis that fits the data (with a margin), never past 0..100%."""
    vals = [v for v in values if v is not None]
    if not vals:
        return
    lo, hi = min(vals), max(vals)
    pad = max(0.02, 0.1 * (hi - lo))
    fig.update_yaxes(range=[max(0.0, lo - pad), min(1.02, hi + pad)], tickformat=".0%")


def hit_rate(frame: pl.DataFrame, belady: tuple[str, float] | None = None) -> go.Figure | None:
    """vLLM's prefix cache hit rate (the request hit rate) per window (solid) and cumulative
    (dashed), from read.hit_counters_over_time; the Belady bound as a level (label, rate)."""
    frame = frame.filter(pl.col("prefix_cache_queries") > 0).sort("window_start_ns")
    if frame.height == 0:
        return None
    fig = _fig("Prefix cache hit rate over time", time_axis(), "prefix cache hit rate")
    t = (frame["window_start_ns"] / NS).to_list()
    per, cum = frame["prefix_cache_hit_rate"].to_list(), frame["cum_prefix_cache_hit_rate"].to_list()
    fig.add_scatter(x=t, y=per, name="prefix cache hit rate (per window)", mode="lines", line=dict(color=_color(0)))
    fig.add_scatter(x=t, y=cum, name="prefix cache hit rate (cumulative)", mode="lines",
                    line=dict(color=_color(0), dash="dash", width=3))
    shown = [*per, *cum]
    if belady is not None:
        label, rate = belady
        fig.add_scatter(x=[t[0], t[-1]], y=[rate, rate], name=label, mode="lines", line=dict(color="black", dash="dot"))
        shown.append(rate)
    _fit_rates(fig, shown)
    return fig


def group_hit_rate(frame: pl.DataFrame, labels: dict[int, str]) -> go.Figure | None:
    """Each KV group's own hit rate (read.group_hit_rate_over_time) per window (solid) and
    cumulative (dashed): its own metric, charted apart from the request hit rate."""
    frame = frame.filter(pl.col("prefix_cache_queries") > 0)
    if frame.height == 0:
        return None
    fig = _fig("Group hit rates (each KV group alone; not the request hit rate)", time_axis(),
               "group hit rate")
    for i, (gid,) in enumerate(frame.select("group_id").unique().sort("group_id").iter_rows()):
        part = frame.filter(pl.col("group_id") == gid).sort("window_start_ns")
        t = (part["window_start_ns"] / NS).to_list()
        name = labels.get(gid, f"group {gid}: group hit rate")
        fig.add_scatter(x=t, y=part["group_hit_rate"].to_list(), name=f"{name} (per window)", mode="lines",
                        line=dict(color=_color(i + 1)))
        fig.add_scatter(x=t, y=part["cum_group_hit_rate"].to_list(), name=f"{name} (cumulative)", mode="lines",
                        line=dict(color=_color(i + 1), dash="dash"))
    _fit_rates(fig, [*frame["group_hit_rate"].to_list(), *frame["cum_group_hit_rate"].to_list()])
    return fig


# vLLM's prompt_tokens_by_source labels, as the legend says them
SOURCE_NAMES = {"local_cache_hit": "local cache hit", "external_kv_transfer": "external KV transfer",
                "local_compute": "local compute"}


def hit_sources(frame: pl.DataFrame) -> go.Figure | None:
    """Prompt tokens per window by where they came from (vLLM's prompt_tokens_by_source),
    each request once, at its first schedule; stacked."""
    if frame.height == 0:
        return None
    fig = _fig("Prompt tokens by source", time_axis(), "prompt tokens per window")
    t = (frame["window_start_ns"] / NS).to_list()
    for i, (source, name) in enumerate(SOURCE_NAMES.items()):
        fig.add_scatter(x=t, y=frame[f"prompt_tokens_by_source.{source}"].to_list(), name=name, mode="lines",
                        stackgroup="tokens", line=dict(color=_color(i)))
    return fig


def usage(frame: pl.DataFrame, group_names: dict[int, str], shared_pool: bool = False) -> go.Figure | None:
    """Mean and max block-pool usage per KV group per window: each group's share of the
    pool it allocates from. With one pool shared by the groups (``shared_pool``) their
    mean shares also add up to the pool's mean usage, drawn as one more line."""
    if frame.height == 0:
        return None
    fig = _fig("Block-pool usage", time_axis(), "usage")
    groups = frame.select("group_id").unique().sort("group_id")
    if shared_pool and groups.height > 1:
        pool = frame.group_by("window_start_ns").agg(pl.col("mean_usage").sum()).sort("window_start_ns")
        fig.add_scatter(x=(pool["window_start_ns"] / NS).to_list(), y=pool["mean_usage"].to_list(),
                        name="pool (all groups) mean", mode="lines", line=dict(color="#444444", width=3))
    for i, (gid,) in enumerate(groups.iter_rows()):
        part = frame.filter(pl.col("group_id") == gid).sort("window_start_ns")
        t = (part["window_start_ns"] / NS).to_list()
        name = group_names.get(gid, f"group {gid}")
        fig.add_scatter(x=t, y=part["mean_usage"].to_list(), name=f"{name} mean", mode="lines",
                        line=dict(color=_color(i)))
        fig.add_scatter(x=t, y=part["max_usage"].to_list(), name=f"{name} max", mode="lines",
                        line=dict(color=_color(i), dash="dot"))
    top = float(frame.select(pl.col("max_usage").max()).item() or 0.0)
    if shared_pool and groups.height > 1:
        pool_mean = frame.group_by("window_start_ns").agg(pl.col("mean_usage").sum())
        top = max(top, float(pool_mean.select(pl.col("mean_usage").max()).item() or 0.0))
    # the axis follows the peak, so a lightly used pool stays visible
    fig.update_yaxes(range=[0, min(1.02, max(0.01, 1.1 * top))], tickformat=".1%" if top < 0.1 else ".0%")
    return fig


# One colour per eviction reason and per publish kind, on every chart.
REASON_COLORS = {"lru": "#4C78A8", "stale_hash": "#E45756", "replaced": "#F58518", "connector": "#72B7B2",
                 "reset": "#B279A2", "moved": "#FF9DA6", "vllm_removed": "#9D755D"}
KIND_COLORS = {"full": "#54A24B", "partial_tail": "#EECA3B", "checkpoint": "#FF9DA6", "boundary": "#8E6C8A",
               "moved": "#F58518", "vllm_stored": "#9D755D", "none": "#BAB0AC"}
# What a publish kind means on a chart; 'none': no publish took the evicted block before
# the miss (it went to request-local state or a block still filling)
KIND_NAMES = {
    "full": "full block published",
    "partial_tail": "partial tail published",
    "checkpoint": "checkpoint published",
    "boundary": "boundary published",
    "moved": "key moved to a copy",
    "vllm_stored": "vLLM BlockStored",
    "none": "no publish (block reused uncached)",
}
REASON_NAMES = {"lru": "LRU eviction", "stale_hash": "stale hash evicted", "replaced": "key replaced",
                "connector": "external tier dropped", "reset": "cache reset",
                "moved": "key moved to its copy", "vllm_removed": "vLLM BlockRemoved"}


def _key_color(key: str) -> str:
    return REASON_COLORS.get(key) or KIND_COLORS.get(key) or "#79706E"


def stacked_counts(frame: pl.DataFrame, title: str, y: str, names: dict[str, str] | None = None) -> go.Figure | None:
    """Blocks per window (columns window_start_ns, key, blocks), stacked by ``key``
    (evictions by reason or by publish kind), each key in its one colour."""
    if frame.height == 0:
        return None
    fig = _fig(title, time_axis(), y, barmode="stack", showlegend=True)
    for (k,) in frame.select("key").unique().sort("key").iter_rows():
        part = frame.filter(pl.col("key") == k).sort("window_start_ns")
        fig.add_bar(x=(part["window_start_ns"] / NS).to_list(), y=part["blocks"].to_list(),
                    name=(names or {}).get(str(k), str(k)), marker_color=_key_color(str(k)))
    return fig


def attribution_sankey(flows: pl.DataFrame, prefix_names: dict[str, str] | None = None) -> go.Figure | None:
    """publish kind -> eviction reason -> hot prefix, weighted by the later misses; nodes
    in the kind's and the reason's colours, prefixes by a short hash, first request and length."""
    if flows.height == 0:
        return None
    labels: list[str] = []
    colors: list[str] = []
    index: dict[str, int] = {}

    def node(text: str, color: str) -> int:
        if text not in index:
            index[text] = len(labels)
            labels.append(text)
            colors.append(color)
        return index[text]

    src, dst, val = [], [], []
    for kind, reason, prefix, misses in flows.select("publish_kind", "evict_reason", "prefix", "misses").iter_rows():
        kind, reason = str(kind or "none"), str(reason or "unknown")
        a = node(KIND_NAMES.get(kind, f"publish: {kind}"), KIND_COLORS.get(kind, "#79706E"))
        b = node(REASON_NAMES.get(reason, f"evict: {reason}"), REASON_COLORS.get(reason, "#79706E"))
        name = "other prefixes" if prefix == "other" else (prefix_names or {}).get(prefix, f"prefix {prefix[:8]}")
        c = node(name, "#BAB0AC")
        src += [a, b]
        dst += [b, c]
        val += [int(misses), int(misses)]
    fig = go.Figure(go.Sankey(node=dict(label=labels, color=colors, pad=14), link=dict(source=src, target=dst,
                                                                                       value=val),
                              name="attribution"))
    fig.update_layout(title="Which publishes evicted which hot prefixes (weighted by later misses)",
                      margin=dict(t=70))
    return fig


def histograms(frame: pl.DataFrame, metrics: Sequence[tuple[str, str]],
               unit: str = "scheduler steps") -> go.Figure | None:
    """One panel per metric (their ranges differ by orders of magnitude) from
    (metric, bin_lo, bin_hi, count) rows; the panel titles are the only titles (a figure
    title above them would overlap). ``unit``: what the values count (the x axes' title)."""
    present = [(m, name) for m, name in metrics if frame.filter(pl.col("metric") == m).height]
    if not present:
        return None
    fig = make_subplots(rows=1, cols=len(present), subplot_titles=[name for _, name in present])
    for i, (metric, name) in enumerate(present):
        part = frame.filter(pl.col("metric") == metric).sort("bin_lo")
        mid = ((part["bin_lo"] + part["bin_hi"]) / 2).to_list()
        width = (part["bin_hi"] - part["bin_lo"]).to_list()
        fig.add_bar(x=mid, y=part["count"].to_list(), width=width, name=name, marker_color=_color(i), row=1, col=i + 1)
        fig.update_xaxes(title_text=unit, row=1, col=i + 1)
    fig.update_yaxes(title_text="blocks", row=1, col=1)
    fig.update_layout(showlegend=False, margin=dict(t=60))
    return fig


def correctness(frame: pl.DataFrame) -> go.Figure | None:
    """Stale hashes found, stale entries left, divergent outputs per window."""
    if frame.height == 0:
        return None
    fig = _fig("Stale hashes and divergent outputs", time_axis(), "count per window", barmode="group")
    t = (frame["window_start_ns"] / NS).to_list()
    series = (("stale_found", "stale hash found"), ("stale_left", "stale entry left"),
              ("divergent_outputs", "divergent output"))
    for i, (col, name) in enumerate(series):
        fig.add_bar(x=t, y=frame[col].to_list(), name=name, marker_color=_color(i + 3))
    return fig


def cdf(curves: Sequence[tuple[str, pl.DataFrame]], title: str, log: bool = False,
        times: str = MODELLED) -> go.Figure | None:
    """CDFs from read.latency_cdf frames (q in percent, value_ns) in ms; ``times``: the
    runs' ``queries.times_word`` ('recorded' for a collected run's times)."""
    fig = _fig(title, f"ms ({times})", "fraction ≤ x")
    for i, (name, frame) in enumerate(curves):
        if frame.height:
            fig.add_scatter(x=(frame["value_ns"] / MS).to_list(), y=(frame["q"] / 100).to_list(), name=name,
                            mode="lines", line=dict(color=_color(i), dash=("solid", "dash")[i % 2]))
    fig.update_layout(hovermode="closest")
    if log:
        fig.update_xaxes(type="log")
    return fig if fig.data else None


def latency_hist(frame: pl.DataFrame, title: str, name: str, log: bool = False,
                 times: str = MODELLED) -> go.Figure | None:
    if frame.height == 0:
        return None
    fig = _fig(title, f"ms ({times})", "count")
    mid = (((frame["bin_lo"] + frame["bin_hi"]) / 2) / MS).to_list()
    width = ((frame["bin_hi"] - frame["bin_lo"]) / MS).to_list()
    fig.add_bar(x=mid, y=frame["count"].to_list(), width=width, name=name, marker_color=_color(0))
    if log:
        fig.update_yaxes(type="log")
    return fig


def itl_over_time(frame: pl.DataFrame, log: bool = False, times: str = MODELLED) -> go.Figure | None:
    """ITL per window of token time (read.itl_over_time): mean, p50, p99 of the window's gaps."""
    if frame.height == 0:
        return None
    fig = _fig("ITL over time", time_axis(), f"ms ({times})")
    t = (frame["window_start_ns"] / NS).to_list()
    series = (("mean_itl_ns", "mean ITL"), ("p50_itl_ns", "p50 ITL"), ("p99_itl_ns", "p99 ITL"))
    for i, (col, name) in enumerate(series):
        if col in frame.columns:
            fig.add_scatter(x=t, y=(frame[col] / MS).to_list(), name=name, mode="lines", line=dict(color=_color(i)))
    if log:
        fig.update_yaxes(type="log")
    return fig


def percentile_bars(rows: Sequence[tuple[str, float | None, float | None]], title: str) -> go.Figure | None:
    """A and B side by side per percentile (name, a, b), in ms of modelled time."""
    rows = [r for r in rows if r[1] is not None or r[2] is not None]
    if not rows:
        return None
    fig = _fig(title, "", "ms (modelled)", barmode="group")
    names = [r[0] for r in rows]
    fig.add_bar(x=names, y=[r[1] for r in rows], name="A", marker_color=_color(0))
    fig.add_bar(x=names, y=[r[2] for r in rows], name="B", marker_color=_color(1))
    return fig


_SEGMENT_COLORS = {"queue": "#BAB0AC", "prefill": "#4C78A8", "decode": "#54A24B"}
_MARKS = {"cache_hit": ("star", "#F58518"), "load": ("triangle-up", "#72B7B2"), "cow": ("diamond", "#B279A2"),
          "evict": ("x", "#E45756")}


def waterfall(frame: pl.DataFrame, request_id: str) -> go.Figure | None:
    """Queue, prefill chunks and decode as bars on a time axis; cache events as marks. A
    segment whose start or end a sender left out (a collected span) is not drawn."""
    frame = frame.filter(pl.col("start_ns").is_not_null())
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
    fig = _fig(title, time_axis(), ytitle)
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
    """Per-request cached-token difference B - A, coloured by sign: one bar per request, or,
    past MAX_REQUEST_BARS requests, a histogram of the differences (bars would not be legible)."""
    if diff.height == 0:
        return None
    if diff.height > MAX_REQUEST_BARS:
        fig = _fig(f"Per-request cached-token difference (B − A), {diff.height:,} requests", "cached tokens B − A",
                   "requests")
        hist = diff["cached_delta"].cast(pl.Float64).hist(bin_count=80, include_category=False)
        width = hist["breakpoint"].diff().fill_null(strategy="backward")
        mid = hist["breakpoint"] - width / 2
        fig.add_bar(x=mid.to_list(), y=hist["count"].to_list(), width=width.to_list(), name="cached tokens B − A",
                    marker_color=["#54A24B" if v > 0 else "#E45756" if v < 0 else "#BAB0AC" for v in mid.to_list()])
        fig.update_yaxes(type="log")
        fig.update_layout(hovermode="closest")
        return fig
    d = diff["cached_delta"].to_list()
    fig = _fig("Per-request cached-token difference (B − A)", "request", "cached tokens B − A")
    fig.add_bar(x=diff["request_id"].to_list(), y=d, name="cached tokens B − A",
                marker_color=["#54A24B" if v > 0 else "#E45756" if v < 0 else "#BAB0AC" for v in d])
    fig.update_layout(hovermode="closest")
    return fig


def capacity_curve(points: pl.DataFrame, marks: Sequence[tuple[str, float, float, bool]]) -> go.Figure | None:
    """Token hit rate against capacity (blocks, log axis), one line per policy, the
    unbounded cache as a level; ``marks``: (label, capacity, hit rate, is the selected run)."""
    bounded = points.filter(pl.col("capacity_blocks").is_not_null())
    if bounded.height == 0:
        return None
    fig = _fig("Prefix cache hit rate against capacity", "capacity (blocks, log scale)", "prefix cache hit rate")
    names = {"lru": "LRU", "belady": "Belady bound (MIN)"}
    for i, policy in enumerate(("lru", "belady")):
        part = bounded.filter(pl.col("policy") == policy).sort("capacity_blocks")
        if part.height:
            fig.add_scatter(x=part["capacity_blocks"].to_list(), y=part["prefix_cache_hit_rate"].to_list(),
                            name=names[policy], mode="lines+markers",
                            line=dict(color=_color(i), dash="solid" if policy == "lru" else "dot"))
    unbounded = points.filter(pl.col("capacity_blocks").is_null())
    if unbounded.height:
        rate = float(unbounded["prefix_cache_hit_rate"][0])
        xs = bounded["capacity_blocks"]
        fig.add_scatter(x=[xs.min(), xs.max()], y=[rate, rate], name="unbounded cache", mode="lines",
                        line=dict(color="black", dash="dash"))
    for label, x, y, selected in marks:
        fig.add_scatter(x=[x], y=[y], name=label, mode="markers+text", text=[label], textposition="top center",
                        marker=dict(size=14 if selected else 9, symbol="diamond" if selected else "circle",
                                    color="#E45756" if selected else "#9D755D"))
    top = float(bounded["prefix_cache_hit_rate"].fill_null(0.0).max() or 0.0)  # type: ignore[arg-type]
    fig.update_xaxes(type="log")
    fig.update_yaxes(range=[0, min(1.02, max(0.05, 1.15 * max([top, *(m[2] for m in marks)])))], tickformat=".0%")
    return fig
