"""Compare: two runs of the same trace side by side (the isolated A/B), with the numbers,
bootstrap CIs and Markdown of ``kvtrace diff``."""

import math
from typing import Literal

import polars as pl
import streamlit as st

from kvtrace import metrics
from kvtrace.compare import pairing
from kvtrace.compare.model import MetricDelta
from kvtrace.compare.render import fmt, shows_no_change, to_markdown
from kvtrace.dashboard import charts, queries, state, ui
from kvtrace.names import replay_mode, shell_path, shell_word

# (label, summary metric, kind); which way is better is the diff's (MetricDelta.verdict)
TILES = [
    (metrics.HIT_LABEL["prefix_cache_hit_rate"], "prefix_cache_hit_rate", "rate"),
    (metrics.HIT_LABEL["external_prefix_cache_hit_rate"], "external_prefix_cache_hit_rate", "rate"),
    ("Block hit rate", "block_hit_rate", "rate"),
    (metrics.HIT_LABEL["prompt_tokens_by_source.local_compute"], "prompt_tokens_by_source.local_compute", "count"),
    ("TTFT median", "median_ttft_ms", "ms"), ("TTFT p99", "p99_ttft_ms", "ms"),
    ("ITL median", "median_itl_ms", "ms"), ("ITL p99", "p99_itl_ms", "ms"),
    ("Evictions", "evictions", "count"), ("Stale hashes", "stale_hashes", "count"),
]


def _value(kind: str, v) -> str:
    return ui.pct(v) if kind == "rate" else ui.ms(v) if kind == "ms" else ui.count(v)


def _delta(kind: str, d: float) -> str:
    """The change as ``kvtrace diff`` resolves it: a time in diff's own digits (``fmt``), a
    rate in percentage points, none where diff shows none (no sign)."""
    if kind == "rate":
        return "0.0 pp" if shows_no_change(d, fine=True) else ui.pp(d)
    if kind == "ms":
        return f"{fmt(d, signed=True)} ms"
    return f"{int(d):+,}"


def _colour(m: MetricDelta, d: float) -> Literal["off", "normal", "inverse"]:
    """Green for diff's "better", red for its "worse" (Streamlit colours a positive change
    green under "normal"), none for a change diff calls the same or has no direction for."""
    # (a rate's or a count's small change is one, as diff prints it; a sub-µs time's is none)
    if m.verdict not in ("better", "worse") or shows_no_change(d, fine=not metrics.is_latency_key(m.name)):
        return "off"
    return "normal" if (m.verdict == "better") == (d > 0) else "inverse"


def main() -> None:
    ctx = queries.context()
    run_a = ctx["run_id"]
    db = state.shown_db(ctx["db"])  # (for the page's text and commands only)

    st.title("Compare")
    others = queries.comparable_runs(run_a)
    ids = others["run_id"].to_list()
    missing = state.unknown_value("b", ids)
    if missing is not None:
        known = missing in set(queries.runs()["run_id"].to_list())
        st.warning(f"Run {state.link_value(missing)} (B, from the link) is "
                   + ("A itself" if missing == run_a else "not a run of the same trace as A" if known
                      else f"not in {ui.code(db)}")
                   + ": nothing is shown in its place. Pick B below.", icon=":material/link_off:")
    # (a failed run's settings fail again: a pair made from them was suggested, with a capacity too small)
    failed = queries.run_row(run_a).get("status") == "failed"
    pair = ui.fill_to_its_end("failed") if failed else ui.code(pairing.study_command(queries.run_row(run_a), db))
    defs = metrics.recorded_definitions(queries.run_row(run_a).get("mode"), queries.config(run_a))
    if not failed and defs is not None and defs != metrics.DEFINITIONS:
        # (a run recorded under other definitions pairs with none of this kvtrace's: the command
        # alone made a run that never became A's partner)
        pair = (f"a replay of A with this kvtrace first (A's metric definitions: {metrics.definitions_label(defs)}; "
                f"this kvtrace's: {metrics.definitions_label(metrics.DEFINITIONS)}; no run of this kvtrace pairs with "
                f"A), then {pair}")
    if not ids:
        ui.empty(f"No other run of the same trace as {ui.code(run_a)} to compare with.", pair)
        return
    default = None if missing is not None else queries.default_partner(run_a)
    if default is None and missing is None:
        st.info("No run of the same trace, mode and capacity differs from A in exactly one setting. Make a pair "
                f"with {pair}, or pick a B below (its differences are listed).", icon=":material/info:")
    labels = dict(zip(queries.runs()["run_id"], queries.runs()["label"]))
    label = lambda r: str(labels.get(r, r))  # pure: AppTest calls it outside the script
    c = st.columns(2)
    c[0].markdown(f"**A** (sidebar run): {ui.literal(label(run_a))}")
    with c[1]:
        run_b = state.bound_select("B", ids, "b", default=default, format_func=label, unknown="none",
                                   placeholder="pick a run of the same trace")
    if run_b is None:
        return
    a, b = queries.run_row(run_a), queries.run_row(run_b)
    # the charts' legends: a run's name, else its id (a record without one read 'B None')
    name_a, name_b = f"A {a.get('name') or run_a}", f"B {b.get('name') or run_b}"
    diffs = pairing.differences(a, b)
    st.caption("Settings that differ: " + ("; ".join(map(ui.literal, diffs)) if diffs else "none"))
    bad = pairing.mismatches(a, b)
    if bad:
        st.warning("Not an isolated measurement: A and B differ in "
                   + ("nothing the store records" if not bad else "; ".join(map(ui.literal, bad)))
                   + ". A comparison isolates one change when the runs share trace, mode, capacity and metric "
                     "definitions and differ in exactly one setting.", icon=":material/warning:")

    diff = queries.run_diff(run_a, run_b)
    for side, run in (("A", diff.run_a), ("B", diff.run_b)):  # (kvtrace diff's words, first as there)
        if run.get("status") not in (None, "complete"):
            st.warning(f"Run {side} ({ui.literal(run.get('name') or run.get('run_id') or '?')}) is "
                       f"{ui.strong(run['status'])}: partial numbers (they cover only what was recorded).",
                       icon=":material/warning:")
    for note in diff.notes:  # (kvtrace diff prints the same)
        st.warning(ui.literal(note), icon=":material/warning:")
    # kvtrace diff names a median's shift by its percentile (p50_ttft_ms), the tiles by the summary's key
    ci = {s.name: s for s in diff.latency} | {s.name.replace("p50_", "median_", 1): s for s in diff.latency
                                               if s.name.startswith("p50_")}
    cols, times = st.columns(5), queries.times_word(run_a, run_b)
    for i, (name, key, kind) in enumerate(TILES):
        try:
            m = diff.metric(key)
        except KeyError:
            cols[i % 5].metric(f"{name} (B)", "–", help="Not recorded in these runs.")
            continue
        unit = f" ({times})" if kind == "ms" else ""
        helptext = f"A: {_value(kind, m.a)}"
        if key in ci and not math.isnan(ci[key].ci_low):
            s = ci[key]
            helptext += f"; 95% bootstrap CI of B − A: [{fmt(s.ci_low, signed=True)}, {fmt(s.ci_high, signed=True)}] ms"
        d = m.delta
        still = d is None or shows_no_change(d, fine=kind != "ms")  # (no arrow where diff shows no change)
        cols[i % 5].metric(f"{name}{unit} (B)", _value(kind, m.b), delta=None if d is None else _delta(kind, d),
                           delta_color="off" if d is None else _colour(m, d), delta_arrow="off" if still else "auto",
                           help=helptext)
    st.caption("B's value with its change from A (rates in percentage points); green means better, red worse. "
               f"Times: A {queries.times_caption(run_a)}; B {queries.times_caption(run_b)}. A run without a clock "
               "shows – and no change, never 0.")

    w = queries.window_ns(run_a)  # both runs on A's windows
    ha, hb = (queries.call("hit_counters_over_time", r, window_ns=w) for r in (run_a, run_b))
    axis_a, axis_b = queries.time_axis(run_a), queries.time_axis(run_b)
    # (one axis titled by A's clock carried a cache-only A's request order and an engine B's time)
    charts.set_time_axis(axis_a if axis_a == axis_b else "time (s): each run's own (see its pages)")
    ui.chart(charts.overlay([(name_a, ha), (name_b, hb)], "window_start_ns",
                            "cum_prefix_cache_hit_rate", "Cumulative prefix cache hit rate, A vs B",
                            "prefix cache hit rate", percent=True),
             "vLLM's prefix cache hit rate, cumulative, of both runs on one time axis"
             + (f" ({axis_a})." if axis_a == axis_b else ": their times are not of one kind, so read its "
                                                          "shape, not its moments."),
             empty_what="Neither run scheduled a request.", key="cmp_hit")

    if diff.latency:
        c = st.columns(2)
        for col, (metric, title) in zip(c, (("ttft", "TTFT"), ("itl", "ITL"))):
            with col:
                ui.chart(charts.cdf([(name_a, queries.call("latency_cdf", run_a, metric)),
                                     (name_b, queries.call("latency_cdf", run_b, metric))],
                                    f"{title} CDF, A vs B", times=times),
                         f"Fraction of {'requests' if metric == 'ttft' else 'inter-token gaps'} at most x, "
                         f"{times} time.",
                         empty_what="Neither run has this latency.", key=f"cmp_{metric}_cdf")
        shifts = pl.DataFrame(
            # the CI as kvtrace diff prints it: "[–, –]" where none holds its level (a NaN was "None")
            [{"percentile": s.name, "A (ms)": s.a, "B (ms)": s.b, "B − A (ms)": s.delta,
              "95% CI of B − A (ms)": f"[{fmt(s.ci_low, signed=True)}, {fmt(s.ci_high, signed=True)}]",
              "significant": s.significant} for s in diff.latency])
        ui.table(shifts, f"Latency percentiles ({times}) with the 95% bootstrap CI of B − A over requests "
                         f"({diff.bootstrap.get('resamples')} resamples, seed {diff.bootstrap.get('seed')}"
                         + (", paired" if diff.bootstrap.get("paired") else "") + "), as `kvtrace diff` reports them.",
                 empty_what="")
    else:  # (an engine run that finished no request was said to be cache-only)
        why = [f"{side} {ui.code(r)} {queries.no_requests_why(r)}" for side, r in (("A", run_a), ("B", run_b))
               if queries.call("latency_summary", r, (99,)).get("median_ttft_ms") is None]
        st.info(f"No latency to compare: {'; '.join(why) if why else 'no TTFT or ITL in both runs'}, so no TTFT or "
                "ITL is set against another.", icon=":material/info:")

    with st.expander("Copy as Markdown (the same text as `kvtrace diff --markdown`)"):
        st.code(to_markdown(diff), language="markdown")
        command = f"kvtrace diff --db {shell_path(db)} --markdown -- {shell_word(run_a)} {shell_word(run_b)}"
        st.caption(f"{ui.code(command)} prints this text.")  # (quoted: ids and paths may hold spaces)

    req = queries.request_diff(run_a, run_b)
    r = diff.requests  # (kvtrace diff's per-request counts: the page's own join only draws them)
    if r is not None and r.requests and not (r.gained or r.lost):
        # the same local + external total can be split otherwise: the local cache (vLLM's
        # prefix cache hit rate, the tiles') then moved, and the external tier made up for it
        shifted = int((req["local_b"] != req["local_a"]).sum())
        if r.only_a or r.only_b:  # (a run stopped early: the tiles count other requests, not a change)
            st.info(f"All {r.requests:,} requests both runs hold got the same cached tokens (local + external) in "
                    f"A and B; only in A: {r.only_a:,}, only in B: {r.only_b:,}. The tiles above count those too, "
                    "so they compare different sets of requests, not this change alone.", icon=":material/info:")
            return
        st.info(f"All {r.requests:,} requests got the same cached tokens (local + external) in A and B"
                + (": this change does not move the prefix cache on this trace." if not shifted else
                   f", but {shifted:,} of them took a different share from the local cache: the prefix cache hit "
                   "rate moved (the tiles above), and the external tier made up the difference."),
                icon=":material/info:")
        return
    # A run without request spans (cache-only) has no per-request tokens: not a question of ids.
    silent = [r for r in (run_a, run_b) if queries.call("per_request_hits", r).height == 0]
    # (an engine run that finished no request, a failed one, was said to be cache-only)
    # (in the mode its events were made in: a collected cache-only replay's is its sender's)
    cache_only = all(replay_mode(queries.replayed_mode(r)) == "cache-only" for r in silent)
    ui.chart(charts.request_delta(req),
             "Cached tokens (local + external hits at first schedule) of each request in B minus in A: green bars "
             "gained cache hits, red bars lost them.",
             empty_what=(f"No per-request cached tokens in {' and '.join(map(ui.code, silent))}: "
                         f"{'they record' if len(silent) > 1 else 'it records'} no request spans (cache-only runs have "
                         "none)." if silent and cache_only else
                         "No per-request cached tokens: " + "; ".join(f"{ui.code(r)} {queries.no_requests_why(r)}"
                                                                      for r in silent) + "."
                         if silent else "The two runs share no request ids."),
             command="two engine runs of the same trace, e.g. `kvtrace replay TRACE --db PATH` and `kvtrace replay "
                     "TRACE --db PATH --without shared-prefix-pinning`" if silent and cache_only else
                     ui.fill_to_its_end("failed" if any(queries.run_row(r).get("status") == "failed"
                                                        for r in silent) else None) if silent else
                     "the same trace with the same request ids, e.g. "
                     "`kvtrace replay TRACE --db PATH --without shared-prefix-pinning`",
             key="cmp_req")
    if r is not None and (r.only_a or r.only_b):  # (kvtrace diff's "only in A: N, only in B: M")
        st.info(f"Only in A: {r.only_a:,}, only in B: {r.only_b:,} requests: the chart and table compare the "
                f"{r.requests:,} requests both runs hold.", icon=":material/info:")
    if req.height:
        moved = (req.with_columns(pl.col("cached_delta").abs().alias("abs_delta"))
                 .sort(["abs_delta", "request_id"], descending=[True, False]))
        ui.table(moved.filter(pl.col("abs_delta") > 0).drop("abs_delta", "local_a", "local_b").head(50),
                 "The requests whose cached tokens changed most between A and B (top 50).",
                 empty_what="No request changed its cached tokens between A and B.",
                 command="a B run with another behaviour or capacity (pick it above)")


main()  # a function, so an empty state can return early (st.stop would also skip the sidebar links)
