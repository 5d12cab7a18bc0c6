"""Engine-mode replay of the shared Mooncake synthetic trace (kimi-hybrid, content on).

Budget (issue 16): the whole trace (3,993 requests, ~61M prompt tokens) in 8 s wall on 2
cores with content and verification on. Usage:

    python bench/engine_replay.py [TRACE] [--limit N] [--no-profile] [--no-content] [--device cuda]

Prints the summary, the run's digest (the event stream's, computed as ``kvtrace replay``
computes it, over requests this script names m0, m1, ...: kvtrace replay names them r0, r1,
..., so its digest of the same trace differs; kept so that every session's figure compares),
the wall and CPU time of the run (the imports before it excluded), and a cProfile
top-10 (by own time) unless --no-profile; with ``KVTRACE_PROFILE_OUT=FILE`` it also writes
the whole profile there (``pstats`` format).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time
from pathlib import Path

from kvtrace import compiled
from kvtrace.engine import Engine
from kvtrace.replay.digest import Digest
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
    ap.add_argument("--no-content", action="store_true", help="hits and timings only (kvtrace replay --no-content)")
    ap.add_argument("--device", default=None,
                    help="the content's arrays: cpu (numpy), torch:cpu or cuda[:N] "
                         "(default: $KVTRACE_DEVICE, else cpu, also beside a GPU: faster at these sizes)")
    args = ap.parse_args()
    engine = Engine(args.preset, audit_interval=args.audit_interval, cpu_threads=args.threads or 1,
                    content=not args.no_content, device=args.device)
    digest = Digest()
    prof = None if args.no_profile else cProfile.Profile()
    t0 = time.perf_counter()
    c0 = time.process_time()
    if prof is not None:
        prof.enable()
    result = engine.run(read_mooncake(Path(args.trace), args.limit), [digest.on_step])
    if prof is not None:
        prof.disable()
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    print(json.dumps(result.summary, indent=1))
    mode = "no-content" if args.no_content else f"content on, device {args.device or 'default'}"
    print(
        f"engine replay ({args.preset}, {mode}): {result.summary['requests']} requests, "
        f"{result.summary['steps']} steps: wall {wall:.2f} s, cpu {cpu:.2f} s (budget 8 s wall on 2 cores)"
        f"{' [under cProfile]' if prof else ''}\ncache modules {compiled.mode()}; "
        f"engine kernels {compiled.kernels_mode()}\ndigest {digest.hexdigest()}",
        file=sys.stderr,
    )
    if prof is not None:
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(10)
        if os.environ.get("KVTRACE_PROFILE_OUT"):
            prof.dump_stats(os.environ["KVTRACE_PROFILE_OUT"])


if __name__ == "__main__":
    main()
