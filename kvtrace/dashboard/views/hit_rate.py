"""Hit rate: vLLM's prefix cache hit rate over time with the Belady bound, prompt tokens by
source, the per-group hit rates (their own metric, charted apart), pool usage."""

import streamlit as st

from kvtrace import metrics
from kvtrace.dashboard import charts, queries, state, ui
from kvtrace.names import replay_mode
from kvtrace.store.schema import SPAN_LOOKUP, SPAN_STEP

ctx = queries.context()
run_id = ctx["run_id"]
names = queries.group_names(run_id)
w = queries.window_ns(run_id)

st.title("Hit rate")
window = state.bound_window(queries.window_label(run_id), queries.time_extent_s(run_id))
origin = queries.time_origin(run_id)  # (0 for a replay; a live capture's first time)
every = queries.call("hit_counters_over_time", run_id, window_ns=w)
counters = state.in_window(every, "window_start_ns", window, origin)
scheduled = state.outside_window(every, counters, window, "scheduled requests")  # (then no command fills it)
# (a run killed before its first request finished, or replaying toward it, has lookups and no counts)
unfinished = queries.none_finished(run_id)
# (and one still starting, or failed before its first lookup, as its Evictions and Latency pages say: not the demo)
status = queries.run_row(run_id).get("status")
fill = ui.fill_to_its_end(status) if unfinished or status in ("running", "failed", "incomplete") else ui.FILL_RUN

bound = queries.belady_bound(run_id)
bel = bound.run
level = None
if bel is not None:
    rate = queries.summary(bel["run_id"]).get(metrics.HEADLINE_RATE)
    if isinstance(rate, (int, float)):
        # (a run without a name by its id, as everywhere else: the legend read 'Belady bound (None, ...)')
        level = (f"Belady bound ({bel.get('name') or bel['run_id']}, {bound.capacity})", float(rate))
ui.chart(
    charts.hit_rate(counters, level),
    "vLLM's prefix cache hit rate (prefix_cache_hits / prefix_cache_queries, each request once at its first "
    "schedule) per time window (solid) and cumulative since the start (dashed)"
    + ("; dotted: the Belady (offline-optimal) bound from the cache-only run of the same trace and capacity."
       if level is not None else "."),
    empty_what=scheduled or unfinished or "No request was scheduled in this run, so there is no hit rate to plot.",
    command=None if scheduled else fill, key="hit_rate",
)
cfg = queries.config(run_id)
if cfg.get("policy") == "belady":  # (only cache-only configs store a policy)
    st.caption("This run is a Belady run: its hit rate is itself the Belady (offline-optimal) bound at its capacity"
               + (f" ({bound.capacity})." if bound.capacity is not None else "."))
elif cfg.get("mode") == "cache-only" and cfg.get("capacity_blocks") is None:
    st.caption("No Belady bound: this run's cache is unbounded, so nothing is evicted and its hit rate is already "
               "the highest any policy reaches on this trace.")
elif bel is None and bound.capacity is None:
    st.caption("No Belady bound: this run's config stores no prefix-cache capacity (capacity_blocks and "
               "block_size, or cache.num_gpu_blocks and cache.groups) to match one against.")
elif bel is None and bound.capacity is not None:
    cap = bound.capacity
    seen = ", ".join(dict.fromkeys(str(c) if c else "no stored capacity" for c in bound.others))
    st.caption(f"No Belady bound at this run's capacity ({cap})"
               + (f"; this trace's Belady runs have {seen}" if seen else "")
               + f". Add one on the same trace with {ui.fill_belady(cap.blocks, cap.block_size)}.")

ui.chart(
    charts.hit_sources(counters),
    "Prompt tokens per window by source (vLLM's prompt_tokens_by_source: local cache hit, external KV transfer, "
    "local compute), each request once at its first schedule, stacked: the stack is the prompt tokens scheduled.",
    empty_what=scheduled or unfinished or "No request was scheduled in this run.",
    command=None if scheduled else fill, key="hit_sources",
)

st.subheader("Group hit rates")
groups = queries.call("group_hit_rate_over_time", run_id, window_ns=w)
gids = sorted(groups["group_id"].unique().to_list()) if groups.height else []
labels = queries.group_rate_labels(run_id)
missing = state.unknown_value("group", ["each", *gids])
if missing is not None and missing in {str(g) for g in names}:  # a group of the run's, without per-group hits
    st.warning(f"KV group {state.link_value(missing)} from the link has no per-group hits in this run (below): "
               "every group is shown instead.", icon=":material/link_off:")
else:  # (said it was not in the run: a --backend vllm run's group 0 is)
    state.warn_unknown("group", ["each", *gids], "KV group", "every group is shown instead.")
group = state.bound_select("KV group", ["each", *gids], "group", default="each",
                           format_func=lambda g: "every group" if g == "each" else labels.get(int(g), f"group {g}"))
shown = groups if group == "each" else groups.filter(groups["group_id"] == group)
in_window = state.in_window(shown, "window_start_ns", window, origin)
outside = state.outside_window(shown, in_window, window, "per-group hits")
# (a vllm-backend run recorded before its adapter asked vLLM for each group's own hit marks
# the common hit it wrote into every group as inferred, which the per-group figures leave out)
vllm = cfg.get("backend") == "vllm"
ui.chart(charts.group_hit_rate(in_window, labels),
         metrics.GROUP_HIT_RATE_DOC,
         empty_what=outside or unfinished or (
             "No per-group hits in this run: no lookup spans, or (a vLLM-backend run an older kvtrace recorded) only "
             "the groups' common hit, inferred into each group, which is left out; a replay with this kvtrace records "
             "each group's own." if vllm else
             "No per-group hits in this run: no lookup span names a KV group's own hit."),
         command=None if outside or (vllm and not unfinished) else fill, key="group_hit_rate")

usage = queries.call("usage_over_time", run_id, window_ns=w)
in_window = state.in_window(usage, "window_start_ns", window, origin)
outside = state.outside_window(usage, in_window, window, "engine steps")
ui.chart(
    charts.usage(in_window, names, queries.shared_pool(run_id)),
    "Block-pool usage: each KV group's share of the pool, mean (solid) and max (dotted) per window of scheduler "
    "steps; with one pool shared by the groups, also the pool's mean usage (their sum).",
    # (a cache-only replay writes a step span per lookup, with no pool usage: "no step spans" was not so)
    empty_what=outside or ("No pool usage in this run: its step spans carry none (a cache-only replay's steps are its "
                           "lookups, with no block pool usage recorded)." if queries.span_count(run_id, SPAN_STEP)
                           else "No engine step spans in this run, so no pool usage."),
    command=None if outside else "`kvtrace replay TRACE --db PATH` in engine mode", key="usage",
)

st.subheader("Hottest prefixes")
lookups = queries.span_count(run_id, SPAN_LOOKUP)
ui.table(queries.call("per_prefix_reuse", run_id, top=20),
         "The 20 most looked-up prefix families (root hash of the first full block): every lookup, including "
         "the repeated ones of requests still waiting for blocks; lookups that hit or missed, hit tokens and rate.",
         # (lookups that name no prefix: it said "no lookup spans" beside them; a kvtrace replay's
         # name one wherever the prompt fills a block, a Belady run's too since 30ad1b5)
         empty_what=(f"This run's {ui.count(lookups)} lookup spans name no prefix (no root hash: "
                     + ("no prompt fills a block, the prefix's first" if replay_mode(queries.replayed_mode(run_id)) else
                        "its sender recorded none")
                     + "), so no prefix reuse." if lookups else "No lookup spans in this run, so no prefix reuse."),
         command=None if lookups else ui.FILL_RUN)
