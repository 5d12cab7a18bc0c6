"""Compare: two runs of the same trace side by side (the isolated A/B)."""

from typing import Literal

import polars as pl
import streamlit as st

from kvtrace.dashboard import charts, queries, state, ui


def main() -> None:
    ctx = queries.context()
    run_a = ctx["run_id"]

    st.title("Compare")
    others = queries.comparable_runs(run_a)
    if others.height == 0:
        ui.empty(f"No other run of the same trace as `{run_a}` to compare with.",
                 "the same trace again with one switch changed, e.g. "
                 "`kvtrace replay TRACE --db PATH --without shared-prefix-pinning`")
        return

    labels = dict(zip(queries.runs()["run_id"], queries.runs()["label"]))
    label = lambda r: str(labels.get(r, r))  # pure: AppTest calls it outside the script
    c = st.columns(2)
    c[0].markdown(f"**A** (sidebar run): {label(run_a)}")
    with c[1]:
        run_b = str(state.bound_select("B", others["run_id"].to_list(), "b", format_func=label))  # others: not empty
    a, b = queries.run_row(run_a), queries.run_row(run_b)
    on_a, on_b = ({x for x in (r.get("behaviours_on") or "").split(", ") if x} for r in (a, b))
    changed = sorted(on_a ^ on_b)
    st.caption("Behaviours that differ: " + (", ".join(changed) if changed else "none (config or capacity differs)"))

    sa, sb = queries.summary(run_a), queries.summary(run_b)
    # (label, key, formatter, higher_is_better)
    ROWS = [
        ("Token hit rate", "prefix_cache_hit_rate", ui.pct, True), ("Block hit rate", "block_hit_rate", ui.pct, True),
        ("TTFT p50", "p50_ttft_ms", ui.ms, False), ("TTFT p99", "p99_ttft_ms", ui.ms, False),
        ("ITL p50", "p50_itl_ms", ui.ms, False), ("ITL p99", "p99_itl_ms", ui.ms, False),
        ("Evictions", "evictions", ui.count, False), ("CoW copies", "cow_copies", ui.count, None),
        ("Stale hashes", "stale_hashes", ui.count, False), ("Divergent outputs", "divergent_outputs", ui.count, False),
    ]
    cols = st.columns(5)
    for i, (name, key, fmt, better) in enumerate(ROWS):
        va, vb = sa.get(key), sb.get(key)
        delta, d = None, 0.0
        if isinstance(va, (int, float)) and isinstance(vb, (int, float)):
            d = vb - va
            delta = (f"{100 * d:+.1f} pp" if fmt is ui.pct else f"{d:+.1f} ms" if fmt is ui.ms else f"{int(d):+,}")
        colour: Literal["off", "normal", "inverse"] = (
            "off" if better is None or d == 0 else ("normal" if better else "inverse"))
        cols[i % 5].metric(f"{name} (B)", fmt(vb), delta=delta, delta_color=colour,
                           delta_arrow="auto" if d else "off", help=f"A: {fmt(va)}")
    st.caption("B's value with its change from A; green means better, red worse (lower is better for latency, "
               "evictions and errors).")

    w = queries.window_ns(run_a)  # both runs on A's windows
    ha = queries.call("hit_rate_over_time", run_a, window_ns=w, group=queries.GROUP_ALL)
    hb = queries.call("hit_rate_over_time", run_b, window_ns=w, group=queries.GROUP_ALL)
    ui.chart(charts.overlay([(f"A {a.get('name')}", ha), (f"B {b.get('name')}", hb)], "window_start_ns", "cum_hit_rate",
                            "Cumulative token hit rate, A vs B", "hit rate", percent=True),
             "Cumulative token hit rate (all groups) of both runs on the same virtual time axis.",
             empty_what="Neither run has lookup spans.", key="cmp_hit")
    ia, ib = (queries.call("itl_over_time", r, window_ns=w) for r in (run_a, run_b))
    ui.chart(charts.overlay([(f"A {a.get('name')}", ia), (f"B {b.get('name')}", ib)], "window_start_ns", "mean_itl_ns",
                            "Mean ITL, A vs B", "ms", yscale=1e6),
             "Gap-weighted mean inter-token latency per window for both runs.",
             empty_what="Neither run decoded tokens.", key="cmp_itl")

    diff = queries.request_diff(run_a, run_b)
    if diff.height and not (diff["hit_delta"] != 0).any():
        st.info(f"All {diff.height:,} requests got the same hit tokens in A and B: this change does not move the "
                "prefix cache on this trace.", icon=":material/info:")
        return
    ui.chart(charts.request_delta(diff),
             "Hit tokens of each request in B minus in A: green bars gained cache hits, red bars lost them.",
             empty_what="The two runs share no request ids.",
             command="the same trace with the same request ids, e.g. "
                     "`kvtrace replay TRACE --db PATH --without shared-prefix-pinning`",
             key="cmp_req")
    if diff.height:
        moved = (diff.with_columns(pl.col("hit_delta").abs().alias("abs_delta"))
                 .sort(["abs_delta", "request_id"], descending=[True, False]))
        ui.table(moved.filter(pl.col("abs_delta") > 0).drop("abs_delta").head(50),
                 "The requests whose hit tokens changed most between A and B (top 50).",
                 empty_what="No request changed its hit tokens between A and B.",
                 command="a B run with another behaviour or capacity (pick it above)")


main()  # a function, so an empty state can return early (st.stop would also skip the sidebar links)
