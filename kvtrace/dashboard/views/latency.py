"""Latency: TTFT and ITL distributions, ITL over time, a per-request waterfall."""

import polars as pl
import streamlit as st

from kvtrace.dashboard import charts, queries, state, ui

ctx = queries.context()
run_id = ctx["run_id"]

st.title("Latency")
bins = queries.HIST_BINS
c = st.columns(2)
with c[0]:
    ui.chart(charts.cdf([("TTFT", queries.call("latency_cdf", run_id, "ttft")),
                         ("queue", queries.cdf_from_histogram(run_id, "queue"))], "TTFT CDF"),
             f"Fraction of requests whose time to first token (exact) and queueing delay ({bins}-bin resolution) is at "
             "most x, in virtual ms.",
             empty_what="No finished requests in this run.", key="ttft_cdf")
    ui.chart(charts.latency_hist(queries.call("latency_histogram", run_id, "ttft", bins=bins), "TTFT histogram",
                                 "TTFT"),
             "Requests per TTFT bin (virtual ms).", empty_what="No finished requests in this run.", key="ttft_hist")
with c[1]:
    ui.chart(charts.cdf([("ITL", queries.cdf_from_histogram(run_id, "itl"))], "ITL CDF"),
             f"Fraction of inter-token gaps (all requests) at most x, in virtual ms ({bins}-bin resolution).",
             empty_what="No decoded tokens in this run.", key="itl_cdf")
    ui.chart(charts.latency_hist(queries.call("latency_histogram", run_id, "itl", bins=bins), "ITL histogram", "ITL"),
             "Inter-token gaps per bin (virtual ms).", empty_what="No decoded tokens in this run.", key="itl_hist")

window = state.bound_window("Virtual time window", queries.time_extent_s(run_id))
itl = queries.call("itl_over_time", run_id, window_ns=queries.window_ns(run_id))
ui.chart(charts.itl_over_time(state.in_window(itl, "window_start_ns", window)),
         "ITL of the requests whose first token fell in each window: gap-weighted mean, median of per-request p50, max "
         "of per-request p99.",
         empty_what="No decoded tokens in this run.", key="itl_time")

st.subheader("Request waterfall")
# The picker offers the queries.REQUEST_CHOICES slowest requests; any request id works
# through ?request=.
reqs = queries.request_choices(run_id, st.query_params.get("request"))
if reqs.height == 0:
    ui.empty("No finished requests in this run.")
else:
    options = reqs["request_id"].to_list()
    info = {r["request_id"]: r for r in reqs.iter_rows(named=True)}
    rid = str(state.bound_select(  # options: not empty
        "Request (slowest TTFT first)", options, "request",
        format_func=lambda x: f"{x} · TTFT {(info[x]['ttft_ns'] or 0) / 1e6:.1f} ms · "
                              f"hit {info[x]['num_hit_tokens'] or 0}/{info[x]['num_prompt_tokens']} tokens"))
    ui.chart(charts.waterfall(queries.call("request_waterfall", run_id, rid), rid),
             "One request on virtual time: queue, prefill chunks and decode as bars; its cache lookup (hit), CoW "
             "copies and the evictions it caused as marks.",
             empty_what=f"No spans for request {rid}.", key="waterfall")
    ui.table(reqs.filter(pl.col("request_id") == rid),
             "This request's tokens (prompt, local and external hits, computed) and TTFT in ns of virtual "
             "time.",
             empty_what="")
