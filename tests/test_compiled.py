"""The cache's compiled modules (kvtrace/compiled.py) are its Python sources, faster.

The install compiles them (setup.py); the same workloads then give the same event streams
(digests) on the compiled modules, here, and on the sources, in a subprocess with
``KVTRACE_PURE_PYTHON=1``: cache-only replays of the shipped Mooncake trace and the
engine workloads of the fast-path tests (hybrid, attention-only and sliding-window
layouts, preemption, copy-on-write, external-tier loads, behaviours switched off). The
fallback's rules (told to, not compiled, a source edited since) are checked on a tree of
files.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

from kvtrace import compiled

ROOT = Path(__file__).resolve().parents[1]
CASES = ("hybrid-all-on", "attention-swa-mamba", "external-continuation", "kimi-mooncake-preempting",
         "study-shared-prefix-pinning-off", "dense-mixed")

# Run in this process (compiled) and in a subprocess (sources): {workload: digest}.
DIGESTS = f"""
import json, sys
from kvtrace import compiled
from kvtrace.engine import Engine
from kvtrace.replay.cache_only import replay_cache_only
from kvtrace.replay.digest import Digest
from kvtrace.replay.readers import open_trace
from tests.engine.test_decode_fast_path import MOONCAKE, _cases

out = {{"mode": compiled.mode()}}
reqs = list(open_trace(MOONCAKE))
for capacity in (300, 5859, None):
    d = Digest()
    replay_cache_only(reqs, capacity_blocks=capacity, listeners=[d])
    out[f"cache-only {{capacity}}"] = d.hexdigest()
for name, preset, work in _cases():
    if name in {CASES!r}:
        d = Digest()
        Engine(preset, audit_interval=7).run(work, [d.on_step])
        out[name] = d.hexdigest()
json.dump(out, sys.stdout)
"""


def _digests(pure: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != compiled.ENV}
    if pure:
        env[compiled.ENV] = "1"
    proc = subprocess.run([sys.executable, "-c", DIGESTS], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_the_install_compiled_the_cache():
    """``make install`` (pip install -e .) builds the extensions; this fails when it did not."""
    assert compiled.is_compiled(), compiled.mode()
    for name in compiled.COMPILED:
        module = importlib.import_module(name)
        assert module.__file__ is not None and module.__file__.endswith(tuple(EXTENSION_SUFFIXES)), module.__file__


def test_compiled_modules_and_sources_give_the_same_events():
    pure, fast = _digests(pure=True), _digests(pure=False)
    assert pure.pop("mode") == f"pure Python ({compiled.ENV}=1)"
    assert fast.pop("mode") == "compiled (mypyc)"
    assert len(pure) == 3 + len(CASES)  # every case ran
    assert pure == fast


def _tree(root: Path, *, shared: bool = True, skip: str | None = None) -> None:
    """Sources and (empty) extension files as an install lays them out, extensions newer."""
    suffix = EXTENSION_SUFFIXES[0]
    for name in compiled.COMPILED:
        py = compiled.source_path(name, root)
        py.parent.mkdir(parents=True, exist_ok=True)
        py.write_text("")
        os.utime(py, (1_000, 1_000))
        if name != skip:
            py.with_suffix(suffix).write_bytes(b"")
            os.utime(py.with_suffix(suffix), (2_000, 2_000))
    if shared:
        lib = compiled.source_path(compiled.GROUP + "__mypyc", root).with_suffix(suffix)
        lib.write_bytes(b"")
        os.utime(lib, (2_000, 2_000))


def test_the_sources_run_when_told_not_compiled_or_edited_since(tmp_path):
    _tree(tmp_path)
    assert compiled.source_reason(tmp_path, environ={}) is None
    assert compiled.source_reason(tmp_path, environ={compiled.ENV: "0"}) is None
    assert compiled.source_reason(tmp_path, environ={compiled.ENV: "1"}) == f"{compiled.ENV}=1"

    edited = compiled.source_path("kvtrace.cache.block_pool", tmp_path)
    os.utime(edited, (3_000, 3_000))
    reason = compiled.source_reason(tmp_path, environ={})
    assert reason is not None and "kvtrace/cache/block_pool.py changed since it was compiled" in reason

    other = tmp_path / "other"
    _tree(other, skip="kvtrace.cache.manager")
    assert compiled.source_reason(other, environ={}) == "kvtrace.cache.manager was not compiled"
    bare = tmp_path / "bare"
    _tree(bare, shared=False)
    assert compiled.source_reason(bare, environ={}) == "not compiled (installed without mypyc)"


def test_a_process_told_to_runs_every_source():
    code = ("import importlib, kvtrace.compiled as c; import kvtrace.cache; "
            "print(c.mode()); print(*(importlib.import_module(m).__file__ for m in c.COMPILED), sep='\\n')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, compiled.ENV: "1"},
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    mode, *files = proc.stdout.splitlines()
    assert mode == f"pure Python ({compiled.ENV}=1)"
    assert files == [str(compiled.source_path(m)) for m in compiled.COMPILED]


def test_the_kernels_numpy_path_runs_when_told_not_compiled_or_edited_since(tmp_path):
    module = compiled.CYTHON[0]
    pyx = compiled.pyx_path(module, tmp_path)
    pyx.parent.mkdir(parents=True)
    pyx.write_text("")
    os.utime(pyx, (1_000, 1_000))
    not_built = compiled.kernels_reason(module, tmp_path, environ={})
    assert not_built == f"{module} was not compiled (installed without Cython)"
    ext = pyx.with_suffix(EXTENSION_SUFFIXES[0])
    ext.write_bytes(b"")
    os.utime(ext, (2_000, 2_000))
    assert compiled.kernels_reason(module, tmp_path, environ={}) is None
    assert compiled.kernels_reason(module, tmp_path, environ={compiled.ENV: "1"}) == f"{compiled.ENV}=1"
    os.utime(pyx, (3_000, 3_000))
    reason = compiled.kernels_reason(module, tmp_path, environ={})
    assert reason is not None and "_decode.pyx changed since it was compiled" in reason
