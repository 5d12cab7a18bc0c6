# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %%

# %% [markdown]
# # Regression analysis: one trace, two runs
#
# An isolated A/B measurement of a cache-policy change: both runs replay the *same* trace
# deterministically, so every difference below comes from the change alone (the reviews
# behind each behaviour, summarised in `docs/cache_semantics.md`, each end with "the gain
# is not an isolated measurement").
#
# Give a store and two run ids (A = baseline, B = candidate), or leave them empty and give
# a behaviour: the notebook then runs `kvtrace study` into a temporary store, with
# A = the behaviour switched off (old vLLM) and B = on (current vLLM). That store is removed
# when the kernel stops; to keep the runs, make them with `kvtrace study BEHAVIOUR --db FILE`
# and give that store and its two run ids here.
#
# Every metric is defined once, in `kvtrace.metrics`, in vLLM's words: the hit rate is
# vLLM's prefix cache hit rate (each request once, when first scheduled); latencies are
# `vllm bench serve`'s TTFT, TPOT, ITL and E2EL. All latencies are *modelled* times from
# kvtrace's engine clock and its cost model, not measurements.

# %% tags=["parameters"]
db_path = None  # a kvtrace DuckDB store (None: run a study into a temp store)
run_a = None  # baseline run id
run_b = None  # candidate run id
behaviour = "shared-prefix-pinning"  # study mode: the behaviour switched off (A) / on (B)
trace = None  # study mode: trace to replay (None: the generated workload of the behaviour)
trace_block_size = None  # study mode: tokens per hash id of a Mooncake, Bailian or Azure trace (--trace-block-size)
limit = None  # study mode: replay only the first N requests
seed = 0  # study replays and bootstrap resampling
force = False  # compare runs of different traces anyway
result_path = None  # also write the RESULT json here

# %%
import atexit
import json
import math
import os
import shutil
import tempfile

import plotly.express as px
import polars as pl

from kvtrace.compare.model import MetricDelta, metric_direction
from kvtrace.compare.render import backend_note, times_note
from kvtrace.compare.source import diff_runs
from kvtrace.errors import KVTraceError, TraceFormatError
from kvtrace.metrics import is_latency_key, percent_text, points_text, times_word
from kvtrace.names import BEHAVIOURS, plotly_literal, printable
from kvtrace.store import read as store
from kvtrace.workload.lines import AtomicText


def run_id_parameter(name, value):
    # papermill's -p reads a numeric run id (a collector's "12345") as an int
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise KVTraceError(f"{name}: expected a run id (text, see `kvtrace runs`), got {value!r:.80}")


def drawn(frame, *columns):
    """``frame`` with its text ``columns`` (run names, request ids, a sender's reasons) as plotly
    shows text as typed (``names.plotly_literal``): plotly reads a subset of HTML in legends and
    hover labels, and a run named '<b>A</b>' was drawn in bold, '<br>' broke its line."""
    return frame.with_columns(pl.col(c).map_elements(plotly_literal, return_dtype=pl.Utf8) for c in columns)


def int_parameter(name, value, least, most=2**64 - 1):
    # (the study and the diff named their CLI flags: limit 0 was "--limit: 0", seed "x" "--seed: x")
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise KVTraceError(f"{name}: expected an int from {least} to {most:,}, got {value!r:.80}")
    return value


run_a, run_b = run_id_parameter("run_a", run_a), run_id_parameter("run_b", run_b)
if not isinstance(force, bool):  # (papermill's -p force no is the text "no": true, and it forced the diff)
    raise KVTraceError(f"force: expected True or False, got {force!r:.80}")
seed = int_parameter("seed", seed, 0)
limit = None if limit is None else int_parameter("limit", limit, 1)
trace_block_size = None if trace_block_size is None else int_parameter("trace_block_size", trace_block_size, 1)
if isinstance(trace, int) and not isinstance(trace, bool):
    trace = str(trace)  # (papermill's -p reads a file named 5 as the int 5)
if trace is not None and (not isinstance(trace, (str, os.PathLike)) or not os.fspath(trace)):
    # (an empty one ran the study on the behaviour's generated workload, as if none were given)
    raise KVTraceError(f"trace: expected a trace file, a directory of WEKA files or gen:NAME, got {trace!r:.80}")
# the study settings given (behaviour: other than the parameters cell's default, which a store's runs leave alone)
studied = {"trace": trace, "limit": limit, "trace_block_size": trace_block_size,
           "behaviour": None if behaviour == "shared-prefix-pinning" else behaviour}
if db_path is not None and any(v is not None for v in studied.values()):
    # (a store's runs are compared as they are: these study settings were ignored unsaid)
    given = ", ".join(k for k, v in studied.items() if v is not None)
    raise KVTraceError(f"{given}: study settings, for a study without db_path; a store's runs are compared as "
                       "they are")
if trace_block_size is not None and (trace is None or str(trace).startswith("gen:")):
    # (the study's error named its CLI flag: "--trace-block-size: 64: ... drop --trace-block-size")
    raise KVTraceError(f"trace_block_size: {trace_block_size}: {trace or 'the study'}'s workload is generated, "
                       "not a trace file of a format; leave trace_block_size None")
if trace_block_size is not None and os.path.isfile(str(trace)):
    from kvtrace.replay.readers import detect_format

    if detect_format(str(trace)) == "native":  # (its error named --trace-block-size)
        raise KVTraceError(f"trace_block_size: {trace_block_size}: {trace} is a native trace, which carries its "
                           "own block size; leave trace_block_size None")
if (db_path is None) != (run_a is None and run_b is None) or (run_a is None) != (run_b is None):
    # (a study into the given store added 4 runs to it; run ids without a store were ignored)
    raise KVTraceError(f"db_path {db_path!r}, run_a {run_a!r}, run_b {run_b!r}: give a store and both run ids, "
                       "or none of them for a study into a temporary store")
# The RESULT file is checked before any work and written whole or not at all: a plain open() truncated
# a result_path that was the store itself (every run gone) or the study's trace.
result_sources = [p for p in (db_path, trace) if p]
if result_path:
    AtomicText(result_path, result_sources).check()
if db_path is None and behaviour not in BEHAVIOURS:  # (the study's error named itself: "study: unknown behaviour")
    raise KVTraceError(f"behaviour: unknown {behaviour!r:.80}; expected one of {', '.join(BEHAVIOURS)}")
if db_path is None:
    from kvtrace.compare.study import run_study, study_base
    from kvtrace.replay.run import RunSpec

    # A temporary store, removed with its folder when the kernel stops (a failed cell too): every study
    # left its 5 MB store in the temp folder. `kvtrace study BEHAVIOUR --db FILE` makes one to keep.
    study_dir = tempfile.mkdtemp(prefix="kvtrace-nb-")
    atexit.register(shutil.rmtree, study_dir, ignore_errors=True)
    db_path = os.path.join(study_dir, "study.duckdb")
    # (as `kvtrace study --trace-block-size`: a Mooncake trace of 64-token ids was refused at 512 an id)
    try:
        base = study_base(behaviour, RunSpec(trace=trace or "", trace_block_size=trace_block_size))
        study = run_study(behaviour, trace=trace, db=db_path, seed=seed, limit=limit, base=base)
    except TraceFormatError as err:
        # (the reader names the CLI's --trace-block-size, "give it with --trace-block-size": here it is a parameter)
        if "--trace-block-size" not in err.what:
            raise
        raise TraceFormatError(err.path, err.line, err.what.replace("--trace-block-size", "trace_block_size")) from None
    run_a, run_b = study.first.run_off, study.first.run_on
    print(f"study {behaviour} on {study.trace}: A = off ({run_a}), B = on ({run_b}) in {db_path} (a temporary "
          "store, removed when this kernel stops)")

runs = store.runs(db_path).filter(pl.col("run_id").is_in([run_a, run_b]))
label = {r["run_id"]: f"{'A' if r['run_id'] == run_a else 'B'}: {r['name'] or r['run_id']}"
         for r in runs.iter_rows(named=True)}
runs.select(
    [c for c in ("run_id", "name", "trace_source", "mode", "behaviours", "status", "digest") if c in runs.columns]
)

# %% [markdown]
# ## Overall deltas
# Every summary metric, B − A, absolute and relative; then the percentile shifts of TTFT and
# ITL with 95% bootstrap confidence intervals over requests (paired: the same resampled
# requests in both runs).

# %%
try:
    diff = diff_runs(db_path, run_a, run_b, seed=seed, force=force)
except KVTraceError as err:
    # (diff_runs names the CLI's flag, --force, which a notebook has not: here it is the parameter)
    if force or "pass --force" not in str(err):
        raise
    raise KVTraceError(str(err).replace("pass --force", "set force = True (papermill: -p force True)")) from None
# (times a cost model made are "modelled"; a collected run's are its sender's, as diff says)
TIMES = times_word(*((r.get("mode"), r.get("cost_model")) for r in (diff.run_a, diff.run_b)))
deltas = pl.DataFrame(
    [{"metric": m.name, "A": m.a, "B": m.b, "delta": m.delta, "rel": m.rel, "verdict": m.verdict}
     for m in diff.metrics],
    schema={"metric": pl.Utf8, "A": pl.Float64, "B": pl.Float64, "delta": pl.Float64, "rel": pl.Float64,
            "verdict": pl.Utf8},
)
latency = pl.DataFrame(
    [{"percentile": s.name, "A": s.a, "B": s.b, "delta": s.delta, "ci_low": s.ci_low, "ci_high": s.ci_high,
      "significant": s.significant} for s in diff.latency],
    schema={"percentile": pl.Utf8, "A": pl.Float64, "B": pl.Float64, "delta": pl.Float64, "ci_low": pl.Float64,
            "ci_high": pl.Float64, "significant": pl.Boolean},
)
# What `kvtrace diff` says before its tables: unfinished runs, notes, where the times come from,
# whose cache manager made each run's events (where either is not kvtrace's).
for side, r in (("A", diff.run_a), ("B", diff.run_b)):
    if r.get("status") not in (None, "complete"):
        print(f"run {side} ({printable(r.get('name') or r['run_id'])}) is {r['status']}: partial numbers")
for note in diff.notes:
    print(note)
print(times_note(diff, code=printable))
if backend_note(diff, code=printable):
    print(backend_note(diff, code=printable))
rel = deltas.drop_nulls("rel").filter(pl.col("rel") != 0)
if rel.height:
    px.bar(rel, x="rel", y="metric", color="verdict", orientation="h",
           labels={"rel": "relative change, B vs A", "metric": "metric", "verdict": "verdict"},
           title="Relative change B vs A (non-zero metrics)").show()
deltas

# %%
if diff.latency:
    print(f"latency percentiles: {TIMES} times")
else:  # (no times to label: two cache-only runs were called "modelled" under "Times: none (no clock ...)")
    print("no latency percentiles to compare: not both runs have request latencies (a cache-only run has no clock; "
          "a live capture or an empty trace has no requests)")
latency

# %% [markdown]
# ## Hit rate over time
# vLLM's prefix cache hit rate per window of virtual time (each request in the window it
# was first scheduled in), and its cumulative value: where in the trace the two runs part
# ways.

# %%
hr = pl.concat(
    [store.hit_counters_over_time(db_path, r).with_columns(run=pl.lit(label[r])) for r in (run_a, run_b)],
    how="vertical_relaxed",
).with_columns(t_s=pl.col("window_start_ns") / 1e9)
for lbl in dict.fromkeys((label[run_a], label[run_b])):
    if not hr.filter(pl.col("run") == lbl).height:
        print(f"{printable(lbl)}: no request was scheduled in it, so it has no hit rate over time")
hr_long = (hr.rename({"prefix_cache_hit_rate": "per window", "cum_prefix_cache_hit_rate": "cumulative"})
           .unpivot(index=["t_s", "run"], on=["per window", "cumulative"], variable_name="series",
                    value_name="rate"))
if hr.height:
    px.line(drawn(hr_long, "run"), x="t_s", y="rate", color="run", line_dash="series",
            labels={"t_s": "virtual time (s)", "rate": "prefix cache hit rate", "run": "run", "series": "series"},
            title="Prefix cache hit rate per window and cumulative").show()
cum_hit_rate_end = {
    lbl: (lambda f: f["cum_prefix_cache_hit_rate"][-1] if f.height else None)(
        hr.filter(pl.col("run") == lbl).sort("t_s"))
    for lbl in (label[run_a], label[run_b])
}
cum_hit_rate_end

# %% [markdown]
# ## Eviction attribution
# For every miss on a block that was cached before: which eviction removed it and which
# kind of publish took its place. A change that stops one publish kind from evicting hot
# prefixes shows here first. Evictions have no better or worse direction by themselves:
# evicting a stale entry keeps the cache correct.

# %%
attr = pl.concat(
    [store.eviction_attribution(db_path, r).with_columns(run=pl.lit(label[r])) for r in (run_a, run_b)],
    how="diagonal_relaxed",
)
attr = attr.with_columns(pl.col("publish_kind").fill_null("none")) if attr.height else attr
group_cols = ["run", "evict_reason", "publish_kind"]
attribution = (attr.group_by(group_cols).agg(pl.len().alias("misses")).sort(group_cols) if attr.height
               else pl.DataFrame(schema={"run": pl.Utf8, "evict_reason": pl.Utf8, "publish_kind": pl.Utf8,
                                         "misses": pl.UInt32}))
if attribution.height:
    px.bar(drawn(attribution, "run", "publish_kind", "evict_reason"), x="publish_kind", y="misses", color="run",
           barmode="group", hover_data=["evict_reason"],
           labels={"publish_kind": "kind of the publish that took the evicted block (none: no publish)",
                   "misses": "later misses on evicted blocks", "run": "run", "evict_reason": "eviction reason"},
           title="Misses on previously cached blocks, by the kind of publish that took the evicted block").show()
else:
    print("no miss in either run hit a block that had been evicted")
evictions = pl.DataFrame(
    [{"by": "reason", "key": s.key, "A": s.a, "B": s.b, "delta": s.delta} for s in diff.evictions_by_reason]
    + [{"by": "publish kind", "key": s.key, "A": s.a, "B": s.b, "delta": s.delta}
       for s in diff.evictions_by_publish_kind],
    schema={"by": pl.Utf8, "key": pl.Utf8, "A": pl.Int64, "B": pl.Int64, "delta": pl.Int64},
)
attribution_misses = {lbl: int(attribution.filter(pl.col("run") == lbl)["misses"].sum()) for lbl in label.values()}
evictions

# %% [markdown]
# ## Per-request changes
# Cached tokens of each request (local + external hits at its first schedule, vLLM's
# per-request `num_cached_tokens`) in A against B: points above the diagonal gained. The
# table leads with the requests that changed most.

# %%
per_req = (
    store.per_request_hits(db_path, run_a).select("request_id", pl.col("num_cached_tokens").alias("cached_A"))
    .join(store.per_request_hits(db_path, run_b).select("request_id", pl.col("num_cached_tokens").alias("cached_B")),
          on="request_id", how="inner")
    .with_columns(delta=pl.col("cached_B") - pl.col("cached_A"))
    .sort([pl.col("delta").abs(), pl.col("request_id")], descending=[True, False])
)
r = diff.requests
if per_req.height:
    px.scatter(drawn(per_req, "request_id"), x="cached_A", y="cached_B", hover_name="request_id",
               labels={"cached_A": "cached tokens in A", "cached_B": "cached tokens in B"},
               title="Cached tokens per request, A against B").show()
    print(f"{r.gained} requests gained cached tokens (local + external hits, as diff counts them), {r.lost} lost, "
          f"{r.requests - r.gained - r.lost} unchanged "
          f"of {r.requests} common requests (net {r.cached_tokens_delta:+d} tokens)")
else:  # (0 gained, 0 lost, 0 unchanged read as a comparison that found no change)
    print("no request is in both runs with its cached tokens (cache-only runs and live captures record no "
          "request spans): no per-request comparison")
if r.only_a or r.only_b:
    print(f"requests only in A: {r.only_a}, only in B: {r.only_b}")
per_req.head(20)

# %% [markdown]
# ## Latency CDFs
# TTFT per request and every inter-token gap, both runs overlaid (modelled times: the cost
# model's virtual clock, not measurements).

# %%
for metric, what in (("ttft", "requests"), ("itl", "inter-token gaps")):
    cdf = pl.concat(
        [store.latency_cdf(db_path, rid, metric).with_columns(run=pl.lit(label[rid])) for rid in (run_a, run_b)],
        how="vertical_relaxed",
    ).with_columns(value_ms=pl.col("value_ns") / 1e6, fraction=pl.col("q") / 100)
    for lbl in dict.fromkeys((label[run_a], label[run_b])):
        if not cdf.filter(pl.col("run") == lbl).height:
            print(f"{printable(lbl)}: no {metric.upper()} values (no request latencies), no {metric.upper()} CDF")
    if cdf.height:
        px.line(drawn(cdf, "run"), x="value_ms", y="fraction", color="run", log_x=True,
                labels={"value_ms": f"{metric.upper()} (ms, {TIMES})", "fraction": f"fraction of {what} ≤ x",
                        "run": "run"},
                title=f"{metric.upper()} CDF ({TIMES})").show()

# %% [markdown]
# ## Conclusion
# Generated from the numbers above: a count or rate is called better or worse when it
# moved in its preferred direction; a latency percentile only when its bootstrap
# confidence interval excludes 0 (a modelled-time shift inside the noise is no finding).
# Evictions are reported by reason and never called worse: evicting a stale entry is a
# fix, not a loss.

# %%
sig = [s for s in diff.latency if s.significant]
lines = []


def summary_metric(name):
    """The summary metric ``name`` of the diff; a MetricDelta of Nones when neither run has it (diff.metric
    raised: a cache-only run has no stale_hashes, a live capture no hit rate)."""
    return next((m for m in diff.metrics if m.name == name), None) or MetricDelta(name, None, None, None, None)


def count_text(v):
    """A count as every view shows one: with thousands separators (``:g`` printed 1.23457e+06)."""
    return "not measured" if v is None else f"{int(v):,}" if float(v).is_integer() else f"{v:,}"


# A stopped run against a finished one (or runs of other request counts): a count is a sum over
# other requests, and "worse on computed_prompt_tokens" was said of one over fewer. Rates and
# latencies stay comparable; counts are called neither better nor worse.
requests_m = summary_metric("requests")
unfinished = [f"{side} is {r['status']}" for side, r in (("A", diff.run_a), ("B", diff.run_b))
              if r.get("status") not in (None, "complete")]
partial = bool(unfinished) or requests_m.delta not in (None, 0)


def judged(m):
    return not partial or m.name.endswith("_rate") or is_latency_key(m.name)


better = [m for m in diff.metrics if m.verdict == "better" and not is_latency_key(m.name) and judged(m)]
worse = [m for m in diff.metrics if m.verdict == "worse" and not is_latency_key(m.name) and judged(m)]
if partial:
    lines.append(f"A and B did not replay the same requests ({'; '.join(unfinished) or 'other request counts'}: "
                 f"A {count_text(requests_m.a)} requests, B {count_text(requests_m.b)}): their counts, sums over "
                 "other requests, are called neither better nor worse; rates and latencies are.")

hr_m = summary_metric("prefix_cache_hit_rate")
# (a rate in %, its change in pp, as every view shows them: "from 0.1042 to 0.1186 (+1.44 pp" mixed two units)
if hr_m.delta is None:
    a, b = ("none" if v is None else percent_text(v) for v in (hr_m.a, hr_m.b))
    lines.append(f"The prefix cache hit rate is not in both runs (A {a}, B {b}): no hit rate comparison.")
elif hr_m.delta:
    rel_txt = f", {hr_m.rel * 100:+.1f}%" if hr_m.rel is not None else ""
    lines.append(f"B {'raises' if hr_m.delta > 0 else 'lowers'} the prefix cache hit rate from {percent_text(hr_m.a)} "
                 f"to {percent_text(hr_m.b)} ({points_text(hr_m.delta)}{rel_txt}).")
else:
    lines.append(f"The prefix cache hit rate is unchanged at {percent_text(hr_m.a)}.")
for s in sig:
    lines.append(f"{s.name} {'rises' if s.delta > 0 else 'falls'} by {abs(s.delta):.3f} ms ({TIMES}; "
                 f"95% CI [{s.ci_low:+.3f}, {s.ci_high:+.3f}]).")
for name in ("stale_hashes", "divergent_outputs"):
    m = summary_metric(name)
    if (m.a or 0) or (m.b or 0):  # (None: a run that checked no content)
        a, b = (count_text(v) for v in (m.a, m.b))
        lines.append(f"{name}: A {a}, B {b}.")
stale_evictions = next((k for k in diff.evictions_by_reason if k.key == "stale_hash" and k.delta), None)
if stale_evictions is not None:
    lines.append(f"Stale entries evicted: A {count_text(stale_evictions.a)}, "
                 f"B {count_text(stale_evictions.b)} (evicting a stale entry keeps "
                 "the cache correct; it is not a loss).")
kind_shifts = [k for k in diff.evictions_by_publish_kind if k.key != "none" and k.delta]
if kind_shifts:
    k = kind_shifts[0]  # the largest shift (sorted by size of change)
    lines.append(f"Blocks evicted to make room for {k.key} publishes: A {count_text(k.a)}, B {count_text(k.b)}.")
if diff.requests and (diff.requests.gained or diff.requests.lost):
    lines.append(f"{count_text(diff.requests.gained)} requests gained cached tokens (local + external hits) and "
                 f"{count_text(diff.requests.lost)} lost.")
worse_names = {m.name for m in worse} | {s.name for s in sig if s.delta * metric_direction(s.name) < 0}
better_names = {m.name for m in better} | {s.name for s in sig if s.delta * metric_direction(s.name) > 0}
if not worse_names and better_names:
    overall = "B is better than A"
elif worse_names and not better_names:
    overall = "B is worse than A"
elif worse_names:
    overall = "B trades off against A"
else:
    overall = "B and A are indistinguishable"
verdict = f"{overall}: better on {', '.join(sorted(better_names)) or 'nothing'}; " \
          f"worse on {', '.join(sorted(worse_names)) or 'nothing'}. " + " ".join(lines)
definitions = {"a": diff.run_a.get("definitions"), "b": diff.run_b.get("definitions")}
if None not in definitions.values() and definitions["a"] != definitions["b"]:
    # (the verdict judged numbers whose meaning changed between the runs: diff's first note says which)
    verdict += (" Caution: A and B were recorded under different metric definitions, so some of this may be that "
                "alone (the first note above says which numbers changed).")
print(verdict)

# %%
result = {
    "db_path": str(db_path),
    "run_a": run_a,
    "run_b": run_b,
    "same_trace": diff.same_trace,
    "prefix_cache_hit_rate_a": hr_m.a,
    "prefix_cache_hit_rate_b": hr_m.b,
    "prefix_cache_hit_rate_delta": hr_m.delta,
    "prefix_cache_hits_delta": summary_metric("prefix_cache_hits").delta,
    "metrics": {m.name: {"a": m.a, "b": m.b, "delta": m.delta} for m in diff.metrics},
    "latency": {s.name: {"a": s.a, "b": s.b, "delta": s.delta,
                         "ci": [None if math.isnan(v) else v for v in (s.ci_low, s.ci_high)]} for s in diff.latency},
    "requests_gained": diff.requests.gained if diff.requests else None,
    "requests_lost": diff.requests.lost if diff.requests else None,
    "per_request_delta_sum": int(per_req["delta"].sum()) if per_req.height else 0,
    "per_request_first": per_req["request_id"].head(5).to_list(),
    "cum_hit_rate_end": {"a": cum_hit_rate_end[label[run_a]], "b": cum_hit_rate_end[label[run_b]]},
    "evictions_by_reason": {s.key: {"a": s.a, "b": s.b} for s in diff.evictions_by_reason},
    "evictions_by_publish_kind": {s.key: {"a": s.a, "b": s.b} for s in diff.evictions_by_publish_kind},
    "attribution_misses": {"a": attribution_misses.get(label[run_a], 0), "b": attribution_misses.get(label[run_b], 0)},
    "better": sorted(better_names),
    "worse": sorted(worse_names),
    "overall": overall,
    "verdict": verdict,
    "notes": list(diff.notes),
    "definitions": definitions,
}
if result_path:
    with AtomicText(result_path, result_sources) as fh:
        fh.write(json.dumps(result, indent=2).encode())
print("RESULT " + json.dumps(result, sort_keys=True))
