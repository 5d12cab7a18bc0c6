"""Budgets (issue 17): a sweep of 8 cache-only replays on 2 local workers >= 1.6x faster
than the same 8 replays one after another; the one-pass LRU curve >= 5x faster than 8
replays at its capacities.

Both sides replay the shared Mooncake synthetic trace (3,993 requests, 512-token blocks)
exactly as ``kvtrace sweep`` / ``kvtrace curve`` do (``run_sweep`` with the digest on, no
store, so the figure is the replays and not DuckDB), and check that the answers agree:
equal digests per combination, and the curve's hits equal the replays' at every capacity.

    .venv/bin/python bench/sweep_curve.py [--repeat 3] [--workers 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvtrace.replay.cache_only import as_block_requests, replay_cache_only
from kvtrace.replay.curve import capacity_curve
from kvtrace.replay.readers import read_trace
from kvtrace.replay.run import RunSpec
from kvtrace.replay.sweep import run_sweep

TRACE = ROOT / "tests" / "data" / "mooncake_synthetic_trace.jsonl"
CAPACITIES = [1_000, 2_000, 4_000, 6_000, 8_000, 12_000, 16_000, 24_000]


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def at_least_one(text: str) -> int:
    """An argparse type: an int >= 1 (--repeat 0 ended in statistics' 'no median for empty
    data', --workers 0 in run_sweep's ConfigError: tracebacks, not argparse's one line)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is below 1")
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=at_least_one, default=3)
    ap.add_argument("--workers", type=at_least_one, default=2)
    args = ap.parse_args(argv)
    base = RunSpec(str(TRACE), mode="cache-only")
    params = [("capacity_blocks", CAPACITIES)]
    print(f"machine: {os.cpu_count()} cores; trace {TRACE.name}; capacities {CAPACITIES}")

    seq_t, par_t = [], []
    for _ in range(args.repeat):  # interleaved, so drift in machine load hits both alike
        t, seq = timed(lambda: run_sweep(base, params, workers=1))
        seq_t.append(t)
        t, par = timed(lambda: run_sweep(base, params, workers=args.workers))
        par_t.append(t)
        assert [r.summary["digest"] for r in seq.runs] == [r.summary["digest"] for r in par.runs]
    s, p = statistics.median(seq_t), statistics.median(par_t)
    print(f"sweep, 8 cache-only replays: sequential {s:.2f} s, {args.workers} workers {p:.2f} s "
          f"-> {s / p:.2f}x (budget >= 1.6x) {'OK' if s / p >= 1.6 else 'OVER BUDGET'}; digests equal")

    reqs, bs = as_block_requests(read_trace(TRACE), None)
    replay_t, curve_t = [], []
    for _ in range(args.repeat):
        t, replays = timed(lambda: [replay_cache_only(reqs, capacity_blocks=c, block_size=bs) for c in CAPACITIES])
        replay_t.append(t)
        t, points = timed(lambda: capacity_curve(reqs, CAPACITIES, policies=("lru",)))
        curve_t.append(t)
        assert [p.method for p in points] == ["one-pass"] * len(CAPACITIES)
        assert [p.hit_tokens for p in points] == [r.hit_tokens for r in replays]
    r, c = statistics.median(replay_t), statistics.median(curve_t)
    print(f"curve, LRU at 8 capacities: 8 replays {r:.2f} s, one pass {c:.3f} s -> {r / c:.1f}x "
          f"(budget >= 5x) {'OK' if r / c >= 5 else 'OVER BUDGET'}; hits equal at every capacity")
    return 0


if __name__ == "__main__":
    sys.exit(main())
