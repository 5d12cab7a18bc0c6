"""A real writer process for the crash and concurrency tests.

    python writer_child.py DB MODE BATCHES ROWS

Each batch is ROWS step spans (step = running index), appended and flushed; after each
flush the child prints ``flushed <total>``. MODE:
  hang    - after the last flush print ``ready`` and sleep (the test kills it with -9)
  sigint  - like hang, inside ``with Store.open(...)``: Ctrl-C marks the run failed
  stream  - write all batches, then finish_run(complete) and print ``done``
  lockstep - like stream, but wait for a line on stdin after each flush

With WRITER_CHILD_HOLD=1 the store keeps its connection between flushes (``hold``, as a
replay's does).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pyarrow as pa

from kvtrace.store import Store


def batch(start: int, rows: int) -> pa.Table:
    steps = np.arange(start, start + rows, dtype=np.int64)
    return pa.table({
        "name": pa.array(["kvtrace.engine.step"] * rows),
        "start_ns": steps * 1000, "end_ns": steps * 1000 + 1000, "step": steps,
        "usage": pa.array([[0.5, 0.25]] * rows, pa.list_(pa.float64())),
    })


def write(store: Store, run_id: str, batches: int, rows: int, pause: float, lockstep: bool = False) -> None:
    for i in range(batches):
        store.append_spans(batch(i * rows, rows), run_id=run_id)
        store.flush()
        print(f"flushed {(i + 1) * rows}", flush=True)
        if lockstep:
            sys.stdin.readline()
        if pause:
            time.sleep(pause)


def main() -> None:
    db, mode, batches, rows = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if mode == "sigint":
        with Store.open(db) as store:
            run_id = store.create_run("child", run_id="child")
            write(store, run_id, batches, rows, 0.0)
            print("ready", flush=True)
            while True:
                time.sleep(0.05)
    store = Store.open(db, flush_interval_s=1e9, flush_rows=1 << 30, hold=os.environ.get("WRITER_CHILD_HOLD") == "1")
    run_id = store.create_run("child", run_id="child")
    if mode == "hang":
        write(store, run_id, batches, rows, 0.0)
        store.append_spans(batch(batches * rows, rows), run_id=run_id)  # buffered, never flushed
        print("ready", flush=True)
        while True:
            time.sleep(0.05)
    elif mode in ("stream", "lockstep"):
        write(store, run_id, batches, rows, 0.01 if mode == "stream" else 0.0, lockstep=mode == "lockstep")
        store.finish_run(run_id, digest="d", summary={"rows": batches * rows})
        print("done", flush=True)


if __name__ == "__main__":
    main()
