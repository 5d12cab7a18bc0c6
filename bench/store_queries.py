"""Time every read-API query on a store of 10M spans (the dashboard's budget: < 1 s each).

    .venv/bin/python bench/store_queries.py [--spans 10000000] [--db /tmp/kvtrace-bench-10m.duckdb] [--rebuild]

Builds the store once through the real writer (bulk Arrow appends, then finish_run) and
reuses it on later calls. Prints build figures and one line per query: rows and the
median of 3 wall-clock timings (each opens its own read-only connection, as the dashboard
does).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: tests.support

from kvtrace.store import Store, read
from tests.support.synthetic_spans import fill_store

BUDGET_S = 1.0


def build(db: str | Path, num_spans: int) -> str:
    """A store holding one run of ``num_spans`` synthetic spans, through the real writer
    (any backend ``--db`` names: a DuckDB file here, ``chdb:DIR`` for clickhouse_store.py)."""
    store = Store.open(db, flush_rows=400_000, flush_interval_s=1e9)
    run_id = store.create_run("bench-10m", trace_source="tests/support/synthetic_spans", mode="engine",
                              config={"spans": num_spans}, behaviours={"all": True}, created="2026-01-01T00:00:00Z")
    t0 = time.perf_counter()
    n = fill_store(store, run_id, num_spans, seed=7)
    t1 = time.perf_counter()
    store.finish_run(run_id, digest="bench", summary={"spans": n})
    t2 = time.perf_counter()
    print(f"build: {n:,} spans appended in {t1 - t0:.1f} s ({n / (t1 - t0):,.0f} spans/s incl. generation); "
          f"finish_run {t2 - t1:.1f} s")
    return run_id


def dashboard_queries(db: str | Path, run_id: str) -> dict:
    """name -> a call of every read the dashboard makes (the same list for every backend)."""
    some_request = read.requests(db, run_id)["request_id"][1000]
    some_hash = read.stale_hashes(db, run_id)["block_hash"][0]
    return {
        "runs": lambda: read.runs(db),
        "run": lambda: read.run(db, run_id),
        "span_counts": lambda: read.span_counts(db, run_id),
        "hit_counters": lambda: read.hit_counters(db, run_id),
        "hit_counters_over_time": lambda: read.hit_counters_over_time(db, run_id),
        "group_hit_rates": lambda: read.group_hit_rates(db, run_id),
        "group_hit_rate_over_time": lambda: read.group_hit_rate_over_time(db, run_id),
        "usage_over_time": lambda: read.usage_over_time(db, run_id),
        "evictions_over_time(reason)": lambda: read.evictions_over_time(db, run_id, by="reason"),
        "evictions_over_time(publish_kind)": lambda: read.evictions_over_time(db, run_id, by="publish_kind"),
        "evictions_by_reason": lambda: read.evictions_by_reason(db, run_id),
        "evictions_by_publish_kind": lambda: read.evictions_by_publish_kind(db, run_id),
        "eviction_attribution": lambda: read.eviction_attribution(db, run_id),
        "eviction_attribution_flows": lambda: read.eviction_attribution_flows(db, run_id),
        "block_histograms": lambda: read.block_histograms(db, run_id),
        "per_prefix_reuse": lambda: read.per_prefix_reuse(db, run_id, top=20),
        "stale_hashes_over_time": lambda: read.stale_hashes_over_time(db, run_id),
        "stale_hashes": lambda: read.stale_hashes(db, run_id),
        "stale_hash_chain": lambda: read.stale_hash_chain(db, run_id, some_hash),
        "divergent_outputs": lambda: read.divergent_outputs(db, run_id),
        "requests": lambda: read.requests(db, run_id),
        "per_request_hits": lambda: read.per_request_hits(db, run_id),
        "latency_cdf(ttft)": lambda: read.latency_cdf(db, run_id, "ttft"),
        "latency_cdf(itl)": lambda: read.latency_cdf(db, run_id, "itl"),
        "latency_percentiles(itl)": lambda: read.latency_percentiles(db, run_id, "itl"),
        "latency_summary": lambda: read.latency_summary(db, run_id),
        "latency_histogram(ttft)": lambda: read.latency_histogram(db, run_id, "ttft"),
        "latency_histogram(itl)": lambda: read.latency_histogram(db, run_id, "itl"),
        "itl_over_time": lambda: read.itl_over_time(db, run_id),
        "itl_gaps(one request)": lambda: read.itl_gaps(db, run_id, some_request),
        "request_waterfall": lambda: read.request_waterfall(db, run_id, some_request),
    }


def time_queries(db: str | Path, run_id: str, repeat: int = 3) -> float:
    """Print rows and the median of ``repeat`` wall-clock (and process CPU) timings per
    query; return the slowest wall-clock median."""
    queries = dashboard_queries(db, run_id)
    spans = int(read.span_counts(db, run_id)["spans"].sum())
    print(f"store: {db} run {run_id}: {spans:,} spans")
    worst = 0.0
    for name, fn in queries.items():
        times, cpus = [], []
        for _ in range(repeat):
            t, c = time.perf_counter(), time.process_time()
            out = fn()
            times.append(time.perf_counter() - t)
            cpus.append(time.process_time() - c)  # the engine's threads included: load-independent
        med = statistics.median(times)
        worst = max(worst, med)
        rows = out.height if hasattr(out, "height") else len(out)
        flag = "" if med < BUDGET_S else "  OVER BUDGET"
        print(f"{name:36s} {rows:>9,} rows  {med * 1000:8.1f} ms  ({statistics.median(cpus) * 1000:7.1f} ms CPU){flag}")
    print(f"slowest query: {worst * 1000:.0f} ms (budget {BUDGET_S * 1000:.0f} ms)")
    return worst


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spans", type=int, default=10_000_000)
    ap.add_argument("--db", type=Path, default=Path("/tmp/kvtrace-bench-10m.duckdb"))
    ap.add_argument("--rebuild", action="store_true")
    args = ap.parse_args()
    if args.rebuild or not args.db.exists():
        for p in (args.db, Path(f"{args.db}.wal")):
            p.unlink(missing_ok=True)
        run_id = build(args.db, args.spans)
        print(f"file {args.db.stat().st_size / 2**20:,.0f} MiB")
    else:
        run_id = read.runs(args.db).filter(pl.col("name") == "bench-10m")["run_id"][0]
    time_queries(args.db, run_id)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
