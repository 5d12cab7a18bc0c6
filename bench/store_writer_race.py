"""Why writers take turns under ``<db>.write-lock`` (kvtrace/store/connection.py): DuckDB 2.0.1
now and then loses a committed transaction when processes take turns writing one file.

Each race: ``--writers`` processes each commit ``--commits`` small inserts into one store, a
connection per commit (as kvtrace's unheld writer does), while ``--readers`` processes open
it read-only in a loop. Afterwards every committed row must be there. ``duckdb`` opens
with DuckDB alone (retrying its lock conflicts); ``kvtrace`` through ``write_connection`` and
``read_connection``. Prints, per way, how many races lost a commit.

    .venv/bin/python bench/store_writer_race.py [--races 250] [--writers 3] [--readers 0] [--ways duckdb,kvtrace]

Twenty-seventh session, this 2-core box: duckdb 4 of 250 races lost a commit (three writers),
kvtrace 0 of 250 (see README's benchmark table for the current figures).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

import duckdb

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ROWS = 10


def _raw_connect(path: str, read_only: bool) -> duckdb.DuckDBPyConnection:
    while True:
        try:
            return duckdb.connect(path, read_only=read_only)
        except duckdb.Error as err:
            if "lock" not in str(err).lower():
                raise
            time.sleep(0.005)


def _writer(way: str, path: str, start, tag: int, commits: int) -> None:
    from kvtrace.store.connection import write_connection

    start.wait()
    for k in range(commits):
        if way == "kvtrace":
            with write_connection(path) as con:
                con.execute("INSERT INTO t SELECT ?, ?, range FROM range(?)", [tag, k, ROWS])
        else:
            con = _raw_connect(path, read_only=False)
            con.execute("INSERT INTO t SELECT ?, ?, range FROM range(?)", [tag, k, ROWS])
            con.close()
        time.sleep(0.002)


def _reader(way: str, path: str, start, stop) -> None:
    from kvtrace.store.connection import read_connection

    start.wait()
    while not stop.is_set():
        if way == "kvtrace":
            with read_connection(path) as con:
                con.execute("SELECT count(*) FROM t").fetchall()
        else:
            con = _raw_connect(path, read_only=True)
            con.execute("SELECT count(*) FROM t").fetchall()
            con.close()
        time.sleep(0.001)


def _race(way: str, path: str, writers: int, readers: int, commits: int) -> bool:
    from kvtrace.store import Store

    with Store.open(path) as store:  # (a real store: kvtrace's reads check its layout)
        store.create_run("race")
    con = duckdb.connect(path)
    con.execute("CREATE TABLE t (tag INTEGER, k INTEGER, i BIGINT)")
    con.close()
    start, stop = mp.Event(), mp.Event()
    procs = [mp.Process(target=_writer, args=(way, path, start, w, commits)) for w in range(writers)]
    procs += [mp.Process(target=_reader, args=(way, path, start, stop)) for _ in range(readers)]
    for proc in procs:
        proc.start()
    time.sleep(0.2)
    start.set()
    for proc in procs[:writers]:
        proc.join()
    stop.set()
    for proc in procs[writers:]:
        proc.join()
    con = duckdb.connect(path, read_only=True)
    rows = con.execute("SELECT tag, count(*) FROM t GROUP BY 1 ORDER BY 1").fetchall()
    con.close()
    return rows == [(w, commits * ROWS) for w in range(writers)] and all(p.exitcode == 0 for p in procs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--races", type=int, default=250)
    parser.add_argument("--writers", type=int, default=3)
    parser.add_argument("--readers", type=int, default=0)
    parser.add_argument("--commits", type=int, default=5)
    parser.add_argument("--ways", default="duckdb,kvtrace")
    args = parser.parse_args()
    for way in args.ways.split(","):
        lost = 0
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.races):
                lost += not _race(way, f"{tmp}/r{i}.duckdb", args.writers, args.readers, args.commits)
        print(f"{way:8} {lost} of {args.races} races lost a commit "
              f"({args.writers} writers x {args.commits} commits, {args.readers} readers)", flush=True)


if __name__ == "__main__":
    main()
