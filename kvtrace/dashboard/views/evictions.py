"""Evictions: by reason and by the publish that forced them, attribution, block histograms."""

import polars as pl
import streamlit as st

from kvtrace.dashboard import charts, queries, state, ui

ctx = queries.context()
run_id = ctx["run_id"]

st.title("Evictions")
window = state.bound_window(queries.window_label(run_id), queries.time_extent_s(run_id))
origin = queries.time_origin(run_id)  # (0 for a replay; a live capture's first time)
w = queries.window_ns(run_id)

every = queries.call("evictions_over_time", run_id, window_ns=w, by="reason")
counted = queries.summary(run_id).get("evictions")
# A run can count evictions it recorded no spans of (a Belady run records lookups only):
# its empty charts must not say the cache never filled.
spanless = every.height == 0 and bool(counted)
status = queries.run_row(run_id).get("status")
# A live capture is no replay: vLLM's KV events carry stores and removals, no lookups and no
# scheduler steps (its page said "No evictions or repeated prefixes in this run" beside
# Overview's 177 evictions, and a killed one was told to run "the same replay" to its end)
live = queries.run_row(run_id).get("mode") == "live"
LIVE_FILL = ("`kvtrace replay TRACE --db PATH --capacity-blocks 256` in engine mode (`kvtrace capture vllm "
             "--trace-out TRACE` writes the trace a capture saw)")
no_evictions = (f"This run recorded no eviction spans, though its summary counts {ui.count(counted)} evicted blocks "
                "(a Belady run records lookups only)." if spanless else
                # (a run that failed before its cache filled, or is still filling it, was said to never fill it)
                f"No evictions recorded so far: this run is {ui.strong(status or 'unfinished')}, and its spans hold "
                "none." if status != "complete" else
                "No evictions in this run: the cache never filled.")
fill = ("an LRU run of the same trace and capacity (`--policy lru`)" if spanless else LIVE_FILL if live else
        ui.fill_to_its_end(status) if status != "complete" else ui.FILL_SMALL_CACHE)
by_reason = state.in_window(every, "window_start_ns", window, origin)
outside = state.outside_window(every, by_reason, window, "evictions")
ui.chart(charts.stacked_counts(by_reason, "Evicted blocks by reason", "blocks per window", charts.REASON_NAMES),
         "Blocks evicted per window, stacked by eviction reason (lru, stale_hash, replaced, moved, connector, reset).",
         empty_what=outside or no_evictions, command=None if outside else fill, key="ev_reason")
by_kind = state.in_window(queries.call("evictions_over_time", run_id, window_ns=w, by="publish_kind"),
                          "window_start_ns", window, origin)  # (the same evictions, by another key)
ui.chart(charts.stacked_counts(by_kind, "Evicted blocks by the publish that took their place", "blocks per window",
                               charts.KIND_NAMES),
         "Blocks evicted per window, stacked by the kind of publish that next took the block (full, partial tail, "
         "checkpoint, boundary; no publish = the block went to uncached use, or is not reused yet). Each reason and "
         "each publish kind keeps one colour on every chart.",
         empty_what=outside or no_evictions, command=None if outside else fill, key="ev_kind")

st.subheader("Eviction attribution")
# The store traces a miss to an eviction of KV group 0 alone: with more groups (a hybrid model's
# state group), a miss on a state another group evicted is not traced, and "no miss hit a block
# that had been evicted" was said of a run whose two misses did
groups = queries.group_names(run_id)
traced = f" of {groups[0]}" if len(groups) > 1 else ""
apart = (f" Misses are traced to {groups[0]}'s evictions alone: a miss on a block or state another KV group evicted "
         "is not counted here." if len(groups) > 1 else "")
whole = queries.call("eviction_attribution", run_id)
att = state.in_window(whole, "miss_ns", window, origin)  # (the table below is the window's too)
flows = queries.attribution_flows(run_id, att)
prefixes = queries.prefix_labels(run_id, flows["prefix"].to_list())
outside = state.outside_window(whole, att, window, "attributed misses")
ui.chart(charts.attribution_sankey(flows, prefixes),
         f"Later misses on blocks{traced} that were cached before, traced back: the kind of publish that took the "
         "block, the eviction reason, and the hot prefix that lost it (short hash · the request that first looked it "
         f"up and its prompt length · the longest hit it got).{apart}",
         empty_what=outside or ("This run is a live capture: vLLM's KV events carry no lookups, so no miss can be "
                                "traced to the eviction before it." if live else
                                f"No miss in this run hit a block{traced} that had been evicted, so there is nothing "
                                f"to attribute.{apart}" if not spanless else no_evictions),
         command=None if outside else fill, key="sankey")
if whole.height:
    top = (att.group_by("publish_kind", "publish_request_id", "root_hash")
           .agg(pl.len().alias("later_misses"), pl.col("miss_request_id").n_unique().alias("requests_hurt"),
                pl.col("evict_reason").first().alias("evict_reason"))
           # (every key: group_by's order is arbitrary, and ties took it from run to run and store to store)
           .sort(["later_misses", "publish_request_id", "publish_kind", "root_hash"],
                 descending=[True, False, False, False], nulls_last=True))
    top = top.head(200)
    names = queries.prefix_labels(run_id, top["root_hash"].to_list())
    top = top.select(pl.col("root_hash").replace_strict(names, default=pl.col("root_hash")).alias("prefix"),
                     pl.all())
    ui.table(top, "Which publishes (kind, request) evicted which hot prefixes (short hash · first request and its "
                  "prompt length · longest hit; root_hash in full), and how many later misses each caused; largest "
                  "first.",
             empty_what="No attributed misses in this time window.", command=None)
    with st.expander("Every attributed miss"):
        ui.table(att.head(5000), "One row per lookup miss: the eviction that removed the missed block and the publish "
                                 "that took its block id (first 5000).",
                 empty_what="No attributed misses in this time window.", command=None)

st.subheader("Block lifetimes")
hist = queries.call("block_histograms", run_id)
panels = (("lifetime", "lifetime at eviction"), ("idle_before_evict", "idle before eviction"),
          ("reuse_gap", "prefix reuse gap"))
# (a cache-only replay steps once a request, its lookup: its "scheduler steps" were requests)
cache_only = str(queries.replayed_mode(run_id) or "").startswith("cache-only")
unit = "requests (a cache-only run's steps: one lookup each)" if cache_only else "scheduler steps"
ui.chart(charts.histograms(hist, panels, unit),
         f"Exact distributions, in {unit}, of block lifetime at eviction, idle time before eviction, and the "
         "gap between reuses of a prefix (vLLM only samples these), over the whole run: the time window does not "
         "filter them.",
         empty_what=no_evictions if spanless else (
             "This run is a live capture: vLLM's KV events carry no scheduler steps and no lookups, so no lifetimes, "
             "idle times or reuse gaps in steps" + (" (its evictions are charted above)." if every.height else ".")
             if live else
             "No evictions or repeated prefixes in this run."), command=fill,
         key="hist")
