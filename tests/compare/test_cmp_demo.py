"""kvtrace demo's diffs say whose cache manager made each run, as kvtrace diff does."""

from __future__ import annotations

import io

from rich.console import Console

from kvtrace.compare.demo import run_demo


def test_the_demos_diffs_through_vllm_name_each_runs_backend(tmp_path, vllm_api):
    """`demo --backend vllm` sets kvtrace's manager with a behaviour off (A) against vLLM's
    all on (B); its diff tables never said so (kvtrace diff of the same runs does)."""
    from kvtrace.metrics import backend_label
    from kvtrace.store import read

    out = io.StringIO()
    result = run_demo(tmp_path / "v.duckdb", progress=False, console=Console(file=out, width=250), limit=8,
                      backend="vllm")
    on = read.run(tmp_path / "v.duckdb", result.runs[0][1].run_id)
    label = backend_label(on["mode"], on["config"])
    assert label is not None and label.startswith("vllm ")
    assert out.getvalue().count(f"Backend: A kvtrace · B {label}\n") == len(result.diffs) == 3
    plain = io.StringIO()
    run_demo(tmp_path / "k.duckdb", progress=False, console=Console(file=plain, width=250), limit=8)
    assert "Backend:" not in plain.getvalue()  # (kvtrace's own on both sides: nothing to say, as diff)
