"""Latency (modelled): TTFT, TPOT, ITL and E2EL statistics and distributions, ITL over
time, a per-request waterfall. Every percentile is kvtrace.numeric's (vllm bench serve's)."""

import polars as pl
import streamlit as st

from kvtrace import metrics
from kvtrace.dashboard import charts, queries, state, ui


def _request_label(row: dict) -> str:
    """A request in the picker: its id, TTFT and cached tokens; – where a span holds none (a
    collected run's sender may leave them out: a missing TTFT read '0.0 ms', the fastest
    of all, and a missing prompt length 'None')."""
    ttft = row["ttft_ns"]
    return (f"{row['request_id']} · TTFT {ui.ms(None if ttft is None else ttft / 1e6)} · "
            f"cached {ui.count(row['num_cached_tokens'])}/{ui.count(row['num_prompt_tokens'])} tokens")


def main() -> None:
    ctx = queries.context()
    run_id = ctx["run_id"]

    st.title("Latency")
    st.caption(f"Times: {queries.times_caption(run_id)}.")
    # a collected run's summary is its sender's: a cache-only replay's said 200 requests on
    # Overview, and 'No finished requests in this run' here
    # (and one whose sender was killed before its record: requests counted from its lookups, no times)
    collected = queries.run_row(run_id).get("mode") == "otlp"
    timeless = collected and queries.call("latency_summary", run_id, (99,)).get("median_ttft_ms") is None
    sent = timeless and queries.summary(run_id).get("mode") == "cache-only"
    lookups_only = timeless and not sent and bool(queries.summary(run_id).get("requests"))
    if queries.config(run_id).get("mode") == "cache-only" or sent or lookups_only:  # requests, on no clock
        state.warn_unknown("request", [], "Request", "a cache-only run has no clock.",  # (named once)
                           where="this run's latencies")
        st.query_params.pop("request", None)
        ui.empty("This run's sender sent lookups and no request times (a cache-only replay's, or one cut short "
                 "before its record): no latency." if lookups_only else
                 "This run is cache-only" + (" (its sender's summary says so)" if sent else "")
                 + ": it has no clock, so no latency.", "`kvtrace replay TRACE --db PATH` in engine mode")
        return
    if queries.run_row(run_id).get("mode") == "live":  # (an empty table and six "fill it with kvtrace demo")
        state.warn_unknown("request", [], "Request", "it has no finished request to show.")  # (named once)
        st.query_params.pop("request", None)
        ui.empty("This run is a live capture: vLLM's KV events carry cache events and no request times, so no "
                 "latency.", "`kvtrace replay TRACE --db PATH` in engine mode (`kvtrace capture vllm --trace-out "
                 "TRACE` writes the trace a capture saw)")
        return
    log = state.bound_toggle("Log scale", "log", help="Latency axes (and histogram counts) on a log scale")

    lat, qs = queries.latency(run_id), queries.percentiles(run_id)
    rows = []
    for m in metrics.LATENCIES:
        keys = metrics.latency_keys(m.key, qs)
        rows.append({"metric": m.label, **{k.removesuffix(f"_{m.key}_ms"): lat.get(k) for k in keys}})
    columns = [k.removesuffix("_ttft_ms") for k in metrics.latency_keys("ttft", qs)]
    stats = pl.DataFrame(rows, schema={"metric": pl.String, **{k: pl.Float64 for k in columns}})
    if all(v is None for v in lat.values()):  # (no finished request: five rows of blanks were shown as statistics)
        stats = stats.clear()
    times = queries.times_word(run_id)
    # (a run stopped, or still replaying, before a request finished: its own replay run to its end fills it)
    status = queries.run_row(run_id).get("status")
    fill = ui.FILL_RUN if status == "complete" else ui.fill_to_its_end(status)
    ui.table(stats, f"vllm bench serve's statistics of each latency, in ms ({times}): TTFT, TPOT (excl. 1st "
                    "token), ITL (every gap), E2EL, and queueing; mean, median, population std and percentiles.",
             empty_what="No finished requests in this run, so no latency.",
             command=fill if status != "complete" else
             "`kvtrace replay TRACE --db PATH` in engine mode (cache-only runs have no clock)")

    bins = queries.HIST_BINS
    c = st.columns(2)
    with c[0]:
        ui.chart(charts.cdf([("TTFT", queries.call("latency_cdf", run_id, "ttft")),
                             ("queue", queries.call("latency_cdf", run_id, "queue"))], "TTFT and queueing CDF", log,
                            times),
                 "Fraction of requests whose time to first token, and whose queueing delay, is at most x (the run's "
                 "percentiles 0, 0.1, ..., 100).",
                 empty_what="No finished requests in this run.", command=fill, key="ttft_cdf")
        ui.chart(charts.latency_hist(queries.call("latency_histogram", run_id, "ttft", bins=bins), "TTFT histogram",
                                     "TTFT", log, times),
                 "Requests per TTFT bin (exact counts).", empty_what="No finished requests in this run.",
                 command=fill, key="ttft_hist")
    with c[1]:
        ui.chart(charts.cdf([("ITL", queries.call("latency_cdf", run_id, "itl")),
                             ("TPOT", queries.call("latency_cdf", run_id, "tpot"))], "ITL and TPOT CDF", log, times),
                 "Fraction of inter-token gaps (all requests) and of requests' time per output token at most x.",
                 empty_what="No decoded tokens in this run.", command=fill, key="itl_cdf")
        ui.chart(charts.latency_hist(queries.call("latency_histogram", run_id, "itl", bins=bins), "ITL histogram",
                                     "ITL", log, times),
                 "Inter-token gaps per bin (exact counts).", empty_what="No decoded tokens in this run.",
                 command=fill, key="itl_hist")

    st.subheader("Over time")
    window = state.bound_window(f"{queries.window_label(run_id)} (filters the chart below)",
                                queries.time_extent_s(run_id))
    origin = queries.time_origin(run_id)  # (0 for a replay; a live capture's first time)
    itl = queries.call("itl_over_time", run_id, window_ns=queries.window_ns(run_id))
    shown = state.in_window(itl, "window_start_ns", window, origin)
    outside = state.outside_window(itl, shown, window, "decoded tokens")
    ui.chart(charts.itl_over_time(shown, log, times),
             "Inter-token gaps per window of the time their token came out: mean, p50 and p99 of the window's gaps.",
             empty_what=outside or "No decoded tokens in this run.", command=None if outside else fill,
             key="itl_time")

    st.subheader("Request waterfall")
    # The picker offers the queries.REQUEST_CHOICES slowest requests; any request id works
    # through ?request=.
    reqs = queries.request_choices(run_id, st.query_params.get("request"))
    options = reqs["request_id"].to_list()
    instead = "the slowest one is shown instead." if options else "it has no finished request to show."
    # (request_choices adds a linked request that finished; one still in flight when the run
    # stopped has spans, but no request span: it was called "not in this run")
    wanted = state.unknown_value("request", options)
    if wanted is not None and queries.request_has_spans(run_id, wanted):
        st.warning(f"Request {state.link_value(wanted)} from the link has spans in this run but no finished "
                   f"request span (it had not finished when the run's spans end): {instead}",
                   icon=":material/link_off:")
    else:
        state.warn_unknown("request", options, "Request", instead)
    if reqs.height == 0:
        # a link from another run: named once, then dropped from the URL (as a picker replaces one)
        st.query_params.pop("request", None)
        ui.empty("No finished requests in this run.", fill)
    else:
        info = {r["request_id"]: r for r in reqs.iter_rows(named=True)}
        rid = str(state.bound_select(  # options: not empty
            "Request (slowest TTFT first)", options, "request",
            format_func=lambda x: _request_label(info[x])))
        ui.chart(charts.waterfall(queries.call("request_waterfall", run_id, rid), rid),
                 "One request on virtual time: queue, prefill chunks and decode as bars; the cache lookup that "
                 "admitted it (one mark per cache hit), external-tier loads, CoW copies and the evictions it caused as "
                 "marks.",
                 empty_what=f"No spans for request {ui.code(rid)}.", key="waterfall")
        ui.table(reqs.filter(pl.col("request_id") == rid),
                 "This request's tokens (prompt, local and external hits at first schedule, cached = both, computed) "
                 f"and TTFT in ns of {queries.times_word(run_id)} time.",
                 empty_what="")


main()  # a function, so a run without a clock can return early (st.stop would also skip the sidebar links)
