"""Time every dashboard page (Streamlit AppTest) and every store query behind it, on a store
of >= 10M spans. Budgets: each page renders in < 3 s, each query runs in < 1 s.

    .venv/bin/python bench/dashboard_pages.py [--spans 10000000] [--db /tmp/kvtrace-bench-dashboard.duckdb] [--rebuild]

The store holds two runs of the same synthetic trace (tests/support/synthetic_spans, the store's
generator): A with --spans (10M by default; every page shows it) and B with --b-spans
(another seed), written through the real writer, so the Compare page has an A/B. Pages
are timed cold (st.cache_data cleared: every query hits DuckDB) and warm (served from the
cache, as after the first view); queries are timed inside the cold render, as the page
issues them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import polars as pl
import streamlit as st
from streamlit.testing.v1 import AppTest

from kvtrace.dashboard import DB_ENV, queries
from kvtrace.store import read
from kvtrace.store.writer import Store

PAGE_BUDGET_S = 3.0
QUERY_BUDGET_S = 1.0
APP = str(HERE.parent / "kvtrace" / "dashboard" / "app.py")
PAGES = ["overview", "hit_rate", "evictions", "stale", "latency", "capacity", "compare"]
TRACE_DIGEST = "bench-synth"


def summary_from_store(db: str, run_id: str) -> dict:
    """The headline numbers a replay would write, computed here through the read API (the
    store's metrics are the one definition's: kvtrace.metrics)."""
    reqs = read.requests(db, run_id)
    counts = dict(read.span_counts(db, run_id).select("name", "blocks").iter_rows())
    spans = dict(read.span_counts(db, run_id).select("name", "spans").iter_rows())
    return dict(
        requests=reqs.height, prompt_tokens=int(reqs["num_prompt_tokens"].sum()),
        **{k: v for k, v in read.hit_counters(db, run_id).items() if k != "requests"},
        **read.latency_summary(db, run_id),
        publishes=spans.get("kvtrace.cache.publish", 0), evictions=counts.get("kvtrace.cache.evict", 0),
        cow_copies=spans.get("kvtrace.cache.cow", 0), stale_hashes=spans.get("kvtrace.verify.stale_hash", 0),
        divergent_outputs=spans.get("kvtrace.verify.divergent_output", 0), preemptions=0,
        virtual_duration_s=float(reqs["finish_ns"].max()) / 1e9,
    )


def build(db: Path, num_spans: int, b_spans: int) -> None:
    from tests.support.synthetic_spans import fill_store

    for p in (db, Path(f"{db}.wal")):
        p.unlink(missing_ok=True)
    t0 = time.perf_counter()
    for name, seed, behaviours, spans in (("bench-on", 7, ["a", "b", "c"], num_spans),
                                          ("bench-without-c", 8, ["a", "b"], b_spans)):
        store = Store.open(db, flush_rows=400_000, flush_interval_s=1e9)
        run_id = store.create_run(name, created="2026-01-01T00:00:00Z", trace_source="tests/support/synthetic_spans",
                                  trace_digest=TRACE_DIGEST, mode="engine", behaviours=behaviours,
                                  config={"cache": {"groups": [{"type": "FullAttentionSpec"}, {"type": "MambaSpec"}]}})
        n = fill_store(store, run_id, spans, seed=seed)
        store.flush()
        summary = summary_from_store(str(db), run_id)
        store.finish_run(run_id, digest=f"bench-{seed}", summary=summary)
        store.close()
        print(f"built {name}: {n:,} spans ({time.perf_counter() - t0:.0f} s so far)")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spans", type=int, default=10_000_000, help="spans of run A, the run every page shows")
    ap.add_argument("--b-spans", type=int, default=2_000_000, help="spans of run B (Compare's other side)")
    ap.add_argument("--db", type=Path, default=Path("/tmp/kvtrace-bench-dashboard.duckdb"))
    ap.add_argument("--rebuild", action="store_true")
    args = ap.parse_args()
    if args.rebuild or not args.db.exists():
        build(args.db, args.spans, args.b_spans)
    db = str(args.db)
    runs = read.runs(db).sort("name")
    total = int(runs["num_spans"].sum())
    big = runs.sort("num_spans", descending=True).row(0, named=True)
    other = runs.filter(pl.col("run_id") != big["run_id"])["run_id"][0]
    print(f"store {db}: {total:,} spans in {runs.height} runs; "
          f"pages show run {big['run_id']} ({big['num_spans']:,} spans)")

    # Time every read call the pages make (they all go through queries._READS or read.runs).
    timings: list[tuple[str, str, float]] = []
    current = {"page": ""}

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            desc = name + "(" + ", ".join([repr(x) for x in a[2:]] + [f"{kk}={vv!r}" for kk, vv in k.items()]) + ")"
            timings.append((current["page"], desc, time.perf_counter() - t))
            return out
        return wrapper

    for name, fn in list(queries._READS.items()):
        queries._READS[name] = timed(name, fn)
    for name in ("runs", "run", "requests", "per_request_hits"):  # called directly by queries' own caches
        setattr(read, name, timed(name, getattr(read, name)))

    os.environ[DB_ENV] = db
    page_rows = []
    for page in PAGES:
        params = {"run": big["run_id"], "b": other}
        at = AppTest.from_file(APP, default_timeout=120)
        for k, v in params.items():
            at.query_params[k] = v
        current["page"] = "(entry)"
        st.cache_data.clear()
        at.run()
        if page != "overview":
            at.switch_page(f"views/{page}.py")
        st.cache_data.clear()
        current["page"] = page
        t = time.perf_counter()
        at.run()
        cold = time.perf_counter() - t
        t = time.perf_counter()
        at.run()
        warm = time.perf_counter() - t
        problems = [e.value for e in at.exception] + [e.value for e in at.error]
        page_rows.append((page, cold, warm, len(at.get("plotly_chart")), problems))

    print(f"\n{'page':12s} {'cold s':>8s} {'warm s':>8s} {'charts':>6s}  budget {PAGE_BUDGET_S:.0f} s")
    for page, cold, warm, charts, problems in page_rows:
        flag = "" if cold < PAGE_BUDGET_S else "  OVER BUDGET"
        print(f"{page:12s} {cold:8.2f} {warm:8.2f} {charts:6d}{flag}" + (f"  ERRORS: {problems}" if problems else ""))

    print(f"\n{'page':10s} {'query':78s} {'s':>7s}  budget {QUERY_BUDGET_S:.0f} s")
    per_page = defaultdict(list)
    for page, desc, dt in timings:
        if page in PAGES:
            per_page[page].append((desc, dt))
    worst = 0.0
    for page in PAGES:
        for desc, dt in per_page[page]:
            worst = max(worst, dt)
            flag = "" if dt < QUERY_BUDGET_S else "  OVER BUDGET"
            print(f"{page:10s} {desc[:78]:78s} {dt:7.3f}{flag}")
    print(f"\nslowest page (cold): {max(r[1] for r in page_rows):.2f} s; slowest query: {worst:.3f} s")
    ok = all(r[1] < PAGE_BUDGET_S and not r[4] for r in page_rows) and worst < QUERY_BUDGET_S
    print("within budget" if ok else "OVER BUDGET")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
