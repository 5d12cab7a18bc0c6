"""Read API: polars frames for the dashboard, notebooks, comparison and the CLI.

Every function takes the database path first and opens a short-lived read-only
connection (retrying while a writer commits), so it works on a store a replay is
writing. Values (run ids, hashes, windows, limits, group ids, bin counts) reach SQL only
as bound parameters; ``_sql.py`` says exactly what goes into the SQL text. Times are
integer nanoseconds (virtual for replays). ``window_ns=None`` picks ``nice_window`` over
the run's time extent (about ``DEFAULT_WINDOWS`` windows). Finished runs read the
derived tables ``finish_run`` materialised; running runs compute the same SQL on the fly,
so both answer alike. A bad run id raises ``UnknownRunError`` (a one-line ``KVTraceError``);
a finished run whose derived rows are not what finish_run wrote (missing beside its spans,
NULL or negative counts) a ``StoreError`` naming the store, the run and the table, from every
function that reads them (DuckDB stores: ``_sql.check_derived``).

Runs (``runs.py``)
    runs(db)                                    every run, newest first, effective status
    run(db, run_id)                             one run as a dict, JSON fields parsed
    span_counts(db, run_id)                     spans and blocks per span name
    run_summary(db, run_id)                     a finished run's stored summary, else its spans' (``summary.py``)
    summary_from_spans(db, run_id)              those keys from the spans alone
    summary_with_spans(db, run_id, stored)      run_summary's rule on a summary already read
    finished_summary(stored)                    whether a stored summary is a finished run's
Hits (``hits.py``; every counter and rate defined once, in ``kvtrace.metrics``)
    hit_counters(db, run_id, start_ns, end_ns)  vLLM's hit counters and rates over a time range
    hit_counters_over_time(db, run_id, window_ns)      the same per window, and cumulative
    group_hit_rates(db, run_id)                 per-KV-group hit rate (its own metric, not the request's)
    group_hit_rate_over_time(db, run_id, window_ns)    the same per window, and cumulative
    usage_over_time(db, run_id, window_ns)      block-pool usage per group, queue depths
    per_prefix_reuse(db, run_id, top)           the hottest prefixes (root hashes) by lookups
    prefix_families(db, run_id, root_hashes)    a prefix's first request, prompt length, longest hit
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
    request_extent(db, run_id)                  first arrival, last finish and count of the finished requests
    per_request_hits(db, run_id)                prompt, hit and computed tokens and TTFT per request
    itl_gaps(db, run_id, request_id)            every inter-token gap
    latency_samples(db, run_id, metric)         samples of ttft | tpot | itl | e2el | queue (ns)
    latency_stats(db, run_id, metric, percentiles)     vllm bench serve's mean/median/std/pNN (ms)
    latency_summary(db, run_id, percentiles)    the same for every metric (the summary's fields)
    latency_percentiles(db, run_id, metric, qs) exact percentiles (0..100) in ns
    latency_cdf(db, run_id, metric)             percentiles 0, 0.1, ..., 100 (the CDF charts)
    latency_histogram(db, run_id, metric, bins) linear-bin histogram, exact counts
    itl_over_time(db, run_id, window_ns)        ITL per window of token time: mean, p50, p99, max
    request_waterfall(db, run_id, request_id)   one request's queue, prefill, decode and cache marks
    request_span_count(db, run_id, request_id)  the spans naming one request (finished or not)
A real server's requests (``served.py``)
    served_requests(db, run_id)                 vLLM's llm_request spans: tokens and latency breakdown
Capacity (``capacity.py``)
    curves(db)                                  every recorded capacity-curve point
    capacity_marks(db, trace_digest)            a trace's complete runs: capacity and hit rate
Helpers
    nice_window(span_ns, windows)               the round window length every windowed view uses
    one_snapshot(db)                            a context in which every read of db sees one committed state
"""

from kvtrace.store.read._sql import DB, DEFAULT_WINDOWS, nice_window, one_snapshot
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
    group_hit_rate_over_time,
    group_hit_rates,
    hit_counters,
    hit_counters_over_time,
    per_prefix_reuse,
    prefix_families,
    usage_over_time,
)
from kvtrace.store.read.latency import (
    itl_gaps,
    itl_over_time,
    latency_cdf,
    latency_histogram,
    latency_percentiles,
    latency_samples,
    latency_stats,
    latency_summary,
    per_request_hits,
    request_extent,
    request_span_count,
    request_waterfall,
    requests,
)
from kvtrace.store.read.runs import run, runs, span_counts
from kvtrace.store.read.served import served_requests
from kvtrace.store.read.summary import finished_summary, run_summary, summary_from_spans, summary_with_spans

__all__ = [
    "DB", "DEFAULT_WINDOWS",
    "block_histograms", "capacity_marks", "curves", "divergent_outputs", "eviction_attribution",
    "eviction_attribution_flows", "evictions_by_publish_kind", "evictions_by_reason", "evictions_over_time",
    "finished_summary",
    "group_hit_rate_over_time", "group_hit_rates", "hit_counters", "hit_counters_over_time", "itl_gaps",
    "itl_over_time", "latency_cdf", "latency_histogram", "latency_percentiles", "latency_samples", "latency_stats",
    "latency_summary",
    "nice_window", "one_snapshot", "per_prefix_reuse", "per_request_hits", "prefix_families", "request_extent",
    "request_span_count",
    "request_waterfall",
    "requests",
    "run", "run_summary", "runs",
    "served_requests",
    "span_counts", "stale_hash_chain", "stale_hashes", "stale_hashes_over_time", "summary_from_spans",
    "summary_with_spans",
    "usage_over_time",
]
