"""Every dashboard query on a 10M-span chdb store (embedded ClickHouse): budget < 1 s each,
as on DuckDB (bench/store_queries.py, whose query list and builder this reuses).

    .venv/bin/python bench/clickhouse_store.py [--spans 10000000] [--dir /tmp/kvtrace-bench-10m.chdb] [--rebuild]

Builds the store once through the real writer (``Store.open("chdb:DIR")``: bulk Arrow
inserts of the one synthetic span generator, tests/support/synthetic_spans, then
``finish_run`` building the derived tables server-side) and reuses it on later calls.
Prints build figures (wall and process CPU seconds: chdb's threads count there) and one
line per query: rows and the median of 3 timings (the store stays open between them,
as in a dashboard process).
"""

from __future__ import annotations

import argparse
import resource
import shutil
import sys
import time
from pathlib import Path

import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: tests.support
sys.path.insert(0, str(Path(__file__).resolve().parent))

from store_queries import build, time_queries

from kvtrace.store import read


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spans", type=int, default=10_000_000)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/kvtrace-bench-10m.chdb"))
    ap.add_argument("--rebuild", action="store_true")
    args = ap.parse_args()
    db = f"chdb:{args.dir}"
    if args.rebuild or not args.dir.exists():
        shutil.rmtree(args.dir, ignore_errors=True)
        t, cpu = time.perf_counter(), _cpu()
        run_id = build(db, args.spans)
        size = sum(f.stat().st_size for f in args.dir.rglob("*") if f.is_file())
        print(f"build total {time.perf_counter() - t:.1f} s wall, {_cpu() - cpu:.1f} s CPU; "
              f"directory {size / 2**20:,.0f} MiB")
    else:
        run_id = read.runs(db).filter(pl.col("name") == "bench-10m")["run_id"][0]
    cpu = _cpu()
    worst = time_queries(db, run_id)
    print(f"queries: {_cpu() - cpu:.1f} s CPU in all")
    return 0 if worst < 1.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
