"""Calibration, presets and TOML configs: the twenty-seventh session's probe (truth first)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kvtrace.engine import Engine, get_preset
from kvtrace.engine.clock import CostModel, prefill_pairs
from kvtrace.errors import KVTraceError
from kvtrace.replay.calibrate import calibrate, fit_report
from kvtrace.workload import VOCAB_SIZE, TraceRequest

DATA = Path(__file__).resolve().parents[1] / "data" / "calibration"

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


def test_a_day_of_step_rows_is_fitted_without_a_square_matrix_of_its_rows(tmp_path, monkeypatch):
    """The fit's rank check took the full SVD of the design: a U of rows x rows. 20,000 step rows
    (a few minutes of a busy server) ran past two minutes, 200,000 ran out of memory. The right
    singular vectors it needs come from the thin SVD; with fewer rows than terms, from the full one."""
    from kvtrace.engine import costfit

    shapes: list[tuple[int, ...]] = []
    svd = np.linalg.svd

    def recording_svd(a, *args, **kwargs):
        out = svd(a, *args, **kwargs)
        shapes.append(out[0].shape)
        return out

    monkeypatch.setattr(costfit.np.linalg, "svd", recording_svd)
    known = CostModel("known", 1_000_000, 10_000, 800, 30_000, 5_000)
    rng = np.random.default_rng(27)
    rows = []
    for i in range(3_000):
        if i % 2:
            n, s = int(rng.integers(2, 8192)), int(rng.integers(0, 50_000))
            work = (n, prefill_pairs(s, n), 0, 0)
        else:
            b = int(rng.integers(1, 256))
            work = (b, 0, b * int(rng.integers(1, 30_000)), b)
        rows.append(f"{work[0]},{work[1]},{work[3]},{work[2]},{known.step_ns(*work, 0, 0)}\n")
    path = tmp_path / "steps.csv"
    path.write_text("num_tokens,prefill_pairs,num_decode_seqs,decode_context_tokens,step_ns\n" + "".join(rows))
    fit = calibrate([path], name="fitted", knee=0)
    assert shapes and max(shape[0] * shape[-1] for shape in shapes) <= 3_000 * 6, shapes
    assert fit.max_error < 1e-3
    assert {t: getattr(fit.model, t) for t in ("step_overhead_ns", "token_ns", "attn_pair_ps", "kv_read_ps",
                                               "decode_seq_ns")} == {
        "step_overhead_ns": 1_000_000, "token_ns": 10_000, "attn_pair_ps": 800, "kv_read_ps": 30_000,
        "decode_seq_ns": 5_000}
    # fewer rows than terms: the full SVD still finds the terms they cannot tell apart
    path.write_text("num_tokens,prefill_pairs,num_decode_seqs,decode_context_tokens,step_ns\n" + "".join(rows[:2]))
    with pytest.raises(KVTraceError, match="cannot tell"):
        calibrate([path], name="fitted", knee=0)


def test_the_fit_reads_each_steps_terms_once_for_all_its_knee_candidates(monkeypatch):
    """Each knee candidate summed every step's term values again, though only the column of
    tokens past the knee depends on it: five passes over a million bench observations. The
    design at each knee is the same matrix, bit for bit, from one pass."""
    from kvtrace.engine import costfit
    from kvtrace.replay.calibrate import observations_from_file

    path = DATA / "aic-h200-llama-3.1-8b-tp1.csv"
    observations = observations_from_file(path)
    template = CostModel("t", 0, 0, 0, 0, 0)
    for knee in (*costfit.KNEE_CANDIDATES, 1, 100_000):
        want = costfit._design(observations, replace(template, token_knee=knee))
        got = costfit._Designs(observations, template).at(knee)
        assert want.tobytes() == got.tobytes(), knee
    calls = []
    term_values = costfit.term_values
    monkeypatch.setattr(costfit, "term_values", lambda *args: calls.append(1) or term_values(*args))
    fit = calibrate([path], name="fitted", template=template)
    assert len(calls) == sum(len(o.work) for o in observations)
    assert (fit.model.token_knee, fit.model.token_ns) == (512, 11_675)  # (h200-dense-8b's, as before)


def test_the_schema_says_what_an_unset_checkpoint_alignment_is(tmp_path):
    """The schema's example (a kimi-hybrid config) said the alignment is 1 (Mamba2, GDN) when
    unset; under kimi-hybrid an unset alignment is the preset's 16, and 1 only where no preset
    sets one (groups of a preset without Mamba given a Mamba group and a checkpoint)."""
    from kvtrace.replay import config_file
    from kvtrace.replay.run import RunSpec, engine_preset

    line = next(line for line in (config_file.__doc__ or "").splitlines()
                if line.startswith("prefill_checkpoint_alignment"))
    assert "unset: the preset's (kimi-hybrid: 16), else 1 (Mamba2, GDN)" in line, line
    hybrid = tmp_path / "hybrid.toml"
    hybrid.write_text('preset = "kimi-hybrid"\n[cache]\nnum_prefill_checkpoint_blocks = 1\n')
    assert engine_preset(RunSpec("gen:mixed", config_file=str(hybrid))).cache_config.prefill_checkpoint_alignment == 16
    dense = tmp_path / "dense.toml"
    dense.write_text('preset = "dense-attention"\n[cache]\ngroups = [{ type = "full_attention", block_size = 16 }, '
                     '{ type = "mamba", block_size = 16 }]\nnum_prefill_checkpoint_blocks = 1\n')
    assert engine_preset(RunSpec("gen:mixed", config_file=str(dense))).cache_config.prefill_checkpoint_alignment == 1
