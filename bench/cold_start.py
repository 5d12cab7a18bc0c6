"""Budget (issue 16): a user error is reported in < 0.5 s, and torch is not imported for it.

Runs each command below as a whole process (``kvtrace`` from this venv, start-up and
imports included) ``--repeat`` times and prints the median wall time, the exit status
(a user error: 2) and whether torch was imported (``-X importtime`` on the same command).

    .venv/bin/python bench/cold_start.py [--repeat 7]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUDGET_S = 0.5
KVTRACE = [sys.executable, "-m", "kvtrace.cli"]


def _cases(tmp: Path) -> list[tuple[str, list[str]]]:
    bad_toml = tmp / "bad.toml"
    bad_toml.write_text("[cache\n")
    bad_trace = tmp / "bad.jsonl"
    bad_trace.write_text('{"timestamp": 0, "input_length": "x"}\n')
    return [
        ("replay a missing trace", ["replay", str(tmp / "missing.jsonl")]),
        ("replay a malformed trace", ["replay", str(bad_trace), "--mode", "cache-only"]),
        ("replay with a malformed --config", ["replay", "gen:mixed", "--config", str(bad_toml)]),
        ("an unknown preset", ["replay", "gen:mixed", "--preset", "nope"]),
        ("runs on a missing store", ["runs", "--db", str(tmp / "missing.duckdb")]),
        ("replay into a missing folder", ["replay", "gen:mixed", "--db", str(tmp / "nowhere" / "r.duckdb")]),
        ("collect on a port out of range", ["collect", "--db", str(tmp / "r.duckdb"), "--port", "70000"]),
        ("capture from a malformed endpoint", ["capture", "vllm", "--db", str(tmp / "r.duckdb"), "--endpoint", "x"]),
        ("demo into a directory", ["demo", "--db", str(tmp)]),
        ("dashboard on port 70000", ["dashboard", "--db", str(bad_toml), "--port", "70000"]),
        ("study with an unknown sweep", ["study", "shared-prefix-pinning", "--sweep", "bogus=1,2"]),
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for name, argv in _cases(Path(tmp)):
            times, codes = [], set()
            for _ in range(args.repeat):
                t = time.perf_counter()
                proc = subprocess.run([*KVTRACE, *argv], capture_output=True, text=True, check=False)
                times.append(time.perf_counter() - t)
                codes.add(proc.returncode)
            traced = subprocess.run([sys.executable, "-X", "importtime", "-m", "kvtrace.cli", *argv],
                                    capture_output=True, text=True, check=False)
            torch = any(line.rstrip().endswith("| torch") for line in traced.stderr.splitlines())
            median = statistics.median(times)
            worst = max(worst, median)
            line = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
            print(f"{name:34s} {median:6.3f} s  exit {sorted(codes)}  torch {'IMPORTED' if torch else 'no'}  "
                  f"{line[:70]}")
    cached = all(Path(importlib.util.cache_from_source(str(p))).exists()
                 for p in (Path(__file__).resolve().parents[1] / "kvtrace").rglob("*.py"))
    print(f"bytecode of kvtrace cached: {'yes' if cached else 'no (make install byte-compiles it)'}")
    print(f"slowest median {worst:.3f} s (budget {BUDGET_S} s, issue 16: {'met' if worst < BUDGET_S else 'NOT met'})")


if __name__ == "__main__":
    main()
