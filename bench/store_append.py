"""Writer throughput: Store.append_spans + flush of pre-built Arrow batches (the exporter's path).

    .venv/bin/python bench/store_append.py [--spans 2000000] [--flush-rows 200000]

Batches are the heavy mix of tests/support/synthetic_spans (realistic span mix, all
families, spans made by kvtrace's own SpanBatchBuilder), each appended as one mixed
table, built before the clock starts, so the figure is the store alone: family split,
Arrow scan, commit, open/close per flush. Also prints the per-family rate for
homogeneous batches.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.compute as pc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvtrace.store import Store
from tests.support.synthetic_spans import SPANS_PER_STEP, HeavyMix, span_batches


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spans", type=int, default=2_000_000)
    ap.add_argument("--flush-rows", type=int, default=200_000)
    args = ap.parse_args()
    mix = HeavyMix(3)
    steps = 4000
    batches = [b.table for i in range(max(1, args.spans // (steps * SPANS_PER_STEP)))
               for b in span_batches(mix.steps(i * steps, steps), seed=3, flush_spans=1 << 62)]
    total = sum(b.num_rows for b in batches)
    with tempfile.TemporaryDirectory() as tmp:
        store = Store.open(Path(tmp) / "append.duckdb", flush_rows=args.flush_rows, flush_interval_s=1e9)
        run_id = store.create_run("append-bench")
        t = time.perf_counter()
        for b in batches:
            store.append_spans(b, run_id=run_id)
        store.flush()
        dt = time.perf_counter() - t
        print(f"mixed: {total:,} spans in {dt:.2f} s = {total / dt:,.0f} spans/s "
              f"(flush_rows={args.flush_rows:,}, {len(batches)} batches of ~{batches[0].num_rows:,})")
        t = time.perf_counter()
        store.finish_run(run_id)
        print(f"finish_run (derived tables): {time.perf_counter() - t:.2f} s")
        sample = batches[0]
        for name in ("kvtrace.cache.publish", "kvtrace.cache.evict", "kvtrace.cache.lookup",
                     "kvtrace.engine.step", "kvtrace.request"):
            part = sample.filter(pc.equal(sample.column("name"), name))
            part = part.select([c for c in part.column_names if part.column(c).null_count < part.num_rows])
            rid = store.create_run(f"family {name}")
            t = time.perf_counter()
            for _ in range(3):
                store.append_spans(part, run_id=rid)
                store.flush()
            dt = time.perf_counter() - t
            print(f"  {name:28s} {3 * part.num_rows / dt:>12,.0f} spans/s ({part.num_rows:,} rows per flush)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
