"""The ClickHouse collector path on chdb: what an insert into the exporter's ``otel_traces``
costs through kvtrace's views, and what making a store costs.

    .venv/bin/python bench/clickhouse_collector.py [--requests 60] [--repeat 5]

A real replay (``gen:study-shared-prefix-pinning``, the tests' workload) exports its spans
over OTLP/HTTP to a local capture; each request body becomes the rows the OpenTelemetry
Collector's ClickHouse exporter writes (tests/support/collector_rows). Prints the time to make
a new chdb store (its tables and views), the median of ``--repeat`` inserts of one span and of
one export request (a few hundred spans), and the whole export in one insert. Most of a small
insert is ClickHouse planning the views' SQL, which does not grow with the rows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: tests.support

from kvtrace.replay.run import RunSpec, run_replay
from kvtrace.store import Store
from kvtrace.store.backend import clickhouse_target
from kvtrace.store.clickhouse import client
from tests.clickhouse.conftest import otlp_capture
from tests.support.collector_rows import collector_rows


def _bodies(requests: int, root: Path) -> list[bytes]:
    server, url, bodies = otlp_capture()
    try:
        run_replay(RunSpec("gen:study-shared-prefix-pinning", limit=requests, name="bench"),
                   db=str(root / "replay.duckdb"), otlp_endpoint=url)
    finally:
        server.shutdown()
        server.server_close()
    return bodies


def _median_insert(con, rows, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        con.insert_arrow("otel_traces", rows)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        bodies = _bodies(args.requests, root)
        db = f"chdb:{root / 'store'}"
        t = time.perf_counter()
        Store.open(db).close()
        print(f"new chdb store (tables and views): {time.perf_counter() - t:.2f} s")
        whole = collector_rows(bodies)
        one_request = collector_rows([max(bodies, key=len)])  # (the first holds the opening record alone)
        with client.connect(clickhouse_target(db)) as con:
            one = _median_insert(con, whole.slice(0, 1), args.repeat)
            request = _median_insert(con, one_request, args.repeat)
            t = time.perf_counter()
            con.insert_arrow("otel_traces", whole)
            all_at_once = time.perf_counter() - t
        print(f"insert of 1 span: {one * 1000:.0f} ms (median of {args.repeat})")
        print(f"insert of one export request, {one_request.num_rows} spans: {request * 1000:.0f} ms "
              f"(median of {args.repeat})")
        print(f"insert of the whole export, {whole.num_rows} spans in {len(bodies)} requests: "
              f"{all_at_once * 1000:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
