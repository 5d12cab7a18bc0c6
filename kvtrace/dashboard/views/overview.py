"""Overview: the chosen run, its headline numbers, and every run in the store.

Every number is read from the store through ``kvtrace.metrics``' one definition (the
summary the replay wrote holds the same figures; the cross-view test holds them equal)."""

import streamlit as st

from kvtrace import metrics
from kvtrace.dashboard import queries, ui
from kvtrace.store.schema import SUMMARY_NOTHING_RECEIVED

ctx = queries.context()
run_id = ctx["run_id"]
row = queries.run_row(run_id)
s = queries.summary(run_id)

st.title("Overview")
# names, ids and paths as they are: a collected run's id is whatever its sender chose
st.markdown(
    f"{ui.strong(row.get('name') or run_id)} · run {ui.code(run_id)} · "
    f"trace {ui.code(row.get('trace_source') or '–')} · mode {ui.code(row.get('mode') or '–')} · "
    f"backend {ui.code(row.get('backend') or '–')} · "
    f"status {ui.strong(row.get('status'))}  \n"
    + (f"behaviours on: {ui.literal(row.get('behaviours_on') or 'none')}"
       + (f" · **off: {ui.literal(row['behaviours_off'])}**" if row.get("behaviours_off") else "")
       if queries.has_behaviours(row) else "behaviours: – (kvtrace's behaviour switches are engine replays')")
)
if row.get("status") == "running":
    st.warning("This run is still being written by a replay: press **Refresh** in the sidebar for newer data.",
               icon=":material/sync:")
elif row.get("status") in ("failed", "incomplete"):
    # (the error its replay stored: the page said it stopped early, never why)
    error = s.get("error") if isinstance(s.get("error"), str) and s.get("error") else None
    if error and len(error) > 500:  # (a foreign store's can be anything)
        error = error[:500] + "…"
    st.warning(f"This run is {ui.strong(row.get('status'))}: it stopped early"
               + (f" ({ui.literal(error)})" if error else "") + ", and only the spans flushed before that are shown.")
if row.get(SUMMARY_NOTHING_RECEIVED):
    st.warning("Nothing received: this live capture recorded no events (no publisher reached, or an idle server).",
               icon=":material/signal_disconnected:")

hits = queries.hit_counters(run_id)


def counted(key: str) -> str:
    """A hit counter as `kvtrace runs` and `kvtrace diff` show it: – where the run's summary
    records none (a live capture has no lookups: not measured, where its spans would say 0)."""
    return ui.count(hits[key]) if isinstance(s.get(key), (int, float)) else "–"


# the headline tiles at fixed percentiles: a run replayed at --percentiles 25,75 has no p99 of its own
lat = queries.call("latency_summary", run_id, (99,))
LABEL = metrics.HIT_LABEL

st.subheader("Prefix cache (vLLM's counters)")
c = st.columns(4)
c[0].metric(LABEL["prefix_cache_hit_rate"], ui.pct(hits["prefix_cache_hit_rate"]),
            help=metrics.RATES[0].doc)
c[1].metric(LABEL["external_prefix_cache_hit_rate"], ui.pct(hits["external_prefix_cache_hit_rate"]),
            help=metrics.RATES[1].doc)
c[2].metric("Requests", counted("requests"))  # (– where no summary counts them, as the runs table shows)
c[3].metric("Block hit rate", ui.pct(s.get("block_hit_rate")), help=metrics.BLOCK_HIT_RATE_DOC)
c = st.columns(4)
c[0].metric(LABEL["prefix_cache_queries"], counted("prefix_cache_queries"), help=metrics.COUNTERS[0].doc)
for col, key in zip(c[1:], metrics.SOURCE_KEYS):
    counter = next(x for x in metrics.COUNTERS if x.key == key)
    col.metric(counter.label, counted(key), help=f"{counter.vllm}: {counter.doc}")
preempted = counted("preempted_prefix_cache_queries")
st.caption("Each request counted once, when it was first scheduled, as vLLM counts prefix_cache_queries and "
           "prefix_cache_hits; the prompt tokens split by source sum to the queries. "
           + ((queries.none_finished(run_id) or "No lookups recorded") + " (– : not measured)."
              if preempted == "–" else
              f"Preempted requests' re-lookups, counted apart: {counted('preempted_prefix_cache_hits')} of "
              f"{preempted} tokens hit." if hits["preempted_prefix_cache_queries"] else "No request was preempted."))

st.subheader("Latency")
for col, (label, key) in zip(st.columns(5), (("TTFT median", "median_ttft_ms"), ("TTFT p99", "p99_ttft_ms"),
                                 ("TPOT median", "median_tpot_ms"), ("ITL median", "median_itl_ms"),
                                 ("ITL p99", "p99_itl_ms"))):
    col.metric(f"{label} ({queries.times_word(run_id)})", ui.ms(lat.get(key)))
st.caption(f"Times: {queries.times_caption(run_id)}. Definitions as vllm bench serve's (README, 'Metrics').")

st.subheader("Cache events")
events = st.columns(5)
events[0].metric("Evictions", ui.count(s.get("evictions")))
events[1].metric("CoW copies", ui.count(s.get("cow_copies")))
events[2].metric("Stale hashes", ui.count(s.get("stale_hashes")))
events[3].metric("Divergent outputs", ui.count(s.get("divergent_outputs")))
# (a study's run of 190 was shown on no page: the worker's and the cache's block tables disagreed)
events[4].metric("Table disagreements", ui.count(s.get("table_disagreements")))
st.caption("Cache event counts from the run summary written when the replay finished, or for a run that wrote none "
           "(running, stopped early) from its spans so far, as `kvtrace runs` and `kvtrace diff` read them "
           "(– : not measured).")

groups = queries.call("group_hit_rates", run_id)
labels = queries.group_rate_labels(run_id)
if len(groups) > 1:
    st.subheader("Group hit rates (not the request hit rate)")
    cols = st.columns(max(len(groups), 2))
    for col, (g, rate) in zip(cols, sorted(groups.items())):
        col.metric(labels.get(g, f"group {g}: group hit rate"), ui.pct(rate))
    st.caption(metrics.GROUP_HIT_RATE_DOC)

st.subheader("Runs")
table = queries.runs().select(
    "run_id", "name", "status", "mode", "backend", "trace_source", "behaviours_off", *queries.SUMMARY_KEYS, "num_spans",
    "created",
)
ui.table(table, "Every run in this store; click a column header to sort, pick a run in the sidebar to inspect it.",
         empty_what="No runs yet.", column_config=ui.summary_columns(queries.SUMMARY_KEYS))
