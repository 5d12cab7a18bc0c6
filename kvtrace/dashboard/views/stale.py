"""Stale hashes & correctness: over time, and a drill-down to the span chain of one."""

import polars as pl
import streamlit as st

from kvtrace.dashboard import charts, queries, state, ui

ctx = queries.context()
run_id = ctx["run_id"]
row_status = queries.run_row(run_id).get("status") or "unfinished"

st.title("Stale hashes & correctness")
window = state.bound_window(queries.window_label(run_id), queries.time_extent_s(run_id))
origin = queries.time_origin(run_id)  # (0 for a replay; a live capture's first time)
FINGERPRINTS = ("expected_fingerprint", "actual_fingerprint")


def _text(value: object) -> str:
    """A span's field as shown: – where it holds none (a sender may leave it out)."""
    return "–" if value is None else str(value)


def _ms(ns: object) -> str:
    return "–" if not isinstance(ns, (int, float)) else f"{(ns - origin) / 1e6:,.3f} ms"


def _since_origin_ms() -> pl.Expr:
    """A table's time_ms: its span's time_ns on the chart's axis, from the run's time origin
    (the tables read raw ns where the chart counted from it)."""
    return ((pl.col("time_ns") - origin) / 1e6).alias("time_ms")

FILL_STALE = ("a run with a behaviour switched off, e.g. "
              "`kvtrace replay TRACE --db PATH --without transient-checkpoint-retention`")
whole = queries.call("stale_hashes_over_time", run_id, window_ns=queries.window_ns(run_id))
over = state.in_window(whole, "window_start_ns", window, origin)
# (a window that leaves the run's stale hashes out said 'the cache stayed correct')
outside = state.outside_window(whole, over, window, "stale hashes or divergent outputs")
# Only a replay that checked block content can tell a correct cache from an unchecked one.
checked = queries.checks_content(run_id)
# Only a finished replay's summary counts stale hashes (its last audit of every cached key ran):
# a killed or running one's has none, and Overview shows – for it, not 0.
audited = isinstance(queries.summary(run_id).get("stale_hashes"), int)
if not checked:
    nothing = ("No stale hashes or divergent outputs recorded: this run checked no block content (cache-only, "
               "`--no-content` or captured), so it cannot tell whether its cache stayed correct.")
    fill_correct = "an engine replay with content (the default), e.g. `kvtrace replay TRACE --db PATH --mode engine`"
elif not audited:
    nothing = (f"No stale hashes or divergent outputs recorded so far: this run is {ui.literal(row_status)}, so the "
               "worker's audit of every cached key at the end of a run never ran, and the cache is not known correct.")
    fill_correct = ui.fill_to_its_end(row_status)
else:
    nothing = "No stale hashes or divergent outputs in this run: the cache stayed correct."
    fill_correct = FILL_STALE
ui.chart(charts.correctness(over),
         "Per window: stale hashes the worker found (a key whose block content is not what its prefix defines), stale "
         "entries the cache left, and output tokens that diverged from the no-cache reference.",
         empty_what=outside or nothing, command=None if outside else fill_correct, key="correctness")

st.subheader("Drill-down")
stale = queries.call("stale_hashes", run_id)
if stale.height == 0:
    # a link from another run: named once, then dropped from the URL (as a picker replaces one)
    state.warn_unknown("stale", [], "Stale hash", "it has none to drill into.")
    st.query_params.pop("stale", None)
    # (a run whose stale keys caused divergent outputs was told to make such a run, with the very
    # switch it was replayed with: a stale key read and evicted between two audits is never one)
    summary = queries.summary(run_id)

    def _count(key: str) -> int:
        value = summary.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    diverged = _count("divergent_outputs")
    if diverged > 0:
        # what the run's own counts show beside the divergence (a run with 16 stale entries left and
        # 190 table disagreements was told its divergence came from stale keys read and evicted
        # between audits, which no count of it shows)
        seen = [f"{ui.count(n)} {what}" for n, what in (
            (_count("stale_hashes_left"), "stale entries the cache left (keys kept on a block whose state was "
                                          "overwritten: `stale_hashes_left`)"),
            (_count("table_disagreements"), "table disagreements (state blocks the Core named that the Worker's "
                                            "table did not hold: `table_disagreements`)")) if n > 0]
        beside = (f" Its counts beside them: {' and '.join(seen)}; the worker's audit found no key whose block "
                  "content is not what its prefix defines." if seen else
                  " It counts no stale entries left and no table disagreements either: a stale key read and then "
                  "evicted between two audits would show only as the divergent outputs it caused.")
        ui.empty(f"No stale hash to drill into in this run: its audits found none, though {ui.count(diverged)} "
                 f"output tokens diverged (below).{beside}", None)
    else:
        ui.empty("No stale hash to drill into in this run.", FILL_STALE)
else:
    # (a sender's span may leave its hash or group out: the key stays one per span, where a
    # NULL in it made every key None, 91 hashes one choice, and the chain a raw type error)
    stale = stale.with_columns(key=pl.concat_str(pl.col("block_hash").fill_null("–"), pl.lit("@g"),
                                                 pl.col("group_id").cast(pl.String).fill_null("–"), pl.lit("#"),
                                                 pl.col("seq").cast(pl.String).fill_null("–")))
    keys = stale["key"].to_list()
    rows = {r["key"]: r for r in stale.iter_rows(named=True)}
    # the default drill-down is a stale hash some request wrote: its chain has a story to tell
    with_request = [k for k in keys if rows[k]["request_id"] is not None]
    state.warn_unknown("stale", keys, "Stale hash", "the first one "
                       + ("a request wrote" if with_request else "found") + " is shown instead.")
    chosen = state.bound_select(
        "Stale hash", keys, "stale", default=with_request[0] if with_request else None,
        format_func=lambda k: f"{rows[k]['request_id'] or 'no request'} · block {_text(rows[k]['block_id'])} · "
                              f"{ui.short_hash(rows[k]['block_hash'])} · t={_ms(rows[k]['time_ns'])}")
    r = rows[chosen]
    c = st.columns(4)
    c[0].metric("Request", ui.literal(r["request_id"] or "–"))  # (a metric's value is markdown)
    c[1].metric("Block id (group)", f"{_text(r['block_id'])} (g{_text(r['group_id'])})")
    c[2].metric("Expected fingerprint", ui.fingerprint(r["expected_fingerprint"]))
    c[3].metric("Actual fingerprint", ui.fingerprint(r["actual_fingerprint"]))
    length = "a prefix of unrecorded length" if r["num_tokens"] is None else f"a {r['num_tokens']:,}-token prefix"
    st.markdown(f"hash {ui.code(_text(r['block_hash']))} · claims {length} · found at {_ms(r['time_ns'])}")
    chain = (queries.call("stale_hash_chain", run_id, r["block_hash"], group_id=r["group_id"])
             if r["block_hash"] is not None else None)  # (no hash recorded: no chain to follow)
    fp = [pl.col(c).map_elements(ui.fingerprint, return_dtype=pl.String) for c in FINGERPRINTS]
    ui.table(None if chain is None else chain.with_columns(_since_origin_ms(), *fp)
             .select("time_ms", "step", "role", "request_id", "group_id", "block_ids", "publish_kind",
                     "evict_reason", "copy_reason", "num_tokens", *FINGERPRINTS, "span_id"),
             "The span chain behind this hash in time order (virtual ms): the publish that keyed the block, the "
             "overwrite (stale entry left / CoW), and the stale hit.",
             empty_what="No spans reference this hash." if chain is not None else
             "This stale hash's span records no block hash, so no chain of spans can be followed to it.")
    st.subheader("Stale hashes")
    ui.table(stale.drop("key").with_columns(_since_origin_ms(), *fp).drop("time_ns"),
             "Every stale hash the worker found in this run (virtual ms; fingerprints as 16 hex digits).",
             empty_what="No stale hashes.")

st.subheader("Divergent outputs")
divergent = queries.call("divergent_outputs", run_id)
if "time_ns" in divergent.columns:  # (in virtual ms, as the stale hashes' table above: one page, one unit)
    divergent = divergent.with_columns(_since_origin_ms()).drop("time_ns")
ui.table(divergent,
         "Every sampled token that differs from the no-cache reference: request, output position, expected and "
         "actual token, and when (virtual ms).",
         empty_what="No divergent outputs in this run.",
         command="a run with a behaviour switched off, e.g. "
                 "`kvtrace replay TRACE --db PATH --without external-hit-running-cow`")
