"""kvtrace dashboard entry point: ``streamlit run app.py -- --db PATH`` (or KVTRACE_DB).

The entry script is the frame around every page: it resolves the database, draws the
sidebar (refresh, run picker, links that keep the current filters) and runs the page.
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from kvtrace.dashboard import charts, queries, state, ui
from kvtrace.errors import KVTraceError
from kvtrace.names import shell_path

HERE = Path(__file__).parent
PAGES = [
    st.Page(str(HERE / "views" / "overview.py"), title="Overview", icon=":material/dashboard:", url_path="overview",
            default=True),
    st.Page(str(HERE / "views" / "hit_rate.py"), title="Hit rate", icon=":material/target:", url_path="hit-rate"),
    st.Page(str(HERE / "views" / "evictions.py"), title="Evictions", icon=":material/delete_sweep:",
            url_path="evictions"),
    st.Page(str(HERE / "views" / "stale.py"), title="Stale hashes & correctness", icon=":material/report:",
            url_path="stale"),
    st.Page(str(HERE / "views" / "latency.py"), title="Latency", icon=":material/timer:", url_path="latency"),
    CAPACITY := st.Page(str(HERE / "views" / "capacity.py"), title="Capacity", icon=":material/stacked_line_chart:",
                        url_path="capacity"),
    st.Page(str(HERE / "views" / "compare.py"), title="Compare", icon=":material/compare_arrows:", url_path="compare"),
]

st.set_page_config(page_title="kvtrace", page_icon=":material/memory:", layout="wide")
page = st.navigation(PAGES, position="hidden")  # our own links below carry the filters
# (page files live in views/, not pages/: a pages/ folder beside the entry script switches
# Streamlit to its legacy directory mode, which runs a page without this frame)

with st.sidebar:
    st.markdown("### kvtrace")
    nav = st.container()  # filled after the page ran, so links carry the filters it set
    st.divider()
    db = state.db_path()
    shown = state.shown_db(db) if db else ""  # (a server URL's password is never shown)
    st.caption(f"database: {ui.code(shown)}" if shown else "database: none")
    if st.button("Refresh", icon=":material/refresh:", help="Re-read the store (a replay may still be writing it)"):
        state.bump_refresh()


def run_page(said: str | None = None) -> None:
    """The page, its errors shown in one line (``said``: one already shown above it)."""
    try:
        page.run()
    except KVTraceError as err:  # the store's one-line user errors
        if str(err) != said:
            st.error(ui.literal(err))
    except Exception as err:  # never a traceback in the browser; the tests assert no st.error
        first = str(err).splitlines()[0] if str(err) else ""
        st.error(ui.literal(f"{shown}: this page could not read the store ({type(err).__name__}: {first}).")
                 + " Press Refresh; if it persists, the store may come from another kvtrace version.")


if queries.open_store(db):
    frame = queries.runs()
    ids = frame["run_id"].to_list()
    missing = state.unknown_value("run", ids)
    with st.sidebar:
        labels = dict(zip(frame["run_id"], frame["label"]))  # a plain dict: format_func must be pure
        run_id = state.bound_select("Run", ids, "run", default=ids[0], format_func=lambda r: labels.get(r, r),
                                    help="name · mode · behaviours · status", unknown="none",
                                    placeholder="pick a run")
    if run_id is None:
        # A link names a run this store does not hold (pasted into another database, or the
        # run is gone): say so; showing another run in its place would mislead.
        st.title("Run not found")
        runs_command = ui.code(f"kvtrace runs --db {shell_path(shown)}")  # (a command to paste)
        st.warning(f"Run {state.link_value(missing or '')} from the link is not in {ui.code(shown)}: nothing is "
                   f"shown in its place. Pick a run in the sidebar, or list them with {runs_command}.",
                   icon=":material/link_off:")
    else:
        state.forget_other_runs_filters(run_id)
        queries.context()["run_id"] = run_id
        charts.set_time_axis(queries.time_axis(run_id))
        damage = queries.run_row(run_id).get("damage")
        if damage:  # (listed as damaged in the picker; every page says why, as `kvtrace runs` does)
            st.warning(ui.literal(damage) + ". Its stored settings and summary are not read: a page shows what its "
                                            "spans hold, where it can.", icon=":material/warning:")
        run_page(said=damage)
elif db and queries.curves_only():  # capacity curves without runs: the Capacity page is what there is to see
    queries.context()["run_id"] = None
    if page.url_path == CAPACITY.url_path:
        run_page()
    else:
        st.page_link(CAPACITY, label="This store holds capacity curves and no runs yet: see them on the Capacity "
                                     "page.", icon=":material/stacked_line_chart:", query_params=state.shared_params())

with nav:
    params = state.shared_params()
    for p in PAGES:
        st.page_link(p, query_params=params)
