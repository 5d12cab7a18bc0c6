"""Budget: `kvtrace demo` (4 engine replays of the mixed workload + diffs) under 2 minutes.

Runs the real command in a subprocess, as a user would, into a temporary store, and
prints the wall time against the budget. Exit status 1 when over budget.

    .venv/bin/python bench/demo.py [--repeat N]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

BUDGET_S = 120.0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    times = []
    with tempfile.TemporaryDirectory(prefix="kvtrace-bench-demo-") as tmp:
        db = os.path.join(tmp, "kvtrace-demo.duckdb")
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-m", "kvtrace.cli", "demo", "--db", db],
                cwd=tmp, capture_output=True, text=True, check=False,
            )
            times.append(time.perf_counter() - t0)
            if proc.returncode != 0:
                print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n", file=sys.stderr)
                print(f"kvtrace demo failed with exit status {proc.returncode}")
                return 2
        last_line = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    best = min(times)
    print(f"kvtrace demo: {best:.1f} s wall (best of {len(times)}: {', '.join(f'{t:.1f}' for t in times)}) "
          f"on {os.cpu_count()} CPUs; budget {BUDGET_S:.0f} s -> {'OK' if best < BUDGET_S else 'OVER BUDGET'}")
    print(f"last line: {last_line}")
    return 0 if best < BUDGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
