"""Overview: the chosen run, its headline numbers, and every run in the store."""

import streamlit as st

from kvtrace.dashboard import queries, ui
from kvtrace.store.schema import SUMMARY_NOTHING_RECEIVED

ctx = queries.context()
run_id = ctx["run_id"]
row = queries.run_row(run_id)
s = queries.summary(run_id)

st.title("Overview")
st.markdown(
    f"**{row.get('name') or run_id}** · run `{run_id}` · trace `{row.get('trace_source') or '–'}` · "
    f"mode `{row.get('mode') or '–'}` · "
    f"status **{row.get('status')}**  \nbehaviours on: {row.get('behaviours_on') or 'none'}"
    + (f" · **off: {row['behaviours_off']}**" if row.get("behaviours_off") else "")
)
if row.get("status") == "running":
    st.warning("This run is still being written by a replay: press **Refresh** in the sidebar for newer data.",
               icon=":material/sync:")
elif row.get("status") in ("failed", "incomplete"):
    st.warning(f"This run is **{row.get('status')}**: it stopped early, and only the spans flushed before that are "
               "shown.")
if row.get(SUMMARY_NOTHING_RECEIVED):
    st.warning("Nothing received: this live capture recorded no events (no publisher reached, or an idle server).",
               icon=":material/signal_disconnected:")

if not s:
    ui.empty("This run has no summary yet (it is written when the replay finishes).")
else:
    c = st.columns(4)
    c[0].metric("Token hit rate", ui.pct(s.get("token_hit_rate")))
    c[1].metric("Block hit rate", ui.pct(s.get("block_hit_rate")))
    c[2].metric("Requests", ui.count(s.get("requests")))
    c[3].metric("Prompt tokens", ui.count(s.get("prompt_tokens")))
    c = st.columns(4)
    c[0].metric("TTFT p50", ui.ms(s.get("ttft_ms_p50")))
    c[1].metric("TTFT p99", ui.ms(s.get("ttft_ms_p99")))
    c[2].metric("ITL p50", ui.ms(s.get("itl_ms_p50")))
    c[3].metric("ITL p99", ui.ms(s.get("itl_ms_p99")))
    c = st.columns(4)
    c[0].metric("Evictions", ui.count(s.get("evictions")))
    c[1].metric("CoW copies", ui.count(s.get("cow_copies")))
    c[2].metric("Stale hashes", ui.count(s.get("stale_hashes")))
    c[3].metric("Divergent outputs", ui.count(s.get("divergent_outputs")))

st.caption("The run summary written when the replay finished: token and block hit rates, virtual-time latencies, "
           "cache event counts.")

groups = queries.group_hit_rates(run_id)
names = queries.group_names(run_id)
per_group = {g: r for g, r in groups.items() if g != queries.GROUP_ALL}
if per_group:
    cols = st.columns(max(len(per_group), 2))
    for col, (g, rate) in zip(cols, sorted(per_group.items())):
        col.metric(f"Hit rate · {names.get(g, f'group {g}')}", ui.pct(rate))
    st.caption("Token hit rate per KV cache group over the whole run, from the lookup spans (attention groups hit "
               "longer prefixes than state groups).")
else:
    ui.empty("No lookup spans in this run, so no per-group hit rate.")

st.subheader("Runs")
table = queries.runs().select(
    "run_id", "name", "status", "mode", "trace_source", "behaviours_off", *queries.SUMMARY_KEYS, "num_spans", "created",
)
ui.table(table, "Every run in this store; click a column header to sort, pick a run in the sidebar to inspect it.",
         empty_what="No runs yet.")
