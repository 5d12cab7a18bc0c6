"""``kvtrace calibrate`` on measurements a known cost model made (with seeded noise), the
TOML it writes read back and replayed, and the measurements it must refuse in one line."""

from __future__ import annotations

import csv
import json
import os
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kvtrace.engine import clock
from kvtrace.engine.clock import CostModel, StepWork, prefill_pairs
from kvtrace.errors import KVTraceError
from kvtrace.replay.calibrate import calibrate, cost_model_toml, fit_report, observations_from_file
from kvtrace.replay.config_file import load_config_file
from kvtrace.workload import TraceRequest
from kvtrace.workload.native import write_native
from tests.cli.support import assert_one_line, run

CALIBRATION = Path(__file__).resolve().parents[1] / "data" / "calibration" / "aic-h200-llama-3.1-8b-tp1.csv"
KNOWN = CostModel("known", 5_000_000, 12_000, 700, 25_000, 3_000, token_knee=512, token_above_knee_ns=8_000)
HEADER = ["num_tokens", "prefill_pairs", "num_decode_seqs", "decode_context_tokens", "step_ns"]


def _write_steps(path: Path, works: list[StepWork], times_ns: list[float]) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(HEADER)
        for work, t in zip(works, times_ns):
            w.writerow([work.num_tokens, work.prefill_pairs, work.num_decode_seqs, work.decode_context_tokens, t])
    return path


def _varied_steps(seed: int, count: int) -> list[StepWork]:
    """Prefills of several lengths after several cached prefixes, decodes of several batch
    sizes and contexts, and mixed steps: what separates every term of the model."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        seqs = rng.choice([0, 1, 8, 64, 200])
        n = rng.choice([0, 100, 700, 3000, 8000]) if seqs < 200 else 0
        seqs = seqs or (0 if n else 1)
        start = rng.choice([0, 4096, 30000])
        out.append(StepWork(n + seqs, prefill_pairs(start, n) if n else 0, seqs * rng.choice([500, 4000, 20000]), seqs))
    return out


def test_noisy_step_timings_give_the_model_back_within_the_noise(tmp_path):
    """1% seeded noise on every step: the knee is found and every measured step's modelled
    time is within 2% of the known model's."""
    works = _varied_steps(0, 200)
    noise = np.random.default_rng(0).standard_normal(len(works))
    path = _write_steps(tmp_path / "s.csv", works, [KNOWN.step_ns_of(w) * (1 + 0.01 * e) for w, e in zip(works, noise)])
    fit = calibrate([path], name="fitted")
    assert fit.model.token_knee == KNOWN.token_knee
    worst = max(abs(fit.model.step_ns_of(w) - KNOWN.step_ns_of(w)) / KNOWN.step_ns_of(w) for w in works)
    assert worst <= 0.02, worst


_STEPS_HEADER = ",".join(HEADER[:-1]) + ",step_ms\n"
# Steps every one of which is past 512 tokens: prefills of several lengths, and mixed steps
# whose decodes vary in batch and context apart (so that only a knee at or below 512 is unknowable).
_PAST_512 = [StepWork(n, prefill_pairs(0, n)) for n in (600, 900, 3000, 5000)] + [
    StepWork(600 + s, prefill_pairs(1000, 600), s * c, s) for s, c in ((1, 2000), (8, 5000), (64, 1000))]
_NO_KNEE = replace(KNOWN, token_knee=0, token_above_knee_ns=0)
_PAST_512_TEXT = _STEPS_HEADER + "".join(
    f"{w.num_tokens},{w.prefill_pairs},{w.num_decode_seqs},{w.decode_context_tokens},{_NO_KNEE.step_ns_of(w) / 1e6}\n"
    for w in _PAST_512)


@pytest.mark.parametrize(("text", "options", "terms"), [
    # every step the same size: one time, three coefficients (was: token_ns = 100,000, "0.0%")
    (_STEPS_HEADER + "100,5050,0,0,10\n" * 3, [], "step_overhead_ns, token_ns and attn_pair_ps apart"),
    (_STEPS_HEADER + "100,5050,0,0,10\n", [], "(1 observation fixes 1 combination of the 3 coefficients"),
    # decodes whose tokens, sequences and contexts grow together
    (_STEPS_HEADER + "1,0,1,100,5\n2,0,2,200,6\n4,0,4,400,8\n", [], "token_ns, kv_read_ps and decode_seq_ns apart"),
    # a knee below every step: its term is the token term less a constant
    (_PAST_512_TEXT, ["--knee", "512"],
     "cannot tell step_overhead_ns, token_ns and token_above_knee_ns apart with the token knee at 512"),
])
def test_measurements_that_cannot_determine_the_model_are_refused(tmp_path, capsys, text, options, terms):
    path = tmp_path / "s.csv"
    path.write_text(text)
    out = tmp_path / "cost.toml"
    code, stdout, err = run(["calibrate", "--from", str(path), "-o", str(out), *options], capsys)
    assert_one_line(code, err, f"{path}: these measurements cannot tell ", terms)
    assert stdout == "" and not out.exists()


def test_a_bench_result_of_one_prompt_length_is_refused_as_underdetermined(tmp_path):
    """`vllm bench serve --dataset-name random` sends one input length unless told a range: its
    TTFTs cannot split a step's overhead from its tokens."""
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"max_concurrency": 1, "input_lens": [1024] * 4, "output_lens": [4] * 4,
                                "ttfts": [0.1, 0.1, 0.11, 0.1], "itls": [[0.01, 0.011, 0.012]] * 4}))
    with pytest.raises(KVTraceError, match="cannot tell step_overhead_ns, token_ns, attn_pair_ps"):
        calibrate([path], name="x")


def test_a_knee_past_which_every_step_lies_is_passed_over_not_chosen(tmp_path):
    """Default knees: 256 and 512 lie below every step, so their term repeats the token term;
    the fit is the no-knee one (or a knee the steps straddle), never a split it cannot tell."""
    path = tmp_path / "s.csv"
    path.write_text(_PAST_512_TEXT)
    fit = calibrate([path], name="x")
    assert fit.model.token_knee not in (256, 512)
    assert fit.max_error < 1e-6


@pytest.mark.parametrize("name", ['m\U0001f600 "q" \\ end', "\u00e9t\u00e9"])
def test_the_toml_it_writes_reads_back_as_the_same_model_whatever_the_names(tmp_path, capsys, name):
    """json.dumps wrote an emoji as a surrogate pair, which --config refused ('not a Unicode
    scalar value'); a path's DEL, newline and undecodable byte are escaped, not raw."""
    undecodable = tmp_path / os.fsdecode(b"m\xf0\x9f\x98\x80\x7f\n\xff \"x\\.csv")  # (the CLI refuses it)
    undecodable.write_bytes(CALIBRATION.read_bytes())
    fit = calibrate([undecodable], name=name)
    cfg = tmp_path / "cost.toml"
    cfg.write_text(cost_model_toml(fit.model), encoding="utf-8")
    shown = fit.model.source.replace("\udcff", "\\udcff")
    assert load_config_file(cfg).cost_model == replace(fit.model, source=shown)
    odd = tmp_path / "m\U0001f600\x7f\n \"x\\.csv"
    odd.write_bytes(CALIBRATION.read_bytes())
    out = tmp_path / "cli.toml"
    code, _, err = run(["calibrate", "--from", str(odd), "--name", name, "-o", str(out)], capsys)
    assert code == 0, err
    loaded = load_config_file(out).cost_model
    assert (loaded.name, loaded.source) == (name, str(odd))


def test_a_replay_with_the_fitted_config_takes_the_times_the_model_gives(tmp_path, capsys):
    """calibrate -o, then replay --config: a lone 4,096-token prompt's TTFT is its one prefill
    step and each inter-token gap a decode step at its context, as the fitted model prices them."""
    cfg = tmp_path / "cost.toml"
    assert run(["calibrate", "--from", str(CALIBRATION), "--name", "mine", "-o", str(cfg)], capsys)[0] == 0
    model = load_config_file(cfg).cost_model
    trace = tmp_path / "lone.jsonl"
    write_native([TraceRequest("a", 0, 4096, 5, hash_ids=tuple(range(256)), hash_block_size=16)], trace)
    code, out, err = run(["replay", str(trace), "--preset", "dense-attention", "--config", str(cfg), "--json",
                          "--no-content"], capsys)
    assert code == 0, err
    summary = json.loads(out)
    assert summary["cost_model"] == "mine"
    assert summary["p50_ttft_ms"] == pytest.approx(model.step_ns(4096, prefill_pairs(0, 4096), 0, 0, 0, 0) / 1e6,
                                                   abs=1e-6)
    gaps = [model.step_ns(1, 0, 4096 + j, 1, 0, 0) / 1e6 for j in range(1, 5)]
    assert summary["mean_itl_ms"] == pytest.approx(sum(gaps) / len(gaps), abs=1e-6)


_BENCH = {"max_concurrency": 1, "input_lens": [100, 200, 400, 800], "output_lens": [3, 3, 3, 3],
          "ttfts": [0.1, 0.2, 0.3, 0.5], "itls": [[0.01, 0.011], [0.01, 0.012], [0.011, 0.013], [0.012, 0.014]],
          "errors": ["", "", "", ""]}


def test_failed_requests_of_a_vllm_bench_serve_result_are_skipped(tmp_path):
    """vllm bench serve leaves a failed request's TTFT at 0.0 with output_lens 0 and its error
    text (one that failed mid-stream keeps its TTFT): the whole file was refused for the 0.0."""
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_BENCH))
    failed = {k: list(v) if isinstance(v, list) else v for k, v in _BENCH.items()}
    for k, v in (("input_lens", [300, 500]), ("output_lens", [0, 0]), ("ttfts", [0.0, 0.25]),
                 ("itls", [[], [0.02]]), ("errors", ["ClientConnectorError", "stream cut"])):
        failed[k] += v
    bad = tmp_path / "failed.json"
    bad.write_text(json.dumps(failed))
    assert len(observations_from_file(bad)) == len(observations_from_file(good)) == 12
    assert calibrate([bad], name="x").model == replace(calibrate([good], name="x").model, source=str(bad))


@pytest.mark.parametrize(("errors", "needle"), [
    ("none", "errors: expected a list with an entry per request"),
    (["", ""], "errors: expected a list with an entry per request"),
    (["", "", 5, ""], "errors[2]: expected the request's error text, got 5"),
])
def test_a_bench_results_errors_of_the_wrong_shape_are_one_line(tmp_path, errors, needle):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({**_BENCH, "errors": errors}))
    with pytest.raises(KVTraceError, match=f"^{path}: ") as err:
        calibrate([path], name="x")
    assert needle in str(err.value)


def test_more_experts_than_a_cost_model_holds_names_moe(capsys):
    code, out, err = run(["calibrate", "--from", str(CALIBRATION), "--moe", "70000:8"], capsys)
    assert_one_line(code, err, "--moe: 70000:8: expected E:K with 1 <= K < E <= 65,536")
    assert out == ""


def test_the_moe_term_of_a_huge_step_keeps_no_table_past_saturation():
    """A calibrate step of 2^40 tokens with --moe grew the routing table one entry a token
    (a hang, then memory): past the point where every expert is touched it stays there."""
    def reference(e: int, k: int, t: int) -> int:
        q = 1 << 62
        for _ in range(t):
            q = q * (e - k) // e
        return e * ((1 << 62) - q)

    assert clock._experts_touched_fp(97, 3, 10**6) == 97 << 62
    assert len(clock._MOE_TABLES[(97, 3)]) < 10**4
    for t in (0, 1, 2, 50, 1000, 3000):
        assert clock._experts_touched_fp(97, 3, t) == reference(97, 3, t), t


def test_the_report_says_which_terms_no_measurement_exercised():
    lines = fit_report(calibrate([CALIBRATION], name="x"))
    marked = {line.split()[0] for line in lines if line.endswith("(not fitted: no measurement exercises it)")}
    # (the steps copy and load no block; moe: a dense model)
    assert marked == {"kv_copy_ns", "state_copy_ns", "kv_load_ns", "state_load_ns"}
