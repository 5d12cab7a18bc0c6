"""Capacity: hit rate against cache size (``kvtrace curve``), with the store's runs of
the same trace marked at their own capacity."""

import polars as pl
import streamlit as st

from kvtrace import metrics
from kvtrace.dashboard import charts, queries, state, ui


def main() -> None:
    ctx = queries.context()
    run_id = ctx["run_id"]
    st.title("Capacity")
    FILL_CURVE = "`kvtrace curve TRACE --db PATH` (the trace of the run you study)"

    points = queries.call("curves")
    if points.height == 0:
        # a link's curve named once, then dropped from the URL, as a picker replaces one
        state.warn_unknown("curve", [], "Curve", "it holds none.", "this store")
        st.query_params.pop("curve", None)
        ui.empty("This store holds no capacity curve.", FILL_CURVE)
        return
    curves = points.unique("curve_id", keep="first", maintain_order=True)  # newest first
    labels = {r["curve_id"]: f"{r['trace_source']} · {r['mode']} · {r['created']}"
              for r in curves.iter_rows(named=True)}
    digest = queries.run_row(run_id).get("trace_digest") if run_id is not None else None
    # (a run without a trace digest, e.g. a collected one, has no curve: no comparison with None)
    of_run = curves.filter(pl.col("trace_digest") == digest)["curve_id"].to_list() if digest else []
    newest = "the newest of this run's trace" if of_run else "the newest one"
    state.warn_unknown("curve", curves["curve_id"].to_list(), "Curve", f"{newest} is shown instead.", "this store")
    curve_id = state.bound_select("Curve", curves["curve_id"].to_list(), "curve",
                                  default=of_run[0] if of_run else None, format_func=lambda c: labels.get(c, c))
    if not of_run and run_id is not None:  # (None: a store of curves alone)
        st.info(f"No curve of this run's trace yet; the one shown is another trace's. Make one with {FILL_CURVE}.",
                icon=":material/info:")
    curve = points.filter(pl.col("curve_id") == curve_id)
    meta = curve.row(0, named=True)
    block_size = meta["block_size"]

    marks = queries.capacity_marks(meta["trace_digest"], block_size, run_id) if block_size else []

    # (an engine curve was captioned as a cache-only one: one engine run per capacity, the local cache's hits)
    drawn = (f"Engine-mode token hit rate (the local cache's, prefix_cache_hit_rate) against capacity in "
             f"{block_size}-token blocks: one engine replay per capacity, its full-attention pool's usable blocks."
             if meta["mode"] == "engine" else
             f"Cache-only token hit rate against capacity in {block_size}-token blocks: LRU (exact, one pass of "
             "Mattson's stack algorithm where every request fits, a replay below that), the Belady bound (a replay "
             "per capacity) and the unbounded cache.")
    ui.chart(
        charts.capacity_curve(curve, marks),
        f"{drawn} Markers: this store's runs of the same trace at their own capacity (an engine run's "
        "full-attention capacity, converted to these blocks) and hit rate; the selected run is the diamond.",
        empty_what="This curve has no bounded capacity to plot.", command=FILL_CURVE, key="capacity",
    )
    table = curve.select(
        pl.col("policy"),
        pl.col("capacity_blocks").cast(pl.String).fill_null("unbounded").alias("capacity (blocks)"),
        # (as every table shows a rate, metrics.percent_text: 16 hit tokens in 416,000 read 0.0 here)
        pl.col("prefix_cache_hit_rate").map_elements(metrics.percent_text, return_dtype=pl.String)
        .alias("prefix cache hit rate"),
        pl.col("hit_tokens"), pl.col("prompt_tokens"), pl.col("method"),
    )
    ui.table(table, "Every point of the curve; method: one-pass (exact), replay, or run (an engine run).",
             empty_what="This curve has no points.", command=FILL_CURVE)


main()  # a function, so the empty state can return (st.stop would also skip the sidebar links)
