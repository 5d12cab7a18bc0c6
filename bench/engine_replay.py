"""Engine-mode replay of the shared Mooncake synthetic trace (kimi-hybrid, content on).

Budget: the whole trace (3,993 requests, ~61M prompt tokens) under 60 s wall on 2 cores.
Usage: python bench/engine_replay.py [TRACE] [--limit N] [--no-profile]
Prints the summary, the wall time, and a cProfile top-10 (cumulative).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

from kvtrace.engine import Engine
from kvtrace.workload import TraceRequest

DEFAULT = Path(__file__).resolve().parents[1] / "tests" / "data" / "mooncake_synthetic_trace.jsonl"


def read_mooncake(path: Path, limit: int | None = None):
    with open(path) as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                return
            row = json.loads(line)
            yield TraceRequest(
                request_id=f"m{i}",
                arrival_ns=int(row["timestamp"]) * 1_000_000,
                input_length=int(row["input_length"]),
                output_length=int(row["output_length"]),
                hash_ids=tuple(row["hash_ids"]),
                hash_block_size=512,
            )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace", nargs="?", default=str(DEFAULT))
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--preset", default="kimi-hybrid")
    ap.add_argument("--audit-interval", type=int, default=2000)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads for the engine (default 1)")
    args = ap.parse_args()
    engine = Engine(args.preset, audit_interval=args.audit_interval, cpu_threads=args.threads or 1)
    prof = None if args.no_profile else cProfile.Profile()
    t0 = time.perf_counter()
    c0 = time.process_time()
    if prof is not None:
        prof.enable()
    result = engine.run(read_mooncake(Path(args.trace), args.limit))
    if prof is not None:
        prof.disable()
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    print(json.dumps(result.summary, indent=1))
    print(
        f"engine replay: wall {wall:.2f} s, cpu {cpu:.2f} s (budget 60 s wall on 2 cores)"
        f"{' [under cProfile]' if prof else ''}",
        file=sys.stderr,
    )
    if prof is not None:
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(10)


if __name__ == "__main__":
    main()
