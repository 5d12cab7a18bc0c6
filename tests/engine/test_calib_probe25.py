"""Calibration, presets and TOML configs: the twenty-fifth session's probe (truth and bad input)."""

from __future__ import annotations

import pytest

from kvtrace.replay.calibrate import calibrate, fit_report

_HEADER = "num_tokens,prefill_pairs,num_decode_seqs,decode_context_tokens,step_ms\n"
# five steps of the 8B's measurements (AIConfigurator's prefills, Dynamo-like decodes): as many
# measurements as the no-knee model fits terms
_FIVE = ("128,8256,0,0,6.0353\n1024,524800,0,0,21.1795\n2048,2098176,0,0,43.402\n"
         "1,0,1,512,5.5\n64,0,64,65536,8.1\n")


def test_a_fit_of_as_many_measurements_as_terms_marks_every_term_unchecked(tmp_path):
    """Five steps for five terms fitted attn_pair_ps at 9,431 (the 8B's is 807) and kv_read_ps
    at 0: the fit had no residual left to tell a term's error by, so the standard errors were
    set to 0 and the report marked no term, where it can check none. A sixth step marks four
    of them weakly determined."""
    path = tmp_path / "five.csv"
    path.write_text(_HEADER + _FIVE)
    fit = calibrate([path], name="x", knee=0)
    assert len(fit.observations) == len(fit.fitted) == 5
    assert set(fit.weakly_determined()) == set(fit.fitted)
    report = fit_report(fit)
    for term in fit.fitted:
        line = next(line for line in report if line.split()[0] == term)
        assert "unchecked: 5 measurements for 5 fitted terms leave no residual" in line, line
        assert "exactly" not in line  # (a non-negative fit that pins a term at 0 fits them inexactly: re-probe B)
    # one more step: a residual, and standard errors from it (finite ones, shown as numbers)
    path.write_text(_HEADER + _FIVE + "32,0,32,8000,6.3\n")
    six = calibrate([path], name="x", knee=0)
    assert six.weakly_determined() and all(se < float("inf") for se in six.weakly_determined().values())
    assert not any("unchecked" in line for line in fit_report(six))


def _one_at_a_time_bench(path, known, lengths, start_times: bool) -> None:
    """What vllm bench serve saves of requests served one at a time by kvtrace's engine under
    ``known`` (max_concurrency 1; with each request's start time, or without)."""
    import json

    import numpy as np

    from kvtrace.engine import Engine, get_preset
    from kvtrace.workload import TraceRequest

    rng = np.random.default_rng(7)
    reqs = [TraceRequest(f"r{i}", i * 10**10, n, 4, token_ids=rng.integers(1, 160_000, n, dtype=np.int64))
            for i, n in enumerate(lengths)]
    done = {r.request_id: r for r in Engine(get_preset("dense-attention"), cost_model=known,
                                            content=False).run(reqs).requests}
    rs = [done[r.request_id] for r in reqs]
    doc = {"input_lens": [r.num_prompt_tokens for r in rs], "output_lens": [r.num_output_tokens for r in rs],
           "ttfts": [(r.first_token_ns - r.arrival_ns) / 1e9 for r in rs],
           "itls": [[g / 1e9 for g in r.itl_ns] for r in rs], "max_concurrency": 1}
    if start_times:
        doc["start_times"] = [1_000 + r.arrival_ns / 1e9 for r in rs]
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("start_times", [False, True], ids=["no-start-times", "timeline"])
def test_a_prompt_ending_in_a_lone_token_is_fitted_as_the_engine_prices_it(tmp_path, start_times):
    """The engine's clock prices a chunk of one token that ends a prompt (a 1-token prompt, or
    8,193 tokens at a budget of 8,192) as a decoding sequence reading the prompt; calibrate read
    it as a prefill's pairs, so requests served one at a time by the engine under a known model,
    which its docstring says fit exactly, fitted decode_seq_ns 942 for 2,000."""
    from kvtrace.engine.clock import CostModel

    known = CostModel("known", 4_000_000, 15_000, 900, 30_000, 2_000)
    path = tmp_path / "bench.json"
    _one_at_a_time_bench(path, known, [1, 100, 500, 2_000, 8_193, 12_000, 16_385, 20_000], start_times)
    fit = calibrate([path], name="fitted", knee=0)
    assert fit.max_error < 1e-6, fit.max_error
    for c in ("step_overhead_ns", "token_ns", "attn_pair_ps", "kv_read_ps", "decode_seq_ns"):
        assert abs(getattr(fit.model, c) - getattr(known, c)) <= max(1, 1e-6 * getattr(known, c)), c
