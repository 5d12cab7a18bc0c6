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
    group = state.bound_select("KV group", ["each", *groups], "group", default="each",
                               format_func=lambda g: "every group" if g == "each" else names.get(int(g), f"group {g}"))
with c2:
    window = state.bound_window("Virtual time window", queries.time_extent_s(run_id))

shown = rates if group == "each" else rates.filter(rates["group_id"] == group)
bound = queries.belady_bound(run_id)
bel = bound.run
bel_frame, bel_rate = None, None
if bel is not None:
    # A Belady run has a curve when it stored lookup spans; otherwise the chart draws its
    # whole-run rate (from the summary) as a level.
    bel_frame = queries.call("hit_rate_over_time", bel["run_id"], window_ns=queries.window_ns(bel["run_id"]),
                             group=queries.GROUP_ALL)
    bel_frame = state.in_window(bel_frame, "window_start_ns", window)
    rate = queries.summary(bel["run_id"]).get("prefix_cache_hit_rate")
    if isinstance(rate, (int, float)):
        bel_rate = (f"Belady bound ({bel['name']}, {bound.capacity})", float(rate))
ui.chart(
    charts.hit_rate(state.in_window(shown, "window_start_ns", window), names, bel_frame, bel_rate),
    "Token hit rate per time window (solid) and cumulative since the start (dashed), per KV group; "
    "'all groups' is the hybrid coordinator's fixed point"
    + ("; dotted: the Belady (offline-optimal) bound from the cache-only run of the same trace and capacity."
       if bel is not None else "."),
    empty_what="No lookup spans in this run, so there is no hit rate to plot.", key="hit_rate",
)
if bel is None and bound.capacity is None:
    st.caption("No Belady bound: this run's config stores no prefix-cache capacity (capacity_blocks and "
               "block_size, or cache.num_gpu_blocks and cache.groups) to match one against.")
elif bel is None and bound.capacity is not None:
    cap = bound.capacity
    seen = ", ".join(dict.fromkeys(str(c) if c else "no stored capacity" for c in bound.others))
    st.caption(f"No Belady bound at this run's capacity ({cap})"
               + (f"; this trace's Belady runs have {seen}" if seen else "")
               + f". Add one on the same trace with {ui.fill_belady(cap.blocks, cap.block_size)}.")

ui.chart(
    charts.hit_sources(state.in_window(queries.call("hit_token_sources", run_id, window_ns=queries.window_ns(run_id)),
                                       "window_start_ns", window)),
    "Prompt tokens per window served from the local prefix cache, loaded from the external tier, or computed "
    "(stacked).",
    empty_what="No lookup spans in this run, so no hit-token sources.", key="hit_sources",
)
ui.chart(
    charts.usage(state.in_window(queries.call("usage_over_time", run_id, window_ns=queries.window_ns(run_id)),
                                 "window_start_ns", window), names),
    "Block-pool usage per KV group: mean (solid) and max (dotted) per window of scheduler steps.",
    empty_what="No engine step spans in this run (cache-only runs have none), so no pool usage.",
    command="`kvtrace replay TRACE --db PATH` in engine mode", key="usage",
)

st.subheader("Hottest prefixes")
ui.table(queries.call("per_prefix_reuse", run_id, top=20),
         "The 20 most looked-up prefix families (root hash of the first full block): lookups, lookups that hit or "
         "missed, hit tokens and rate.",
         empty_what="No lookup spans in this run, so no prefix reuse.")
