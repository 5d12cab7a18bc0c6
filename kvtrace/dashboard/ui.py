"""Small rendering helpers shared by the pages: charts with captions, empty states, numbers."""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable
from typing import Any

import plotly.graph_objects as go
import polars as pl
import streamlit as st

from kvtrace import metrics
from kvtrace.names import markdown_code, markdown_literal, plotly_literal, printable

FILL_RUN = "`kvtrace demo`, or `kvtrace replay TRACE --db PATH`"
FILL_SMALL_CACHE = ("a run whose cache is smaller than its working set, e.g. "
                    "`kvtrace replay TRACE --db PATH --capacity-blocks 256`")


def fill_to_its_end(status: object) -> str:
    """What fills a page an unfinished run leaves empty: the same replay run to its end, or,
    where it failed (deterministic, so the same replay fails again), one it can finish."""
    if status == "failed":
        return "a replay of the same trace with settings it can finish (this one failed: Overview says why)"
    return "the same replay run to its end"


def fill_belady(blocks: int, block_size: int) -> str:
    """The replay that records a Belady bound of ``blocks`` blocks of ``block_size`` tokens."""
    return (f"`kvtrace replay TRACE --db PATH --mode cache-only --policy belady "
            f"--capacity-blocks {blocks} --block-size {block_size}`")


# What Streamlit's markdown (1.67, StreamlitMarkdown) rewrites in text however it was
# escaped, since it works on the parsed text: ':streamlit:' becomes its logo (an image),
# ':material_NAME:' an icon, a ':NAME:' an emoji wherever the element's source holds a
# shortcode (a code span's, say), and a standalone '->', '<-', '<->', '--', '>=', '<=' or
# '~=' an arrow or sign. A word joiner (U+2060, zero width) after the first character of
# each keeps the text as typed.
_SHORTCODE = re.compile(r"(?<=:)(?=[\w+-]+:)")
_SIGN = re.compile(r"(?:^|(?<=\s))(?:<->|->|<-|--|>=|<=|~=)(?=\s|$)")
_JOINER = "\u2060"
# Before parsing, Streamlit replaces ':material/' with ':material_' everywhere, code spans included.
_MATERIAL = ":material/"


def literal(text: object) -> str:
    """A user's or a sender's text (a run's name, an id, a link's value) inside Streamlit
    markdown, shown as typed: ``names.markdown_literal``, and none of what Streamlit's
    markdown rewrites after parsing (above). Every page's text goes through here or ``code``."""
    text = printable(text)
    cuts = sorted({m.start() for m in _SHORTCODE.finditer(text)} | {m.start() + 1 for m in _SIGN.finditer(text)})
    if not cuts:
        return markdown_literal(text)
    bounds = [0, *cuts, len(text)]
    return _JOINER.join(markdown_literal(text[a:b]) for a, b in itertools.pairwise(bounds))


def strong(text: object) -> str:
    """The text in bold, as typed (``literal``). CommonMark opens and closes ``**`` only
    next to a character that is no space: a name with a space at an end, or of spaces
    alone, was shown with its asterisks ('** **'); a word joiner (zero width) stands
    between them then."""
    shown = literal(text)
    if shown[:1].isspace() or shown[-1:].isspace():
        shown = f"{_JOINER}{shown}{_JOINER}"
    return f"**{shown}**"


def code(text: object) -> str:
    """The text as one inline code span (``names.markdown_code``: ids, paths, commands to
    paste), which Streamlit shows as typed unless it holds ':material/': that one as
    ``literal`` text instead."""
    return literal(text) if _MATERIAL in printable(text) else markdown_code(text)


def empty(what: str, command: str | None = FILL_RUN) -> None:
    """The empty state: what is missing and which command fills it (never a blank chart);
    None: no command fills it (a time window that leaves the run's data out)."""
    st.info(what if command is None else f"{what} Fill it with {command}.", icon=":material/info:")


def chart(fig: go.Figure | None, caption: str, *, empty_what: str, command: str | None = FILL_RUN,
          key: str | None = None) -> None:
    """A plotly chart with its one-line caption, or the empty state when there is nothing to plot."""
    if fig is None or not fig.data:
        empty(empty_what, command)
        return
    fig.update_layout(margin=dict(l=10, r=10, t=40, b=10), legend=dict(orientation="h", y=-0.2))
    st.plotly_chart(literal_text(fig), width="stretch", key=key)
    st.caption(caption)


_TRACE_TEXT = ("name", "text", "hovertext", "x", "y")  # the trace fields that may hold strings plotly draws


def _literal(value: Any) -> Any:
    if isinstance(value, str):
        return plotly_literal(value)
    if isinstance(value, (list, tuple)) and any(isinstance(v, str) for v in value):
        return [plotly_literal(v) if isinstance(v, str) else v for v in value]
    return value


def literal_text(fig: go.Figure) -> go.Figure:
    """``fig`` with every string it draws shown as text (``names.plotly_literal``): run
    names, run and request ids, group names and a sender's reasons reach legends, labels,
    categories, Sankey nodes and titles, and no chart draws markup of its own."""
    for trace in fig.data:
        for field in _TRACE_TEXT:
            if field in trace:
                value = trace[field]
                escaped = _literal(value)
                if escaped is not value:
                    trace[field] = escaped
        if trace.type == "sankey" and trace.node.label:  # its node names: prefixes' first request ids
            trace.node.label = _literal(trace.node.label)
    layout = fig.layout
    if layout.title.text:
        layout.title.text = plotly_literal(layout.title.text)
    fig.for_each_xaxis(lambda a: a.update(title_text=_literal(a.title.text)) if a.title.text else None)
    fig.for_each_yaxis(lambda a: a.update(title_text=_literal(a.title.text)) if a.title.text else None)
    for note in layout.annotations:
        note.text = _literal(note.text)
    return fig


def table(frame: pl.DataFrame | None, caption: str, *, empty_what: str, command: str | None = FILL_RUN,
          column_config: dict[str, Any] | None = None) -> None:
    if frame is None or frame.height == 0:
        empty(empty_what, command)
        return
    st.dataframe(frame, width="stretch", hide_index=True, height="auto", column_config=column_config)
    st.caption(caption)


def summary_columns(keys: Iterable[str]) -> dict[str, Any]:
    """How a table shows summary keys, in the tiles' units: a rate as a percentage, a latency
    in ms, a count with thousands separators (the values stay the summary's, for sorting)."""
    def column(key: str) -> Any:
        if key.endswith("_rate"):
            return st.column_config.NumberColumn(format="percent")
        return st.column_config.NumberColumn(format="%.1f ms" if key.endswith("_ms") else "localized")
    return {k: column(k) for k in keys}


def short_hash(h: Any) -> str:
    """The first 8 hex digits of a block hash (the whole thing lives in tables and tooltips),
    past its leading zeros when those are all 8: a cache-only run's keys are its trace's hash
    ids (0000000000000036), and every one of them read 00000000."""
    if h is None:
        return "–"
    text = str(h)
    return text[:8] if text[:8].strip("0") else text.lstrip("0")[:8] or "0"


def fingerprint(fp: Any) -> str:
    """A content fingerprint, one format everywhere: 16 hex digits, 0x-prefixed."""
    return "–" if fp is None else f"{int(fp) & (2**64 - 1):#018x}"


def pp(delta: Any) -> str:
    """A change of a rate in signed percentage points, as every view shows one
    (``metrics.points_text``): '+3.9 pp', '-3.9e-05 pp'; no change '0.0 pp'."""
    if not _finite(delta) or not _finite(100.0 * float(delta)):  # (a damaged 1e308 is no rate either)
        return "–"
    text = metrics.points_text(float(delta), 1)
    return "0.0 pp" if text == "+0.0 pp" else text


def pct(x: Any) -> str:
    # (16 hit tokens in 416,000 read 0.0% beside them: metrics.percent_text keeps their digits)
    return "–" if not _finite(x) or not _finite(100.0 * float(x)) else metrics.percent_text(float(x), 1)


def ms(x: Any) -> str:
    # (with thousands separators, as every count beside it and diff's times: a tile read "3209.0 ms")
    return "–" if not _finite(x) else f"{float(x):,.1f} ms"


def count(x: Any) -> str:
    return "–" if not _finite(x) else f"{int(x):,}"


def _finite(x: Any) -> bool:
    try:
        return x is not None and math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def run_label(row: dict[str, Any]) -> str:
    """``name · mode · behaviours-off · status`` for a run picker."""
    name = row.get("name") or row.get("run_id")
    off = row.get("behaviours_off") or ""
    bits = [str(name), str(row.get("mode") or "")]
    if not row.get("damage") and (row.get("mode") == "engine" or row.get("behaviours_on") or off):  # (has_behaviours)
        bits.append(f"without {off}" if off else "all behaviours")
    status = row.get("status")
    if status and status != "complete":
        bits.append(str(status).upper())
    if row.get("nothing_received"):  # store.schema.SUMMARY_NOTHING_RECEIVED, flattened by queries
        bits.append("NOTHING RECEIVED")
    return " · ".join(b for b in bits if b)
