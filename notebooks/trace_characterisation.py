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

# %% [markdown]
# # Trace characterisation
#
# What a user looks at before choosing a cache capacity: how often blocks are reused and
# how far apart, how the prefix tree fans out, the hit rate against capacity (cache-only
# LRU sweep with the Belady (MIN) bound), and how bursty arrivals are.
#
# Works on any trace kvtrace reads (Mooncake, Bailian, WEKA, Azure, native). By default it
# writes the built-in `mixed` workload to a temporary file and reads it back; the file is
# removed when the kernel stops (`kvtrace generate mixed -o FILE` writes one to keep).
#
# Units: one *block* is one trace hash id (for token-id traces: `block_size` tokens, keys
# chained over the prefix), the same unit the cache-only sweep counts in.

# %% tags=["parameters"]
trace_path = None  # any trace file (or WEKA directory); None: generate `generator` into a temp file
trace_format = None  # None: detect
trace_block_size = None  # tokens per hash id of a Mooncake, Bailian or Azure trace (--trace-block-size: 512, 16, 16)
generator = "mixed"
num_requests = None  # None: the generator's default
limit = None  # read only the first N requests
seed = 0
block_size = 16  # tokens per block for traces given as token ids
capacities = None  # cache-only capacities in blocks; None: a ladder up to the unique-block count
result_path = None  # also write the RESULT json here

# %%
import atexit
import json
import os
import shutil
import tempfile

import numpy as np
import plotly.express as px
import plotly.graph_objects as go
import polars as pl

from kvtrace.errors import ConfigError, KVTraceError, TraceFormatError
from kvtrace.metrics import percent_text, points_text
from kvtrace.numeric import percentiles
from kvtrace.replay.cache_only import MAX_CAPACITY_BLOCKS, as_block_requests, block_keys
from kvtrace.replay.readers import open_trace
from kvtrace.replay.run import RunSpec, run_replay
from kvtrace.workload.lines import AtomicText


def count_parameter(name, value, most=None):
    # (papermill passes what -p parsed: a block_size of 0 was range()'s ValueError, a capacity "x" int()'s)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError("trace_characterisation", name, f"expected an int >= 1, got {value!r:.80}")
    if most is not None and value > most:  # (a capacity past any pool was refused as the CLI's --capacity-blocks)
        raise ConfigError("trace_characterisation", name, f"expected an int from 1 to {most:,}, got {value!r:.80}")
    return value


if isinstance(trace_path, int) and not isinstance(trace_path, bool):
    trace_path = str(trace_path)  # (papermill's -p reads a file named 5 as the int 5)
elif trace_path is not None and not isinstance(trace_path, (str, os.PathLike)):
    raise ConfigError("trace_characterisation", "trace_path", f"expected a trace file path, got {trace_path!r:.80}")
block_size = count_parameter("block_size", block_size)
# (the generator and the replays named their CLI flags: num_requests 0 was "--requests: 0", seed "x" "--seed: x")
num_requests = None if num_requests is None else count_parameter("num_requests", num_requests)
limit = None if limit is None else count_parameter("limit", limit)
if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
    raise ConfigError("trace_characterisation", "seed", f"expected an int from 0 to 2^64 - 1, got {seed!r:.80}")
if trace_block_size is not None:  # (a Mooncake trace of 64-token ids, which the CLI reads with the flag, was refused)
    trace_block_size = count_parameter("trace_block_size", trace_block_size)
if capacities is not None:
    if not isinstance(capacities, (list, tuple)) or not capacities:
        raise ConfigError("trace_characterisation", "capacities",
                          f"expected a non-empty list of capacities in blocks, got {capacities!r:.80}")
    # ascending and distinct: the summary reads the first as the smallest
    capacities = sorted({count_parameter("capacities", c, MAX_CAPACITY_BLOCKS) for c in capacities})

# The RESULT file is checked before any work and written whole or not at all: a plain open() truncated
# a result_path that was the trace itself.
if result_path:
    AtomicText(result_path, [trace_path] if trace_path else []).check()
if trace_block_size is not None:
    # (the reader's refusal named the CLI's --trace-block-size: here it is a parameter)
    from kvtrace.replay.readers import detect_format

    own = "generated" if trace_path is None else trace_format or detect_format(str(trace_path))
    if own in ("generated", "native", "weka"):
        raise ConfigError("trace_characterisation", "trace_block_size",
                          f"{trace_block_size}: a {own} trace carries its own block size; leave trace_block_size None")
generated_dir = None  # the temporary folder of a generated trace
if trace_path is None:
    from kvtrace.replay.generate import write_generated

    # A temporary file, removed with its folder when the kernel stops (a failed cell too): every run
    # without a trace_path left one (and an empty folder behind an unknown generator).
    generated_dir = tempfile.mkdtemp(prefix="kvtrace-nb-")
    atexit.register(shutil.rmtree, generated_dir, ignore_errors=True)
    trace_path = os.path.join(generated_dir, f"{generator}.jsonl")
    try:
        write_generated(generator, trace_path, fmt="native", seed=seed, num_requests=num_requests)
    except ConfigError as err:
        # (the generator names the CLI's words, `generate: workload` and --requests: here they are parameters)
        if err.source == "generate":
            raise ConfigError("trace_characterisation", "generator", err.what) from None
        if err.source == "--requests":
            raise ConfigError("trace_characterisation", "num_requests", f"{err.key}: {err.what}") from None
        raise
try:
    source = open_trace(trace_path, format=trace_format, limit=limit, block_size=trace_block_size)
    requests = list(source)
except TraceFormatError as err:
    # (the reader names the CLI's --trace-block-size, "give it with --trace-block-size": here it is a parameter)
    if "--trace-block-size" not in err.what:
        raise
    raise TraceFormatError(err.path, err.line, err.what.replace("--trace-block-size", "trace_block_size")) from None
if not requests:  # (every chart below needs one; max() of nothing was a raw ValueError)
    raise KVTraceError(f"{trace_path}: no requests to characterise (limit {limit!r})")
print(f"{len(requests)} requests from {trace_path} ({source.format})"
      + (" (a temporary file, removed when this kernel stops)" if generated_dir else ""))

# %% [markdown]
# ## Blocks
# One row per (request, block position): the block's key, its parent key, its arrival.

# %%
# The cache's own block keys (`kvtrace.replay.cache_only`, as the capacity curve and every
# cache-only replay read them): a trace whose ids are not prefix-chained ([1, 2] then [3, 2])
# gets a key per chain, so block 2 after 3 is not block 2 after 1. Hash-id traces keep their
# own block unit; token-id traces are cut into `block_size`-token blocks, chained by content.
sweep_block_size = block_size if any(r.hash_ids is None for r in requests) else None
request_keys = [[int(k) for k in keys] for keys in block_keys(as_block_requests(requests, sweep_block_size)[0])]

rows_req, rows_pos, rows_key, rows_parent, rows_t = [], [], [], [], []
for i, (req, keys) in enumerate(zip(requests, request_keys)):
    rows_req += [i] * len(keys)
    rows_pos += range(len(keys))
    rows_key += keys
    rows_parent += [None] + keys[:-1]  # (null: the root; the cache's keys may be any int64, -1 too)
    rows_t += [req.arrival_ns] * len(keys)
blocks = pl.DataFrame(
    {"request": rows_req, "position": rows_pos, "key": rows_key, "parent": rows_parent, "arrival_ns": rows_t},
    schema={"request": pl.Int64, "position": pl.Int64, "key": pl.Int64, "parent": pl.Int64, "arrival_ns": pl.Int64},
)
unique_blocks = blocks["key"].n_unique()
block_references = blocks.height
# With unbounded capacity every block seen before hits (keys are prefix-chained, so a seen
# block's whole prefix was seen too): 1 - unique/total is the compulsory-miss bound.
reuse_fraction = 1 - unique_blocks / block_references if block_references else 0.0
print(f"{block_references} block references, {unique_blocks} unique; reuse fraction {reuse_fraction:.4f}")

# %% [markdown]
# ## Reuse distribution
# How many requests reference each block, and the time between consecutive references of
# the same block (a block must survive that long in the cache to be hit).

# %%
refs = blocks.group_by("key").agg(pl.len().alias("references"))
reuse_hist = refs.group_by("references").agg(pl.len().alias("blocks")).sort("references")
gaps = (
    blocks.sort(["key", "arrival_ns", "request"])
    .with_columns(gap_ns=pl.col("arrival_ns").diff().over("key"))
    .drop_nulls("gap_ns")
)
# Seconds by numpy's exact division, and kvtrace.numeric's percentile, every view's: polars' division
# by 1e9 and its "linear" quantile each differed from them in the last bit.
gap_s = gaps["gap_ns"].to_numpy() / 1e9
reuse_gap_s = dict(zip(("p50", "p90", "p99"), percentiles(gap_s, (50, 90, 99)), strict=True))
fig = px.bar(reuse_hist, x="references", y="blocks", log_y=True,
             labels={"references": "requests referencing the block", "blocks": "blocks (log scale)"},
             title="Blocks by number of referencing requests")
fig.show()
if gaps.height:
    px.ecdf(x=gap_s, log_x=True, title="Reuse gap (s) between consecutive references",
            labels={"x": "time between consecutive references of a block (s)"}).show()
print("reuse gap percentiles (s):", reuse_gap_s)

# %% [markdown]
# ## Prefix-tree fan-out
# Each block key is a node whose parent is the previous block of the same prompt. A node's
# fan-out is its number of distinct children: the root's fan-out is the number of distinct
# first blocks (prefix families); a wide node deep in the tree is where prompts diverge.

# %%
edges = blocks.select("parent", "key").unique()
fanout = edges.group_by("parent").agg(pl.len().alias("children"))
root_fanout = int(fanout.filter(pl.col("parent").is_null())["children"].sum())
inner = fanout.filter(pl.col("parent").is_not_null())
depth = blocks.group_by("key").agg(pl.col("position").min().alias("depth"))
inner = inner.join(depth, left_on="parent", right_on="key", how="left")
max_fanout = int(inner["children"].max()) if inner.height else 0
branching_nodes = int(inner.filter(pl.col("children") > 1).height)
by_depth = (
    inner.group_by("depth")
    .agg(pl.col("children").mean().alias("mean_children"), pl.col("children").max().alias("max_children"))
    .sort("depth")
)
px.line(by_depth.rename({"mean_children": "mean children", "max_children": "most children"}), x="depth",
        y=["mean children", "most children"], log_y=True,
        labels={"depth": "depth (block position in the prompt)", "value": "children per node (log scale)",
                "variable": ""},
        title="Prefix-tree fan-out by depth (block position)").show()
print(f"root fan-out {root_fanout}, max inner fan-out {max_fanout}, branching nodes {branching_nodes}")

# %% [markdown]
# ## Hit rate against capacity
# Cache-only replays (requests in order, no scheduler) with LRU and the offline-optimal
# Belady policy at each capacity: the gap between the curves is the headroom any eviction
# policy could win; the flat end is the reuse bound above.

# %%
if capacities is None:
    top = unique_blocks + max(map(len, request_keys))  # everything fits
    capacities = sorted({max(2, round(top * f)) for f in (0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75)} | {top})
sweep_rows = []
for cap in capacities:
    for policy in ("lru", "belady"):
        spec = RunSpec(trace=str(trace_path), mode="cache-only", policy=policy, capacity_blocks=cap,
                       block_size=sweep_block_size, trace_format=trace_format, trace_block_size=trace_block_size,
                       limit=limit, seed=seed)
        s = run_replay(spec).summary
        sweep_rows.append({"capacity_blocks": cap, "policy": policy,
                           "prefix_cache_hit_rate": s["prefix_cache_hit_rate"],
                           "block_hit_rate": s["block_hit_rate"], "evictions": s["evictions"]})
sweep = pl.DataFrame(sweep_rows)
fig = px.line(sweep, x="capacity_blocks", y="prefix_cache_hit_rate", color="policy", markers=True,
              labels={"capacity_blocks": "cache capacity (blocks)", "prefix_cache_hit_rate": "prefix cache hit rate",
                      "policy": "eviction policy"},
              title="Token hit rate against capacity (cache-only): LRU and the Belady bound")
fig.add_hline(y=reuse_fraction, line_dash="dot", annotation_text="reuse bound (blocks)")
fig.show()
sweep

# %% [markdown]
# ## Arrival burstiness
# The coefficient of variation of inter-arrival times is 1 for Poisson arrivals; above 1
# arrivals come in bursts. The index of dispersion (variance/mean of counts per window)
# over growing windows shows at which time scale the bursts live.

# %%
arrivals_s = np.array([r.arrival_ns for r in requests], dtype=np.float64) / 1e9
inter = np.diff(arrivals_s)
interarrival_cv = float(inter.std() / inter.mean()) if inter.size and inter.mean() > 0 else None
span_s = float(arrivals_s[-1] - arrivals_s[0]) if arrivals_s.size else 0.0
dispersion = []
for window_s in (0.1, 1.0, 10.0, 60.0):
    if span_s < 2 * window_s:
        continue
    # The arrivals of each window that holds some, and how many windows there are: the empty ones
    # count 0 each (a count per window of the span was 4e10 windows, 298 GiB, for two arrivals 4e18 ns apart).
    index = ((arrivals_s - arrivals_s[0]) // window_s).astype(np.int64)
    windows = int(index.max()) + 1
    counts = np.unique(index, return_counts=True)[1]
    mean = arrivals_s.size / windows
    variance = (float(((counts - mean) ** 2).sum()) + (windows - counts.size) * mean**2) / windows
    if mean > 0:
        dispersion.append({"window_s": window_s, "index_of_dispersion": variance / mean})
dispersion = pl.DataFrame(dispersion, schema={"window_s": pl.Float64, "index_of_dispersion": pl.Float64})
win = max(span_s / 60, 1e-3)
per_window = np.bincount(((arrivals_s - arrivals_s[0]) // win).astype(np.int64)) if arrivals_s.size else np.zeros(0)
go.Figure(go.Bar(x=np.arange(per_window.size) * win, y=per_window)).update_layout(
    title=f"Arrivals per {win:.2f} s window", xaxis_title="time since the first arrival (s)",
    yaxis_title="requests arriving").show()
print(f"inter-arrival CV {interarrival_cv:.3f}, span {span_s:.1f} s" if interarrival_cv is not None else
      f"inter-arrival CV: none (it needs two requests arriving at different times), span {span_s:.1f} s")
if not dispersion.height:
    print(f"index of dispersion: none (the arrivals span {span_s:.1f} s, less than two of the smallest window, 0.1 s)")
dispersion

# %% [markdown]
# ## Summary
# The machine-readable line below is what the tests read.

# %%
lru = sweep.filter(pl.col("policy") == "lru").sort("capacity_blocks")
belady = sweep.filter(pl.col("policy") == "belady").sort("capacity_blocks")
result = {
    "trace": str(trace_path),
    "format": source.format,
    "requests": len(requests),
    "block_references": block_references,
    "unique_blocks": unique_blocks,
    "reuse_fraction": reuse_fraction,
    "reuse_gap_s": reuse_gap_s,
    "root_fanout": root_fanout,
    "max_fanout": max_fanout,
    "branching_nodes": branching_nodes,
    "capacities": capacities,
    "lru_prefix_cache_hit_rate": lru["prefix_cache_hit_rate"].to_list(),
    "belady_prefix_cache_hit_rate": belady["prefix_cache_hit_rate"].to_list(),
    "lru_block_hit_rate": lru["block_hit_rate"].to_list(),
    "belady_block_hit_rate": belady["block_hit_rate"].to_list(),
    "interarrival_cv": interarrival_cv,
    "index_of_dispersion": dict(
        zip(map(str, dispersion["window_s"].to_list()), dispersion["index_of_dispersion"].to_list())
    ),
}
best_lru = max(result["lru_prefix_cache_hit_rate"])


def blocks_text(n):
    return f"{n:,} block" + ("" if n == 1 else "s")  # ("(1 blocks)")


swept = blocks_text(capacities[0]) if len(capacities) == 1 else f"{capacities[0]:,} to {blocks_text(capacities[-1])}"
if best_lru > 0:
    knee = next(c for c, h in zip(capacities, result["lru_prefix_cache_hit_rate"]) if h >= 0.9 * best_lru)
    best_at = capacities[result["lru_prefix_cache_hit_rate"].index(best_lru)]
    # (the best of the capacities swept, which a user's list may stop short of the unbounded cache's:
    # "90% of its best hit rate at 100 blocks" was said of 10.4% where the trace reaches 79.3%).
    # A cache of the trace's unique blocks holds every one: no eviction, the reuse bound reached
    # (it said "stop short of 5,228 blocks ... LRU may hit more" at 5,000, above the 4,462 unique).
    print(f"LRU reaches 90% of the highest hit rate swept ({percent_text(best_lru)}, at {blocks_text(best_at)}) at "
          f"{blocks_text(knee)}" + ("; every unique block fits there: no capacity hits more"
                                    if best_at >= unique_blocks else
                                    "" if capacities[-1] >= unique_blocks else
                                    f"; the capacities swept stop short of {unique_blocks:,} blocks (the trace's "
                                    "unique blocks), where every block fits and LRU may hit more"))
else:  # (90% of a best of 0 was reached at the smallest capacity: a knee where nothing hits)
    why = "no block is referenced twice" if reuse_fraction == 0 else "no reused block stays cached that long"
    print(f"LRU hits nothing at any capacity swept ({swept}): {why}")
# (a change of a rate, in percentage points as every view shows one: it printed the fractions' difference, +0.0000)
print(f"Belady headroom at the smallest capacity ({blocks_text(capacities[0])}): "
      f"{points_text(result['belady_prefix_cache_hit_rate'][0] - result['lru_prefix_cache_hit_rate'][0])}")
if result_path:
    with AtomicText(result_path, [trace_path]) as fh:
        fh.write(json.dumps(result, indent=2).encode())
print("RESULT " + json.dumps(result, sort_keys=True))
