"""The content on numpy (the CPU's path) and on torch (a GPU's, run here on the CPU) gives
the same events, outputs and summaries: the two are one code path (kvtrace.engine.arrays),
and every value is an exact int64 residue."""

from __future__ import annotations

import pytest

from kvtrace.engine import Engine
from kvtrace.engine.arrays import TORCH_CPU
from kvtrace.replay.digest import encode_event
from tests.engine.test_decode_fast_path import _cases

CASES = ("hybrid-all-on", "attention-swa-mamba", "external-continuation", "kimi-mooncake-preempting",
         "study-shared-prefix-pinning-off", "dense-mixed")


def _run(engine_preset, work, device: str) -> tuple:
    lines: list[str] = []

    def record(batch) -> None:
        lines.append(encode_event(batch.step))
        lines.extend(encode_event(e) for e in batch.cache_events)
        lines.extend(encode_event(e) for e in batch.engine_events)

    res = Engine(engine_preset, audit_interval=7, device=device).run(work, [record])
    return res.summary, res.requests, lines


@pytest.mark.parametrize("name,engine_preset,work", [c for c in _cases() if c[0] in CASES],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_numpy_and_torch_give_the_same_events(name, engine_preset, work):
    numpy_run = _run(engine_preset, work, "cpu")
    torch_run = _run(engine_preset, work, TORCH_CPU)
    assert numpy_run[2] == torch_run[2]  # every step, cache and engine event, in order
    assert numpy_run[1] == torch_run[1]
    assert numpy_run[0] == torch_run[0]
    assert numpy_run[0]["divergent_outputs"] == 0 and numpy_run[0]["stale_hashes"] == 0


def test_a_cpu_run_never_imports_torch():
    import subprocess
    import sys

    code = ("import sys\nfrom kvtrace.engine import Engine\nfrom kvtrace.replay.generate import generate\n"
            "s = Engine('kimi-hybrid', device='cpu').run(generate('chat', 0, 20)).summary\n"
            "assert s['requests'] == 20 and s['divergent_outputs'] == 0\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip() == "False", out.stderr



def test_the_default_device_is_numpy_also_beside_a_gpu(monkeypatch):
    """Unnamed, the device is ``cpu`` (numpy), also where torch sees a GPU: a step's arrays
    are too small for one to pay (README, Benchmarks: bench/gpu_check.sh on an H200)."""
    import torch

    from kvtrace.engine.memory import DEVICE_ENV, default_device_type

    monkeypatch.delenv(DEVICE_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    assert default_device_type() == "cpu"
    monkeypatch.setenv(DEVICE_ENV, TORCH_CPU)  # named, it is taken
    assert default_device_type() == TORCH_CPU
