"""Latency: TTFT and ITL distributions, ITL over time, a per-request waterfall."""

import polars as pl
import streamlit as st

from kvtrace.dashboard import charts, queries, state, ui

ctx = queries.context()
run_id = ctx["run_id"]

st.title("Latency")
c = st.columns(2)
with c[0]:
    ui.chart(charts.cdf([("TTFT", queries.call("latency_cdf", run_id, "ttft")), ("queue", queries.call("latency_cdf", run_id, "queue"))], "TTFT CDF"),
             "Fraction of requests whose time to first token (and queueing delay) is at most x, in virtual ms.",
             empty_what="No finished requests in this run.", key="ttft_cdf")
    ui.chart(charts.latency_hist(queries.call("latency_histogram", run_id, "ttft"), "TTFT histogram", "TTFT"),
             "Requests per TTFT bin (virtual ms).", empty_what="No finished requests in this run.", key="ttft_hist")
with c[1]:
    ui.chart(charts.cdf([("ITL", queries.call("latency_cdf", run_id, "itl"))], "ITL CDF"),
             "Fraction of inter-token gaps (all requests) at most x, in virtual ms.",
             empty_what="No decoded tokens in this run.", key="itl_cdf")
    ui.chart(charts.latency_hist(queries.call("latency_histogram", run_id, "itl"), "ITL histogram", "ITL"),
             "Inter-token gaps per bin (virtual ms).", empty_what="No decoded tokens in this run.", key="itl_hist")

window = state.bound_window("Virtual time window", queries.time_extent_s(run_id))
ui.chart(charts.itl_over_time(state.in_window(queries.call("itl_over_time", run_id, window_ns=queries.window_ns(run_id)), "window_start_ns", window)),
         "ITL of the requests whose first token fell in each window: gap-weighted mean, median of per-request p50, max of per-request p99.",
         empty_what="No decoded tokens in this run.", key="itl_time")

st.subheader("Request waterfall")
reqs = queries.call("requests", run_id)
if reqs.height == 0:
    ui.empty("No finished requests in this run.")
else:
    # The picker offers the slowest requests first; any request id works through ?request=.
    slow = reqs.sort(["ttft_ns", "request_id"], descending=[True, False])
    wanted = st.query_params.get("request")
    options = slow["request_id"].head(500).to_list()
    if wanted in set(reqs["request_id"].to_list()) and wanted not in options:
        options.append(wanted)
    info = {r["request_id"]: r for r in reqs.iter_rows(named=True)}
    rid = state.bound_select("Request (slowest TTFT first)", options, "request",
                             format_func=lambda x: f"{x} · TTFT {info[x]['ttft_ns'] / 1e6:.1f} ms · hit {info[x]['num_local_hit_tokens'] or 0}/{info[x]['num_prompt_tokens']} tokens")
    ui.chart(charts.waterfall(queries.call("request_waterfall", run_id, rid), rid),
             "One request on virtual time: queue, prefill chunks and decode as bars; its cache lookup (hit), CoW copies and the evictions it caused as marks.",
             empty_what=f"No spans for request {rid}.", key="waterfall")
    r = info[rid]
    ui.table(pl.DataFrame([r]).select("request_id", "num_prompt_tokens", "num_local_hit_tokens", "num_external_hit_tokens", "num_computed_tokens",
                                      "queue_ns", "ttft_ns", "e2e_ns", "itl_p50_ns", "itl_p99_ns", "num_preemptions", "num_divergent_tokens"),
             "This request's numbers (ns of virtual time).", empty_what="")
