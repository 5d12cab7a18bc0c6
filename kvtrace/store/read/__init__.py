"""Read API: polars frames for the dashboard, notebooks, comparison and the CLI.

Every function takes the database path first and opens a short-lived read-only
connection (retrying while a writer commits), so it works on a store a replay is
writing. Values (run ids, hashes, windows, limits, group ids, bin counts) reach SQL only
as bound parameters; ``_sql.py`` says exactly what goes into the SQL text. Times are
integer nanoseconds (virtual for replays). ``window_ns=None`` picks ``nice_window`` over
the run's time extent (about ``DEFAULT_WINDOWS`` windows). Finished runs read the
derived tables ``finish_run`` materialised; running runs compute the same SQL on the fly,
so both answer alike. A bad run id raises ``UnknownRunError`` (a one-line ``KVTraceError``).

Runs (``runs.py``)
    runs(db)                                    every run, newest first, effective status
    run(db, run_id)                             one run as a dict, JSON fields parsed
    span_counts(db, run_id)                     spans and blocks per span name
Hits (``hits.py``)
    hit_rate_over_time(db, run_id, window_ns, group)   windowed and cumulative hit rate per group
    hit_token_sources(db, run_id, window_ns)    prompt tokens from local cache, external tier, computed
    usage_over_time(db, run_id, window_ns)      block-pool usage per group, queue depths
    per_prefix_reuse(db, run_id, top)           the hottest prefixes (root hashes) by lookups
Evictions (``evictions.py``)
    evictions_over_time(db, run_id, window_ns, by)     evicted blocks per window by reason or publish kind
    evictions_by_reason(db, run_id)             evicted blocks and spans per reason
    evictions_by_publish_kind(db, run_id)       evicted blocks per kind of the publish that took their place
    eviction_attribution(db, run_id, limit)     each attributable miss -> its eviction -> the next publish
    eviction_attribution_flows(db, run_id, top_prefixes)   the same folded into Sankey flows
    block_histograms(db, run_id, bins)          block lifetime, idle-before-evict, prefix reuse gap
Correctness (``chain.py``)
    stale_hashes_over_time(db, run_id, window_ns)      stale hashes found / left, divergent outputs per window
    stale_hashes(db, run_id)                    every stale hash found
    divergent_outputs(db, run_id)               every divergent output token
    stale_hash_chain(db, run_id, block_hash, group_id)  the spans that explain one stale hash
Requests and latency (``latency.py``)
    requests(db, run_id)                        one row per finished request
    per_request_hits(db, run_id)                prompt, hit and computed tokens and TTFT per request
    itl_gaps(db, run_id, request_id)            every inter-token gap
    latency_cdf(db, run_id, metric)             exact quantile grid of ttft | e2e | queue | itl
    latency_percentiles(db, run_id, metric, qs) percentiles from that grid
    latency_histogram(db, run_id, metric, bins) linear-bin histogram from that grid
    itl_over_time(db, run_id, window_ns)        ITL per window of first-token time
    request_waterfall(db, run_id, request_id)   one request's queue, prefill, decode and cache marks
A real server's requests (``served.py``)
    served_requests(db, run_id)                 vLLM's llm_request spans: tokens and latency breakdown
Capacity (``capacity.py``)
    curves(db)                                  every recorded capacity-curve point
    capacity_marks(db, trace_digest)            a trace's complete runs: capacity and hit rate
Helpers
    nice_window(span_ns, windows)               the round window length every windowed view uses
"""

from kvtrace.store.read._sql import DB, DEFAULT_WINDOWS, nice_window
from kvtrace.store.read.capacity import capacity_marks, curves
from kvtrace.store.read.chain import divergent_outputs, stale_hash_chain, stale_hashes, stale_hashes_over_time
from kvtrace.store.read.evictions import (
    block_histograms,
    eviction_attribution,
    eviction_attribution_flows,
    evictions_by_publish_kind,
    evictions_by_reason,
    evictions_over_time,
)
from kvtrace.store.read.hits import (
    OVERALL_GROUP,
    hit_rate_over_time,
    hit_token_sources,
    per_prefix_reuse,
    usage_over_time,
)
from kvtrace.store.read.latency import (
    QUANTILE_GRID,
    itl_gaps,
    itl_over_time,
    latency_cdf,
    latency_histogram,
    latency_percentiles,
    per_request_hits,
    request_waterfall,
    requests,
)
from kvtrace.store.read.runs import run, runs, span_counts
from kvtrace.store.read.served import served_requests

__all__ = [
    "DB", "DEFAULT_WINDOWS", "OVERALL_GROUP", "QUANTILE_GRID",
    "block_histograms", "capacity_marks", "curves", "divergent_outputs", "eviction_attribution",
    "eviction_attribution_flows",
    "evictions_by_publish_kind", "evictions_by_reason", "evictions_over_time", "hit_rate_over_time",
    "hit_token_sources", "itl_gaps", "itl_over_time", "latency_cdf", "latency_histogram", "latency_percentiles",
    "nice_window", "per_prefix_reuse", "per_request_hits", "request_waterfall", "requests", "run", "runs",
    "served_requests",
    "span_counts", "stale_hash_chain", "stale_hashes", "stale_hashes_over_time", "usage_over_time",
]
