"""Budget: the engine with vLLM 0.33's own KVCacheManager vs with kvtrace's (issue 13).

The shared Mooncake synthetic trace, first 1,000 requests, ``kimi-hybrid``, engine mode
with content verification, both backends in one process (vLLM imported before any
timing), no store: ``Engine(preset, backend=...).run``. Prints the wall and CPU time of
each, their ratio (budget: the vllm backend within 2x of the kvtrace backend), whether
every request hit the same tokens, and, from a cProfile of the vllm-backend run, the
share of its time spent inside vLLM's own code (functions whose file is under the vllm
package directory; the profiler's overhead inflates both parts alike). Best of
``--repeat`` rounds each, interleaved (the machine is shared).

    .venv/bin/python bench/vllm_backend.py [--limit N] [--repeat R] [--preset NAME]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvtrace.engine import Engine
from kvtrace.engine.backends.vllm import load_vllm
from kvtrace.replay.run import RunSpec, engine_preset, open_workload

TRACE = ROOT / "tests" / "data" / "mooncake_synthetic_trace.jsonl"
BUDGET = 2.0


def one_run(preset, spec: RunSpec, backend: str, profile: cProfile.Profile | None = None):
    workload = open_workload(spec)
    engine = Engine(preset, backend=backend)
    wall, cpu = time.perf_counter(), time.process_time()
    if profile is not None:
        profile.enable()
    result = engine.run(workload.requests, listeners=[lambda batch: None])  # a listener: events are built
    if profile is not None:
        profile.disable()
    return time.perf_counter() - wall, time.process_time() - cpu, result


def vllm_share(profile: cProfile.Profile, vllm_dir: str) -> float:
    """Share of the profiled time spent in functions defined under ``vllm_dir`` (own time)."""
    stats = pstats.Stats(profile)
    inside = total = 0.0
    for (filename, _, _), (_, _, own, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        total += own
        if os.path.realpath(filename).startswith(vllm_dir + os.sep):
            inside += own
    return inside / total if total else 0.0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--preset", default="kimi-hybrid")
    args = ap.parse_args()
    api = load_vllm()
    import vllm

    vllm_dir = os.path.realpath(Path(vllm.__file__).parent)
    spec = RunSpec(str(TRACE), preset=args.preset, limit=args.limit)
    preset = engine_preset(spec)
    best: dict[str, tuple[float, float]] = {}
    results = {}
    for _ in range(args.repeat):
        for backend in ("kvtrace", "vllm"):
            wall, cpu, result = one_run(preset, spec, backend)
            results[backend] = result
            old = best.get(backend)
            best[backend] = (min(wall, old[0]), min(cpu, old[1])) if old else (wall, cpu)
    profile = cProfile.Profile()
    one_run(preset, spec, "vllm", profile)
    share = vllm_share(profile, vllm_dir)
    hits = {b: [(r.request_id, r.num_local_hit_tokens, r.num_external_hit_tokens) for r in res.requests]
            for b, res in results.items()}
    (kw, kc), (vw, vc) = best["kvtrace"], best["vllm"]
    ratio = vw / kw
    print(f"vLLM {api.version}, {args.preset}, {len(results['kvtrace'].requests)} requests of {TRACE.name}, "
          f"best of {args.repeat}")
    print(f"  kvtrace backend: {kw:7.2f} s wall, {kc:7.2f} s CPU")
    print(f"  vllm backend:    {vw:7.2f} s wall, {vc:7.2f} s CPU")
    print(f"  ratio vllm/kvtrace: {ratio:.2f}x wall, {vc / kc:.2f}x CPU (budget <= {BUDGET:.0f}x)")
    print(f"  time inside vLLM's own code (cProfile, own time under {vllm_dir}): {share:.1%}")
    print(f"  per-request hit tokens equal: {hits['kvtrace'] == hits['vllm']}")
    for b in ("kvtrace", "vllm"):
        s = results[b].summary
        print(f"  {b}: divergent_outputs {s['divergent_outputs']}, stale_hashes {s['stale_hashes']}, "
              f"table_disagreements {s['table_disagreements']}, publishes {s['publishes']}, "
              f"evictions {s['evictions']}")
    return 0 if ratio <= BUDGET and hits["kvtrace"] == hits["vllm"] else 1


if __name__ == "__main__":
    sys.exit(main())
