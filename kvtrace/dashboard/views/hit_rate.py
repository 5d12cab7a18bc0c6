"""Hit rate: windowed and cumulative per group, hit-token sources, pool usage, Belady bound."""

import streamlit as st

from kvtrace.dashboard import charts, queries, state, ui

ctx = queries.context()
run_id = ctx["run_id"]
names = queries.group_names(run_id)

st.title("Hit rate")
rates = queries.call("hit_rate_over_time", run_id, window_ns=queries.window_ns(run_id))
groups = sorted(rates["group_id"].unique().to_list()) if rates.height else [queries.GROUP_ALL]
c1, c2 = st.columns([1, 2])
with c1:
    group = state.bound_select("KV group", ["each"] + groups, "group", default="each",
                               format_func=lambda g: "every group" if g == "each" else names.get(g, f"group {g}"))
with c2:
    window = state.bound_window("Virtual time window", queries.time_extent_s(run_id))

shown = rates if group == "each" else rates.filter(rates["group_id"] == group)
bel = queries.belady_run(run_id)
bel_frame, bel_rate = None, None
if bel is not None:
    # A cache-only Belady run may store only its summary (no spans): then draw its whole-run rate.
    bel_frame = queries.call("hit_rate_over_time", bel["run_id"], window_ns=queries.window_ns(bel["run_id"]), group=queries.GROUP_ALL)
    bel_frame = state.in_window(bel_frame, "window_start_ns", window)
    cap = (queries.config(bel["run_id"]) or {}).get("capacity_blocks")
    rate = queries.summary(bel["run_id"]).get("token_hit_rate")
    if isinstance(rate, (int, float)):
        bel_rate = (f"Belady bound ({bel['name']}" + (f", {cap} blocks" if cap else "") + ")", float(rate))
ui.chart(
    charts.hit_rate(state.in_window(shown, "window_start_ns", window), names, bel_frame, bel_rate),
    "Token hit rate per time window (solid) and cumulative since the start (dashed), per KV group; 'all groups' is the hybrid coordinator's fixed point"
    + ("; dotted: the Belady (offline-optimal) bound from the cache-only run of the same trace." if bel is not None else "."),
    empty_what="No lookup spans in this run, so there is no hit rate to plot.", key="hit_rate",
)
if bel is None:
    st.caption(f"No Belady bound: add one with {ui.FILL_CACHE_ONLY} on the same trace.")

ui.chart(
    charts.hit_sources(state.in_window(queries.call("hit_token_sources", run_id, window_ns=queries.window_ns(run_id)), "window_start_ns", window)),
    "Prompt tokens per window served from the local prefix cache, loaded from the external tier, or computed (stacked).",
    empty_what="No lookup spans in this run, so no hit-token sources.", key="hit_sources",
)
ui.chart(
    charts.usage(state.in_window(queries.call("usage_over_time", run_id, window_ns=queries.window_ns(run_id)), "window_start_ns", window), names),
    "Block-pool usage per KV group: mean (solid) and max (dotted) per window of scheduler steps.",
    empty_what="No engine step spans in this run (cache-only runs have none), so no pool usage.",
    command="`kvtrace replay TRACE --db PATH` in engine mode", key="usage",
)

st.subheader("Hottest prefixes")
ui.table(queries.call("per_prefix_reuse", run_id, top=20),
         "The 20 most looked-up prefix families (root hash of the first full block): lookups, lookups that hit or missed, hit tokens and rate.",
         empty_what="No lookup spans in this run, so no prefix reuse.")
