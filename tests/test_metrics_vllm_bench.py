"""The latency statistics of a run are ``vllm bench serve``'s own: vLLM 0.33's
``calculate_metrics`` (read from the installed ``vllm/benchmarks/serve.py``, run on the
run's stored request spans as a benchmark client would have seen them) gives the summary's
numbers, with requests of one output token (no TPOT, no gap), zero-output requests (one
token, as vLLM's max_tokens >= 1), every ITL gap pooled across requests, np.std's ddof 0,
linear percentiles and fractional ones (``--percentiles 25,75,99.9``).

``calculate_metrics`` is taken out of its module (which needs a GPU build's imports) with
``ast`` and run with numpy: the code is vLLM's, only its module's imports are stubbed.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pytest

from kvtrace import metrics
from kvtrace.replay.run import RunSpec, run_replay
from kvtrace.store import read

VLLM = Path(importlib.util.find_spec("vllm").origin).parent  # type: ignore[union-attr,arg-type]


def _defs(path: Path, names: set[str]) -> list[ast.stmt]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in names]
    assert {n.name for n in found} == names, path  # (a vLLM that renamed them: this test must be redone)
    return list[ast.stmt](found)


@pytest.fixture(scope="module")
def vllm_bench():
    """vLLM's ``calculate_metrics`` and ``RequestFuncOutput``, from the installed sources."""
    space: dict[str, Any] = {"np": np, "warnings": warnings, "dataclass": dataclass, "field": field, "Any": Any,
                             "TERM_PLOTLIB_AVAILABLE": False, "MILLISECONDS_TO_SECONDS_CONVERSION": 1000,
                             "SampleRequest": Any, "TokenizerLike": Any}
    body = (_defs(VLLM / "benchmarks" / "lib" / "endpoint_request_func.py", {"RequestFuncOutput"})
            + _defs(VLLM / "benchmarks" / "serve.py", {"BenchmarkMetrics", "calculate_metrics"}))
    exec(compile(ast.Module(body=body, type_ignores=[]), "vllm-bench-serve", "exec"), space)
    return space["calculate_metrics"], space["RequestFuncOutput"]


def bench_outputs(db: str, run_id: str, output_cls: Any) -> list[Any]:
    """Each stored request as vllm bench serve's client records it (seconds from sending)."""
    with duckdb.connect(db, read_only=True) as con:
        rows = con.sql("""SELECT "SpanAttributes" FROM otel_traces
                          WHERE "RunId" = $r AND "SpanName" = 'kvtrace.request'""", params={"r": run_id}).fetchall()
    outs = []
    for (attrs,) in rows:
        arrival = int(attrs["kvtrace.request.arrival_ns"])
        first = int(attrs["kvtrace.request.first_token_ns"])
        itl = json.loads(attrs.get("kvtrace.request.itl_ns", "[]"))
        outs.append(output_cls(success=True, output_tokens=int(attrs["gen_ai.usage.output_tokens"]),
                               prompt_len=int(attrs["gen_ai.usage.input_tokens"]), start_time=arrival / 1e9,
                               ttft=(first - arrival) / 1e9, itl=[g / 1e9 for g in itl],
                               latency=(first + sum(itl) - arrival) / 1e9))
    return outs


def vllm_keys(m: Any, percentiles: tuple[float, ...]) -> dict[str, float]:
    """BenchmarkMetrics as the result keys vllm bench serve writes (process_one_metric)."""
    out = {}
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std"):
            out[f"{stat}_{name}_ms"] = getattr(m, f"{stat}_{name}_ms")
        for p, v in getattr(m, f"percentiles_{name}_ms"):
            out[f"p{str(int(p)) if int(p) == p else str(p)}_{name}_ms"] = v
    assert len(out) == 4 * (3 + len(percentiles))
    return out


def write_trace(path: Path) -> Path:
    """Requests of 0, 1, 2 and 7 output tokens sharing a prefix, a few arriving at once."""
    lines: list[dict[str, Any]] = [{"kvtrace_trace": 1, "block_size": 64}]
    for i in range(24):
        n = 300 if i % 3 else 256
        lines.append({"request_id": f"q{i}", "arrival_ns": (i // 3) * 4_000_000, "input_length": n,
                      "output_length": (0, 1, 2, 7)[i % 4], "hash_ids": [0, 1, 2, 3 + i % 2, 9][:-(-n // 64)]})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from kvtrace.compare.demo import DEMO_SETTINGS

    tmp = tmp_path_factory.mktemp("bench")
    db = str(tmp / "bench.duckdb")
    pcts = (25.0, 75.0, 99.9)
    short = run_replay(RunSpec(str(write_trace(tmp / "short.jsonl")), name="short outputs", percentiles=pcts), db=db)
    counts = {r["num_output_tokens"] for r in read.requests(db, str(short.run_id)).iter_rows(named=True)}
    assert counts == {1, 2, 7}  # (output_length 0 generates one token, as vLLM's max_tokens >= 1)
    busy = run_replay(RunSpec("gen:mixed", limit=60, name="preempted", **DEMO_SETTINGS), db=db)
    assert busy.summary["preemptions"] > 0  # requests recompute their outputs after a preemption
    return db, {(short.run_id, pcts): short.summary, (busy.run_id, metrics.DEFAULT_PERCENTILES): busy.summary}


def test_every_latency_statistic_is_vllm_bench_serves(store, vllm_bench, capsys):
    calculate_metrics, output_cls = vllm_bench
    db, runs = store
    for (run_id, pcts), summary in runs.items():
        outs = bench_outputs(db, run_id, output_cls)
        m, lens = calculate_metrics(input_requests=[], outputs=outs, dur_s=1.0, tokenizer=None,
                                    selected_percentiles=list(pcts), goodput_config_dict={})
        assert m.completed == summary["requests"] and m.total_input == summary["prompt_tokens"]
        assert m.total_output == summary["output_tokens"] == sum(lens)
        theirs = vllm_keys(m, pcts)
        for view, ours in (("summary", summary), ("store", read.run_summary(db, run_id)),
                           ("samples", read.latency_summary(db, run_id, pcts))):
            for key, value in theirs.items():
                assert ours[key] == pytest.approx(value, rel=1e-9, abs=1e-9), (view, run_id, key)
    capsys.readouterr()  # (calculate_metrics prints a tip)


def test_a_statistic_without_samples_is_null_where_vllm_prints_zero(tmp_path, vllm_bench, capsys):
    """One output token each: no TPOT and no gap. vllm bench serve reports 0 ms (``tpots or
    0``); kvtrace says null, as for a run without a clock, never a 0 that reads as 'instant'."""
    calculate_metrics, output_cls = vllm_bench
    lines = [{"kvtrace_trace": 1, "block_size": 16}] + [
        {"request_id": f"r{i}", "arrival_ns": i * 1000, "input_length": 40, "output_length": i % 2,
         "hash_ids": [0, 1, 2]} for i in range(6)]
    trace = tmp_path / "one.jsonl"
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    db = str(tmp_path / "one.duckdb")
    res = run_replay(RunSpec(str(trace), name="one token"), db=db)
    m, _ = calculate_metrics(input_requests=[], outputs=bench_outputs(db, str(res.run_id), output_cls), dur_s=1.0,
                             tokenizer=None, selected_percentiles=[99.0], goodput_config_dict={})
    capsys.readouterr()
    assert m.mean_tpot_ms == 0.0 and m.percentiles_tpot_ms == [(99.0, 0.0)]
    assert m.mean_itl_ms == 0.0 and m.mean_ttft_ms > 0
    for key in (*metrics.latency_keys("tpot"), *metrics.latency_keys("itl")):
        assert res.summary[key] is None, key
    assert res.summary["mean_ttft_ms"] == pytest.approx(m.mean_ttft_ms, rel=1e-9)
