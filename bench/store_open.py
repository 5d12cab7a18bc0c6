"""What opening a DuckDB store costs: a new DuckDB instance a file, against the file attached
to an instance kept for reuse (kvtrace/store/instances.py), and kvtrace's whole opens.

    .venv/bin/python bench/store_open.py [--opens 300]

Prints the median of ``--opens`` timings per line, in ms, on a store one small replay made
(``gen:chat``, 5 requests):
- ``duckdb.connect`` + close: a new instance per open (how every open was made before);
- ``instances.attach`` + detach: the file attached to a kept instance (how it is made now);
- ``read_connection``, ``write_connection``: kvtrace's opens, with their checks (the store's
  layout, the file's kind, lock markers) and a ``SELECT 1``;
- ``read.runs``: a whole read-API call (``kvtrace runs`` makes one);
- ``Store.open`` + close of the existing store: what every writer (a replay, a collector)
  does first; its schema's DDL runs only where the views' stamp is not this kvtrace's;
- ``Store.open`` + close of a new store: the DDL, every table and view made.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import duckdb

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvtrace.replay.run import RunSpec, run_replay
from kvtrace.store import Store, instances, read
from kvtrace.store.connection import read_connection, write_connection


def median_ms(fn: Callable[[], object], n: int) -> float:
    fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opens", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        db = str(Path(tmp) / "s.duckdb")
        run_replay(RunSpec("gen:chat", limit=5, content=False), db=db)

        def connect() -> None:
            duckdb.connect(db, read_only=True).close()

        def attach() -> None:
            instances.detach(instances.attach(db, read_only=True))

        def reading() -> None:
            with read_connection(db) as con:
                con.execute("SELECT 1").fetchall()

        def writing() -> None:
            with write_connection(db) as con:
                con.execute("SELECT 1").fetchall()

        lines = [("duckdb.connect + close (a new instance)", connect),
                 ("instances.attach + detach (a kept instance)", attach),
                 ("read_connection + SELECT 1", reading),
                 ("write_connection + SELECT 1", writing),
                 ("read.runs", lambda: read.runs(db)),
                 ("Store.open + close, the existing store", lambda: Store.open(db).close()),
                 ("Store.open + close, a new store", lambda: Store.open(str(Path(tempfile.mkdtemp(dir=tmp)) /
                                                                             "new.duckdb")).close())]
        for label, fn in lines:
            print(f"{label:<48} {median_ms(fn, args.opens):7.2f} ms")


if __name__ == "__main__":
    main()
