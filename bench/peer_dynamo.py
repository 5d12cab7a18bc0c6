"""kvtrace beside NVIDIA Dynamo's mocker on the same trace: wall time, hit rate, TTFT, ITL.

The mocker (``ai-dynamo`` 1.6.1, vLLM scheduler personality) is a benchmark peer only:
it is installed into its own virtualenv under ``bench/.peers/`` (ignored by git) the
first time this runs, never imported by kvtrace and never used by the tests.

Both replay the same Mooncake-format trace with the same block size and capacity
(``--blocks`` blocks of 512 tokens; kvtrace's null block is added on top, as vLLM's
``num_gpu_blocks`` counts it) and the same batch limits (the preset's ``max_num_seqs``
and ``max_num_batched_tokens``, given to the mocker, whose own default is 256 seqs). Timing:

* ``--mocker-timing default``: the mocker's own generic polynomial;
* ``--mocker-timing kvtrace``: the mocker is given kvtrace's cost model as an
  interpolation table (its ``--planner-profile-data`` NPZ: prefill time by the step's
  new tokens, decode time by (active KV tokens, mean context)), so the two differ only
  in scheduling and caching. The mocker's prefill cost ignores where a chunk starts
  (its pairs are taken from 0) and a mixed step pays the overhead twice.

Prints both wall times and their ratio, both hit rates, and TTFT / ITL percentiles with
the ratio kvtrace / mocker.

    python bench/peer_dynamo.py [TRACE] [--preset kimi-hybrid] [--blocks 16384] [--mocker-timing kvtrace] [--no-content]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / "bench" / ".peers"
VENV = PEERS / "dynamo"
DEFAULT_TRACE = ROOT / "tests" / "data" / "mooncake_synthetic_trace.jsonl"
RECIPE = (
    ["--no-deps", "ai-dynamo==1.6.1", "ai-dynamo-runtime==1.6.1"],
    ["pydantic", "uvloop", "msgspec", "pyzmq", "pyyaml", "packaging", "aiohttp", "zstandard", "tqdm",
     "prometheus-client", "numpy"],
)

# Runs inside the peer's venv: one offline replay, a JSON summary on stdout.
MOCKER_RUN = r"""
import json, sys, time
import numpy as np
from dynamo.mocker import config as C
from dynamo.mocker.args import parse_args
from dynamo.replay import run_trace_replay

trace, block_size, blocks, npz, seqs, tokens = sys.argv[1:7]
margs = ["--block-size", block_size, "--num-gpu-blocks-override", blocks,
         "--max-num-seqs", seqs, "--max-num-batched-tokens", tokens]
if npz != "-":
    margs += ["--planner-profile-data", npz]
t0 = time.perf_counter()
report = run_trace_replay([trace], extra_engine_args=C.build_mocker_engine_args(parse_args(margs)),
                          replay_mode="offline", trace_format="mooncake", trace_block_size=int(block_size),
                          capture_per_request=True)
wall = time.perf_counter() - t0
s, pr = report.summary, report.per_request or []
ttft = [p["ttft_ms"] for p in pr if p.get("ttft_ms") is not None]
print(json.dumps({
    "wall_s": wall, "native_s": s["wall_time_ms"] / 1e3, "requests": s["completed_requests"],
    "hit_rate": s["prefix_cache_reused_ratio"],
    "ttft_ms": {q: float(np.percentile(ttft, q)) for q in (50, 90, 99)},
    "itl_ms": {50: s["median_itl_ms"], 90: s["p90_itl_ms"], 99: s["p99_itl_ms"]},
}))
"""


def ensure_mocker() -> Path:
    python = VENV / "bin" / "python"
    if python.exists():
        return python
    print(f"installing Dynamo's mocker into {VENV} (once) ...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    for args in RECIPE:
        subprocess.run([str(python), "-m", "pip", "install", "-q", *args], check=True)
    return python


def mocker_npz(model, path: Path) -> None:
    """kvtrace's cost model as the mocker's interpolation table (ms)."""
    import numpy as np

    tokens = np.unique(np.concatenate([np.arange(1, 64), np.geomspace(64, 262_144, 200).astype(int)]))
    prefill = [model.step_ns(int(t), int(t) * (int(t) + 1) // 2, 0, 0, 0, 0) / 1e6 for t in tokens]
    kv = np.concatenate([[1.0], np.geomspace(16, 16_777_216, 120)])
    ctx = np.concatenate([[1.0], np.geomspace(8, 1_048_576, 80)])
    decode = np.zeros((len(kv), len(ctx)))
    for i, k in enumerate(kv):
        for j, c in enumerate(ctx):
            b = max(1, round(k / c))
            decode[i, j] = model.step_ns(b, 0, int(k), b, 0, 0) / 1e6
    np.savez(path, prefill_isl=tokens.astype(float), prefill_ttft_ms=np.asarray(prefill), decode_active_kv_tokens=kv,
             decode_context_length=ctx, decode_itl=decode)


def run_kvtrace(trace: str, preset: str, blocks: int, limit: int | None, content: bool = True) -> dict:
    sys.path.insert(0, str(ROOT))
    from kvtrace.replay.run import RunSpec, run_replay

    spec = RunSpec(trace, preset=preset, block_size=512, capacity_blocks=blocks + 1, limit=limit, content=content)
    t0 = time.perf_counter()
    s = run_replay(spec).summary
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "requests": s["requests"], "hit_rate": s["prefix_cache_hit_rate"],
            "ttft_ms": {q: s.get(f"p{q}_ttft_ms") for q in (50, 90, 99)},
            "itl_ms": {q: s.get(f"p{q}_itl_ms") for q in (50, 90, 99)}, "summary": s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="?", default=str(DEFAULT_TRACE))
    ap.add_argument("--preset", default="kimi-hybrid")
    ap.add_argument("--blocks", type=int, default=16_384, help="KV blocks of 512 tokens (without the null block)")
    ap.add_argument("--mocker-timing", choices=("default", "kvtrace"), default="kvtrace")
    ap.add_argument("--limit", type=int, default=None, help="kvtrace only: the first N requests")
    ap.add_argument("--no-content", action="store_true", help="kvtrace without content (hits and timings only)")
    args = ap.parse_args()
    python = ensure_mocker()
    sys.path.insert(0, str(ROOT))
    from kvtrace.engine import get_preset

    with tempfile.TemporaryDirectory() as tmp:
        npz = "-"
        if args.mocker_timing == "kvtrace":
            npz = str(Path(tmp) / "cost.npz")
            mocker_npz(get_preset(args.preset).cost_model, Path(npz))
        t0 = time.perf_counter()
        limits = get_preset(args.preset).scheduler_config  # (the mocker's own default is 256 seqs)
        out = subprocess.run([str(python), "-c", MOCKER_RUN, args.trace, "512", str(args.blocks), npz,
                              str(limits.max_num_seqs), str(limits.max_num_batched_tokens)],
                             capture_output=True, text=True, check=True)
        mocker = json.loads(out.stdout.strip().splitlines()[-1]) | {"process_s": time.perf_counter() - t0}
    kv = run_kvtrace(args.trace, args.preset, args.blocks, args.limit, content=not args.no_content)
    print(f"trace {Path(args.trace).name}, {args.blocks:,} blocks of 512 tokens, kvtrace preset {args.preset}"
          f"{' (no content)' if args.no_content else ' (content and verification on)'}, "
          f"mocker timing {args.mocker_timing}")
    print(f"{'':24}{'kvtrace':>12}{'mocker':>12}{'ratio':>10}")
    print(f"{'wall s':24}{kv['wall_s']:>12.2f}{mocker['wall_s']:>12.2f}{kv['wall_s'] / mocker['wall_s']:>10.1f}"
          f"   (mocker native {mocker['native_s']:.2f} s, whole process {mocker['process_s']:.2f} s)")
    print(f"{'requests':24}{kv['requests']:>12,}{mocker['requests']:>12,}")
    print(f"{'token hit rate':24}{kv['hit_rate']:>12.3f}{mocker['hit_rate']:>12.3f}")
    for metric in ("ttft_ms", "itl_ms"):
        for q in (50, 90, 99):
            a, b = kv[metric][q], mocker[metric].get(str(q))

            def cell(v) -> str:
                return f"{v:>12.1f}" if isinstance(v, (int, float)) else f"{'-':>12}"

            ratio = f"{a / b:>10.2f}" if isinstance(a, (int, float)) and a and b else f"{'-':>10}"
            print(f"{metric + ' p' + str(q):24}{cell(a)}{cell(b)}{ratio}")
    prefill_load(args.trace, args.preset, args.blocks)


def prefill_load(trace: str, preset: str, blocks: int) -> None:
    """GPU time the trace's uncached prefill needs per second of trace, under the preset's
    cost model, with the hits of an LRU cache of the same capacity: above ~1 no engine
    with this model can keep up, whatever its scheduler."""
    from kvtrace.engine import get_preset
    from kvtrace.engine.clock import prefill_pairs
    from kvtrace.replay.cache_only import replay_cache_only
    from kvtrace.replay.readers import open_trace

    reqs = list(open_trace(trace))
    hits = replay_cache_only(reqs, capacity_blocks=blocks).per_request_hit_tokens
    cost, budget, busy = get_preset(preset).cost_model, get_preset(preset).scheduler_config.max_num_batched_tokens, 0
    for r, hit in zip(reqs, hits):
        start = min(hit, r.input_length - 1)
        while start < r.input_length:
            n = min(budget, r.input_length - start)
            busy += cost.step_ns(n, prefill_pairs(start, n), 0, 0, 0, 0)
            start += n
    span = max(reqs[-1].arrival_ns - reqs[0].arrival_ns, 1)
    print(f"prefill load under {cost.name}: {busy / span:.2f} GPU-s per trace second "
          f"({busy / 1e9:,.0f} s of prefill over a {span / 1e9:,.0f} s trace)")


if __name__ == "__main__":
    main()
