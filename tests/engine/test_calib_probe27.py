"""Calibration, presets and TOML configs: the twenty-seventh session's probe (truth first)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np

from kvtrace.engine import Engine, get_preset
from kvtrace.engine.clock import CostModel, prefill_pairs
from kvtrace.replay.calibrate import calibrate, fit_report
from kvtrace.workload import VOCAB_SIZE, TraceRequest

# one step costs 1 ms and nothing else: a request's TTFT counts its prefill steps
_ONE_MS_A_STEP = CostModel("one-ms-a-step", step_overhead_ns=1_000_000, token_ns=0, attn_pair_ps=0, kv_read_ps=0,
                           decode_seq_ns=0)


def _prefill_steps(preset_name: str, prompt: int) -> float:
    """How many steps a lone prompt of distinct tokens takes to its first token on ``preset_name``."""
    preset = replace(get_preset(preset_name), cost_model=_ONE_MS_A_STEP)
    tokens = np.random.default_rng(prompt).integers(0, VOCAB_SIZE, prompt, dtype=np.int64)
    summary = Engine(preset, verify=False).run([TraceRequest("lone", 0, prompt, 2, token_ids=tokens)]).summary
    return summary["p50_ttft_ms"]


def test_the_ttft_note_says_distinct_prompts_do_not_keep_a_hybrid_prefill_in_one_chunk(tmp_path):
    """calibrate reads a TTFT as its prompt in chunks of the budget, and its report said to
    measure without prefix caching "or distinct prompts". A hybrid model's server with prefix
    caching (vLLM's mamba_cache_mode "align", and kvtrace's kimi-hybrid) cuts each prefill at its
    Mamba blocks, distinct prompts or not: a 512-token prompt is two steps there, one on a model
    of attention alone, and a bench of kimi-hybrid replayed one request at a time fitted 32% off
    with decode_seq_ns 60x the truth. The note now says distinct prompts suffice for attention alone."""
    assert _prefill_steps("dense-attention", 512) == 1.0
    assert _prefill_steps("kimi-hybrid", 512) > 1.0  # (the split the note warns of)
    known = CostModel("known", 1_000_000, 10_000, 800, 30_000, 5_000)
    lengths = [600, 1200, 2500, 5000, 9000, 12000]
    doc: dict[str, list] = {"input_lens": lengths, "output_lens": [4] * 6, "ttfts": [], "itls": []}
    for n in lengths:
        doc["ttfts"].append(sum(known.step_ns(k, prefill_pairs(s, k), 0, 0, 0, 0) / 1e9
                                for s, k in ((s, min(8192, n - s)) for s in range(0, n, 8192))))
        doc["itls"].append([known.step_ns(1, 0, n + j, 1, 0, 0) / 1e9 for j in (1, 2, 3)])
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"max_concurrency": 1, **doc}))
    note = [line for line in fit_report(calibrate([path], name="fitted", knee=0)) if "whole prompt prefilled" in line]
    assert len(note) == 1, note
    assert "hybrid model" in note[0] and "Mamba blocks" in note[0], note
    assert "distinct prompts to a model of attention alone" in note[0], note
