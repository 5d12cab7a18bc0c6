"""Budget: the engine with vLLM 0.33's own KVCacheManager vs with kvtrace's (issue 13).

The shared Mooncake synthetic trace, first 1,000 requests, ``kimi-hybrid``, engine mode
with content verification, both backends in one process (vLLM imported before any
timing), no store: ``Engine(preset, backend=...).run``. Prints the wall and CPU time of
each, their ratio (budget: the vllm backend within 2x of the kvtrace backend) and
whether every request hit the same tokens. Best of ``--repeat`` rounds each,
interleaved (the machine is shared).

Then where each backend's time goes, from one more run of each sampled by py-spy (a
sampling profiler: it adds no cost per call, which a tracing one does, and would
inflate vLLM's many small calls). A sample counts for the innermost frame of its stack
that is project code; library frames (the standard library, numpy, torch) count for
their caller, and so does the garbage collector, wherever an allocation set it off
(its share of the run is printed beside the profiler's name: a full collection lands on
one line, so a part can move by a few tenths of a second from run to run):

* vllm backend: wall = the kvtrace-side engine (scheduler, worker, clock, audit, the
  engine's requests) +
  the adapter (``kvtrace/engine/backends/vllm``: request twins, block-table and event
  translation, state writes) + inside vLLM's own code (its package directory);
* kvtrace backend: wall = the same engine + kvtrace's cache (``kvtrace/cache``).

The shares are of the sampled run, the seconds are the shares times the best wall.
Where py-spy cannot attach (no ptrace permission) cProfile takes its place, own time
per function and builtins' time given to their callers (it then inflates small calls).

    .venv/bin/python bench/vllm_backend.py [--limit N] [--repeat R] [--preset NAME]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvtrace.engine import Engine
from kvtrace.engine.backends.vllm import load_vllm
from kvtrace.names import PRESETS
from kvtrace.replay.run import RunSpec, engine_preset, open_workload

TRACE = ROOT / "tests" / "data" / "mooncake_synthetic_trace.jsonl"
BUDGET = 2.0
PY_SPY = Path(sys.executable).with_name("py-spy")
RATE = 250  # samples a second
ENGINE, ADAPTER, VLLM, CACHE = "kvtrace-side engine", "adapter", "inside vLLM", "kvtrace's cache"
_FRAME = re.compile(r"\((.*):\d+\)$")  # py-spy raw: "function (file:line)"


def one_run(preset, spec: RunSpec, backend: str):
    workload = open_workload(spec)
    engine = Engine(preset, backend=backend)
    wall, cpu = time.perf_counter(), time.process_time()
    result = engine.run(workload.requests, listeners=[lambda batch: None])  # a listener: events are built
    return time.perf_counter() - wall, time.process_time() - cpu, result


class Parts:
    """Which part of the run a source file belongs to."""

    def __init__(self, vllm_dir: str):
        self.prefixes = [(os.path.realpath(vllm_dir) + os.sep, VLLM),
                         (str(ROOT / "kvtrace" / "engine" / "backends" / "vllm") + os.sep, ADAPTER),
                         (str(ROOT / "kvtrace" / "cache") + os.sep, CACHE),
                         (str(ROOT / "kvtrace") + os.sep, ENGINE)]
        self._memo: dict[str, str | None] = {}

    def of(self, filename: str) -> str | None:
        """The part of a project file; None for any other (a library's, a builtin)."""
        part = self._memo.get(filename, "")
        if part == "":
            path = os.path.realpath(filename) if filename.startswith(os.sep) else filename
            part = next((p for prefix, p in self.prefixes if path.startswith(prefix)), None)
            self._memo[filename] = part
        return part


class GcTime:
    """Seconds the garbage collector ran while on (``gc.callbacks``)."""

    def __init__(self):
        self.seconds, self._start = 0.0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start

    def __enter__(self) -> GcTime:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


def sampled_shares(preset, spec: RunSpec, backend: str, parts: Parts) -> tuple[dict[str, float], str]:
    """Each part's share of one run of ``backend`` (py-spy; cProfile where py-spy cannot
    attach), and the profiler's name with the share of the collector's time in it."""
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "samples.txt"
        spy = None
        if PY_SPY.exists():
            spy = subprocess.Popen([str(PY_SPY), "record", "--pid", str(os.getpid()), "--rate", str(RATE),
                                    "--format", "raw", "--nonblocking", "--full-filenames", "-o", str(raw)],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            assert spy.stdout is not None
            line = spy.stdout.readline()  # "py-spy> Sampling process ..." once it samples, else its error
            if "Sampling" not in line:
                spy.wait()
                print(f"  (py-spy: {line.strip() or 'exited'}; cProfile instead)")
                spy = None
        if spy is None:
            profile = cProfile.Profile()
            with GcTime() as collector:
                profile.enable()
                wall = one_run(preset, spec, backend)[0]
                profile.disable()
            return _profile_shares(profile, parts), f"cProfile, garbage collector {collector.seconds / wall:.0%}"
        with GcTime() as collector:
            wall = one_run(preset, spec, backend)[0]
        spy.send_signal(signal.SIGINT)
        spy.communicate(timeout=120)
        counts: Counter[str] = Counter()
        run_frame = f"Engine._run ({ROOT / 'kvtrace' / 'engine' / 'engine.py'}:"
        for line in raw.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            frames = stack.split(";")
            if not any(f.startswith(run_frame) for f in frames):
                continue  # outside the run: set-up, teardown
            part = next((p for f in reversed(frames) if (m := _FRAME.search(f)) and (p := parts.of(m.group(1)))),
                        ENGINE)
            counts[part] += int(n)
        total = sum(counts.values())
        return ({p: n / total for p, n in counts.items()},
                f"py-spy, {total} samples, garbage collector {collector.seconds / wall:.0%}")


def _profile_shares(profile: cProfile.Profile, parts: Parts) -> dict[str, float]:
    """cProfile own time per part; a builtin's own time goes to its callers' parts."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    own: Counter[str] = Counter()
    for (filename, _, _), (_, _, tt, _, callers) in stats.items():
        part = parts.of(filename)
        if part is not None:
            own[part] += tt
        elif filename == "~":  # a builtin: split its time over its callers
            for (cfile, _, _), (_, _, ctt, _) in callers.items():
                own[parts.of(cfile) or ENGINE] += ctt
        else:
            own[ENGINE] += tt
    total = sum(own.values())
    return {p: t / total for p, t in own.items()}


def breakdown(name: str, wall: float, shares: dict[str, float], order: tuple[str, ...]) -> str:
    terms = " + ".join(f"{p} {shares.get(p, 0.0) * wall:.2f} s ({shares.get(p, 0.0):.0%})" for p in order)
    return f"  {name}: {wall:.2f} s = {terms}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--preset", default="kimi-hybrid", choices=PRESETS)
    args = ap.parse_args()
    for flag, value in (("--limit", args.limit), ("--repeat", args.repeat)):
        if value < 1:  # (--repeat 0 ended in a KeyError traceback after the runs, --limit 0 in a ConfigError's)
            ap.error(f"argument {flag}: {value} is below 1")
    api = load_vllm()
    import vllm

    parts = Parts(str(Path(vllm.__file__).parent))
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
    shares = {backend: sampled_shares(preset, spec, backend, parts) for backend in ("vllm", "kvtrace")}
    vllm_shares = shares["vllm"][0]  # kvtrace/cache code in the vllm run (its Request class) is kvtrace-side
    vllm_shares[ENGINE] = vllm_shares.get(ENGINE, 0.0) + vllm_shares.pop(CACHE, 0.0)
    hits = {b: [(r.request_id, r.num_local_hit_tokens, r.num_external_hit_tokens) for r in res.requests]
            for b, res in results.items()}
    (kw, kc), (vw, vc) = best["kvtrace"], best["vllm"]
    ratio = vw / kw
    print(f"vLLM {api.version}, {args.preset}, {len(results['kvtrace'].requests)} requests of {TRACE.name}, "
          f"best of {args.repeat}")
    print(f"  kvtrace backend: {kw:7.2f} s wall, {kc:7.2f} s CPU")
    print(f"  vllm backend:    {vw:7.2f} s wall, {vc:7.2f} s CPU")
    print(f"  ratio vllm/kvtrace: {ratio:.2f}x wall, {vc / kc:.2f}x CPU (budget <= {BUDGET:.0f}x)")
    print(f"  where the time goes ({shares['vllm'][1]}; {shares['kvtrace'][1]}), shares of the best wall:")
    print(breakdown("vllm backend", vw, shares["vllm"][0], (ENGINE, ADAPTER, VLLM)))
    print(breakdown("kvtrace backend", kw, shares["kvtrace"][0], (ENGINE, CACHE)))
    print(f"  time inside vLLM's own code: {shares['vllm'][0].get(VLLM, 0.0):.1%}; the adapter's own: "
          f"{shares['vllm'][0].get(ADAPTER, 0.0):.1%}")
    print(f"  per-request hit tokens equal: {hits['kvtrace'] == hits['vllm']}")
    for b in ("kvtrace", "vllm"):
        s = results[b].summary
        print(f"  {b}: divergent_outputs {s['divergent_outputs']}, stale_hashes {s['stale_hashes']}, "
              f"table_disagreements {s['table_disagreements']}, publishes {s['publishes']}, "
              f"evictions {s['evictions']}")
    return 0 if ratio <= BUDGET and hits["kvtrace"] == hits["vllm"] else 1


if __name__ == "__main__":
    sys.exit(main())
