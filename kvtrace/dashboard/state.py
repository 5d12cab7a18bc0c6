"""Where the app's inputs come from: the database path, the refresh token, and filters
bound to the URL's query parameters (so any view is a shareable link)."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import polars as pl
import streamlit as st

from kvtrace.dashboard import DB_ENV, ui
from kvtrace.names import printable

REFRESH_KEY = "kvtrace_refresh"
T = TypeVar("T")


def db_path() -> str | None:
    """``streamlit run app.py -- --db PATH`` wins; else the DB_ENV (KVTRACE_DB) environment variable."""
    if Path(sys.argv[0]).name == "app.py":
        parser = argparse.ArgumentParser(add_help=False)
        parser.add_argument("--db")
        args, _ = parser.parse_known_args(sys.argv[1:])
        if args.db:
            return args.db
    return os.environ.get(DB_ENV) or None


def shown_db(db: str) -> str:
    """``db`` as a page may show it: a ClickHouse server URL without its password (the
    form every store error prints), anything else as given."""
    from kvtrace.errors import KVTraceError
    from kvtrace.store.backend import CHDB_PREFIX, clickhouse_target, is_clickhouse

    if not is_clickhouse(db) or db.startswith(CHDB_PREFIX):
        return db
    try:
        return clickhouse_target(db).label
    except KVTraceError:  # malformed: its scheme alone (the store's own error says the rest)
        return db.split("://", 1)[0] + "://…"


def refresh_token() -> int:
    """Part of every cache key: bumping it makes every query re-read the store."""
    return int(st.session_state.get(REFRESH_KEY, 0))


def bump_refresh() -> None:
    st.session_state[REFRESH_KEY] = refresh_token() + 1


def shared_params() -> dict[str, str]:
    """The current filters, to carry over when linking to another page."""
    return {k: st.query_params[k] for k in st.query_params}


def bound_select(
    label: str,
    options: Sequence[T],
    param: str,
    *,
    default: T | None = None,
    format_func: Callable[[T], str] = str,
    help: str | None = None,
    unknown: str = "first",
    placeholder: str = "Choose an option",
) -> T | None:
    """A selectbox whose value lives in ``?param=``; options are matched by ``str(option)``.

    Without ``?param=`` it shows ``default`` (else the first option; with ``unknown="none"``
    and no default: nothing until the user picks). A ``?param=`` naming no option is
    replaced by that choice, unless ``unknown="none"``: then nothing is selected, the link's
    value stays in the URL, and None comes back, so the caller can say which value was not
    found instead of showing another one (see ``unknown_value``)."""
    if not options:
        if unknown != "none":
            st.query_params.pop(param, None)
        return None
    by_text = {str(o): o for o in options}
    # a picker's labels are plain text, where a newline or other control character in a run's
    # name, a request id or a path was dropped ("two\nlines" read "twolines"): shown as its
    # escape, as every other view shows it (and before _distinct, which compares what is shown)
    shown = format_func
    format_func = _distinct(options, lambda o: printable(shown(o)))
    key = f"qp_{param}"
    if key in st.session_state and st.session_state[key] is not None and str(st.session_state[key]) not in by_text:
        del st.session_state[key]  # the option vanished (e.g. another run picked)
    wanted = st.query_params.get(param)
    chosen = by_text.get(wanted) if wanted is not None else None
    picked = st.session_state.get(key)
    if chosen is None and picked is None and unknown == "none" and (wanted is not None or default is None):
        value = st.selectbox(label, list(options), index=None, key=key, format_func=format_func, help=help,
                             placeholder=placeholder)
        if value is None:
            return None
    else:
        if chosen is None:
            chosen = default if default is not None and default in options else options[0]
        value = st.selectbox(label, list(options), index=list(options).index(chosen), key=key,
                             format_func=format_func, help=help)
    st.query_params[param] = str(value)
    return value


# The filters that name something of one run (B to compare with, a request, a stale hash,
# a KV group, a time window); ?curve= names the store's, ?log= is a preference.
RUN_FILTERS = ("b", "request", "stale", "group", "t0", "t1")
_LAST_RUN_KEY = "kvtrace_last_run"


def forget_other_runs_filters(run_id: str) -> None:
    """When the user picks another run in this session, drop RUN_FILTERS (from the URL and
    their widgets): kept, the next run's pages said the last run's request, B or window was
    "from the link" and not in this run. A link opened is a session of its own: its filters
    are its run's."""
    last = st.session_state.get(_LAST_RUN_KEY)
    st.session_state[_LAST_RUN_KEY] = run_id
    if last is None or last == run_id:
        return
    for param in RUN_FILTERS:
        st.query_params.pop(param, None)
        st.session_state.pop(f"qp_{param}", None)
    st.session_state.pop("qp_window", None)  # (t0 and t1's slider)


def _distinct(options: Sequence[T], format_func: Callable[[T], str]) -> Callable[[T], str]:
    """``format_func`` with the option itself added to a label two options share: Streamlit
    keeps a selectbox's choice by its label, so of two runs labelled alike (a sweep's repeated
    names, two --limit replays of one trace) picking one showed the other."""
    shown = {str(o): format_func(o) for o in options}
    counts = Counter(shown.values())
    if all(n == 1 for n in counts.values()):
        return format_func
    labels = {k: v if counts[v] == 1 else f"{v} · {k}" for k, v in shown.items()}
    return lambda o: labels.get(str(o), format_func(o))  # pure, as Streamlit wants


def unknown_value(param: str, options: Sequence[object]) -> str | None:
    """The value of ``?param=`` when it names none of ``options`` (a link from another
    store, a deleted run), else None."""
    wanted = st.query_params.get(param)
    return wanted if wanted is not None and wanted not in {str(o) for o in options} else None


LINK_SHOWN = 120  # characters of a link's value a message quotes (a URL can carry 100,000)


def link_value(value: str) -> str:
    """A value from the URL as a message quotes it: ``ui.code``, its first LINK_SHOWN
    characters and its length when longer, '(empty)' when empty."""
    if not value:
        return "(empty)"
    if len(value) > LINK_SHOWN:
        return f"{ui.code(value[:LINK_SHOWN])}… ({len(value):,} characters)"
    return ui.code(value)


def warn_unknown(param: str, options: Sequence[object], what: str, instead: str, where: str = "this run") -> None:
    """A warning when ``?param=`` names none of ``options`` (``unknown_value``), before a
    ``bound_select`` replaces it: '{what} X from the link is not in {where}: {instead}'."""
    missing = unknown_value(param, options)
    if missing is not None:
        st.warning(f"{what} {link_value(missing)} from the link is not in {where}: {instead}",
                   icon=":material/link_off:")


def bound_toggle(label: str, param: str, *, help: str | None = None) -> bool:
    """A checkbox bound to ``?param=1`` (absent or 0: off); another value from a link is named
    and ignored, as every other linked value is (``?log=true`` turned the log scale off unsaid)."""
    text = st.query_params.get(param)
    if text is not None and text not in ("0", "1"):
        st.warning(f"{label} {param}={link_value(text)} from the link is not 1 (on) or 0 (off): ignored, it is off.",
                   icon=":material/link_off:")
    on = st.checkbox(label, value=text == "1", key=f"qp_{param}", help=help)
    if on:
        st.query_params[param] = "1"
    else:
        st.query_params.pop(param, None)
    return bool(on)


def bound_window(label: str, t_max_s: float) -> tuple[float, float]:
    """A virtual-time window [t0, t1] in seconds, bound to ``?t0=&t1=``."""
    t_max_s = float(t_max_s) if t_max_s and math.isfinite(t_max_s) and t_max_s > 0 else 1.0
    hi = _round_up(t_max_s)

    ignored: list[str] = []  # the link's values that are no number of seconds
    clamped: list[str] = []  # and those outside the run's 0 to hi s (a one-lookup run's t1=0.5 read 0.001 unsaid)

    def read(name: str, fallback: float) -> float:
        text = st.query_params.get(name)
        if text is None:
            return fallback
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        if not math.isfinite(v):
            ignored.append(f"{name}={link_value(text)}")
            return fallback
        kept = min(max(v, 0.0), hi)
        if kept != v:
            clamped.append(f"{name}={link_value(text)}")
        return kept

    t0, t1 = read("t0", 0.0), read("t1", hi)
    if ignored:
        st.warning(f"Time window {', '.join(ignored)} from the link is not a number of seconds: ignored.",
                   icon=":material/link_off:")
    if clamped and t1 > t0:  # (a window left empty by it: said below)
        st.warning(f"Time window {', '.join(clamped)} from the link is outside this run (0 to {hi:g} s): "
                   f"{t0:g} to {t1:g} s is shown.", icon=":material/link_off:")
    if t1 <= t0:
        if "t0" in st.query_params or "t1" in st.query_params:
            st.warning(f"The time window from the link holds nothing of this run (0 to {hi:g} s): the whole run is "
                       "shown.", icon=":material/link_off:")
        t0, t1 = 0.0, hi
    key = "qp_window"
    if key in st.session_state:
        lo_s, hi_s = st.session_state[key]
        if not (0.0 <= lo_s <= hi and 0.0 <= hi_s <= hi):
            del st.session_state[key]
    lo_v, hi_v = st.slider(label, 0.0, hi, (t0, t1), key=key, format="%.3f s")
    if (lo_v, hi_v) == (0.0, hi):
        st.query_params.pop("t0", None)
        st.query_params.pop("t1", None)
    else:
        st.query_params["t0"] = f"{lo_v:g}"
        st.query_params["t1"] = f"{hi_v:g}"
    return float(lo_v), float(hi_v)


def outside_window(whole: pl.DataFrame, shown: pl.DataFrame, window: tuple[float, float], what: str) -> str | None:
    """The empty state of a chart whose time window alone leaves out the run's ``what``
    (``shown``: ``whole`` in the window), else None: the run's own empty state ('No
    evictions in this run: the cache never filled') was said of a run with evictions."""
    if whole.height == 0 or shown.height:
        return None
    lo, hi = window
    return f"No {what} in the time window {lo:g} to {hi:g} s; this run has some outside it: widen the window."


def _round_up(x: float) -> float:
    """A tidy slider bound just above ``x``."""
    if x <= 0:
        return 1.0
    mag = 10 ** math.floor(math.log10(x))
    return math.ceil(x / mag * 10) / 10 * mag


def in_window(frame: pl.DataFrame, column: str, window: tuple[float, float], origin_ns: int = 0) -> pl.DataFrame:
    """Rows whose ``column`` (ns) falls in the [t0, t1] seconds window after ``origin_ns``
    (``queries.time_origin``: 0 for a replay), with ``column`` counted from that origin."""
    lo, hi = window
    since = pl.col(column) - origin_ns
    return frame.filter((since >= int(lo * 1e9)) & (since <= int(hi * 1e9))).with_columns(since)
