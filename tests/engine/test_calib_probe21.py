"""Probes of `kvtrace calibrate` and `--config`'s [cost_model] (session 21): step rows no engine
runs, a duration given twice, numbers no CSV writer means, models of no time, a knee term
without its knee, and a weak term's standard error under one unit."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvtrace.errors import ConfigError, KVTraceError
from kvtrace.replay.calibrate import calibrate, fit_report
from kvtrace.replay.config_file import load_config_file
from tests.cli.support import assert_one_line, run

HEADER = "num_tokens,prefill_pairs,num_decode_seqs,decode_context_tokens,step_ms\n"
# steps enough to fit the five terms, the rows under test go first (the first bad row is named)
GOOD = "128,8256,0,0,6.0\n512,131328,0,0,11.5\n2048,2098176,0,0,43.4\n1,0,1,512,5.1\n64,0,64,65536,7.9\n"
FIVE = ("step_overhead_ns", "token_ns", "attn_pair_ps", "kv_read_ps", "decode_seq_ns")


@pytest.mark.parametrize(("row", "needle"), [
    # the context and the sequences swapped: 512 sequences decoding in a step of one token
    ("1,0,512,1,5.1\n", ":2: num_decode_seqs: 512 decoding sequences in a step of 1 tokens"),
    ("8,100,8,800,6\n", ":2: prefill_pairs: 100 with no prefill token"),
    ("100,50,0,0,6\n", ":2: prefill_pairs: 50 for 100 prefill tokens"),
    ("100,5050,0,4000,6\n", ":2: decode_context_tokens: 4,000 with no decoding sequence"),
    ("8,0,8,4,6\n", ":2: decode_context_tokens: 4 for 8 decoding sequences"),
])
def test_a_step_row_no_engine_runs_is_refused_at_its_line(tmp_path, row, needle):
    """Such a row (a column swapped, or in another unit) was fitted as it stood: a model of
    the wrong terms came out with a plausible error."""
    path = tmp_path / "s.csv"
    path.write_text(HEADER + row + GOOD)
    with pytest.raises(KVTraceError, match=re.escape(f"{path}{needle}")) as err:
        calibrate([path], name="x")
    assert "are the columns as the header names them?" in str(err.value)


def test_the_shipped_step_files_are_steps_an_engine_runs():
    for path in sorted((Path(__file__).resolve().parents[1] / "data" / "calibration").glob("*.csv")):
        assert calibrate([path], name="x").observations


def test_a_step_file_with_both_step_ms_and_step_ns_is_refused(tmp_path):
    """step_ns was read and step_ms ignored without a word, whatever the two said."""
    path = tmp_path / "s.csv"
    rows = "".join(f"{line},{float(line.rsplit(',', 1)[1]) * 1e6 * 2:.0f}\n" for line in GOOD.splitlines())
    path.write_text(HEADER.strip() + ",step_ns\n" + rows)
    with pytest.raises(KVTraceError, match=re.escape(f"{path}:1: columns step_ms and step_ns both given")):
        calibrate([path], name="x")


@pytest.mark.parametrize("text", ["1_000", "\u0661\u0662", "\uff11\uff12"])
def test_a_step_time_not_in_ascii_decimal_is_refused(tmp_path, text):
    """float() took '1_000' as 1,000 ms and Arabic-Indic or full-width digits as 12 ms."""
    path = tmp_path / "s.csv"
    path.write_text(HEADER + f"128,8256,0,0,{text}\n" + GOOD, encoding="utf-8")
    with pytest.raises(KVTraceError, match=re.escape(f"{path}:2: step_ms: expected a number in [0.001, 3,600,000], "
                                                     f"got {text!r}")):
        calibrate([path], name="x")


def test_a_fit_whose_every_coefficient_rounds_to_zero_is_refused(tmp_path, capsys):
    """Times far too small for their work rounded every coefficient to 0: the model was
    printed and written, and every replay with it showed latencies of 0 ms."""
    path = tmp_path / "s.csv"
    path.write_text("num_tokens,prefill_pairs,num_decode_seqs,decode_context_tokens,step_ns\n"
                    "1000000000000,1000000000000,0,0,1000\n2000000000000,3000000000000,0,0,2500\n"
                    "3000000000000,9000000000000,0,0,4000\n4000000000000,4000000000000,0,0,4000\n")
    out = tmp_path / "cost.toml"
    code, stdout, err = run(["calibrate", "--from", str(path), "-o", str(out)], capsys)
    assert_one_line(code, err, f"{path}: the fit gives every coefficient 0")
    assert stdout == "" and not out.exists()


def test_a_weak_term_under_one_unit_shows_its_standard_error(tmp_path):
    """A term fitted at 0 with a standard error under 1 read "token_ns = 0  (± 0: weakly
    determined ...)": a zero error beside a term said to be unknown."""
    path = tmp_path / "s.csv"
    path.write_text("num_tokens,prefill_pairs,num_decode_seqs,decode_context_tokens,step_ns\n"
                    "1000000000,1000000000,0,0,1000\n2000000000,2000000000,0,0,2000\n"
                    "3000000000,4000000000,0,0,3500\n4,0,4,4000,1500\n8,0,8,16000,2500\n3,0,3,9000,1800\n")
    fit = calibrate([path], name="x")
    small = {t: se for t, se in fit.weakly_determined().items() if se < 0.5}
    assert small, fit.standard_errors  # (the case under test: one shown as 0 before)
    report = fit_report(fit)
    for term, se in small.items():
        line = next(line for line in report if line.split()[0] == term)
        shown = re.search(r"\(± ([^:]+):", line)
        assert shown is not None and float(shown.group(1)) == pytest.approx(se, rel=0.05), line


def _model(**coefficients: int) -> str:
    return "[cost_model]\nname = \"mine\"\n" + "".join(f"{k} = {coefficients.get(k, 0)}\n" for k in FIVE) + "".join(
        f"{k} = {v}\n" for k, v in coefficients.items() if k not in FIVE)


@pytest.mark.parametrize(("coefficients", "key", "needle"), [
    ({}, "cost_model", "mine: every coefficient is 0: each step would take no time"),
    ({"token_knee": 512}, "cost_model", "mine: every coefficient is 0"),  # (a knee alone is no time)
    ({"token_ns": 10, "token_above_knee_ns": 5}, "cost_model.token_above_knee_ns",
     "5 has no effect without token_knee"),
    # (a step's tokens cost nothing: a prefill-only step took 0 ns, its TTFT 0 ms; twenty-sixth session)
    ({"decode_seq_ns": 1_000_000}, "cost_model.step_overhead_ns", "mine: step_overhead_ns and token_ns are both 0"),
    ({"kv_copy_ns": 5}, "cost_model.step_overhead_ns", "mine: step_overhead_ns and token_ns are both 0"),
    ({"token_knee": 256, "token_above_knee_ns": 5}, "cost_model.step_overhead_ns", "mine: step_overhead_ns"),
    ({"attn_pair_ps": 999, "kv_read_ps": 30_000}, "cost_model.step_overhead_ns", "mine: step_overhead_ns"),
    ({"attn_pair_ps": 2_000}, "cost_model.step_overhead_ns", "mine: step_overhead_ns and token_ns are both 0 "
                                                             "(and no moe_expert_ns): a decode of one sequence"),
])
def test_a_cost_model_table_that_cannot_mean_what_it_says_names_file_and_key(tmp_path, coefficients, key, needle):
    path = tmp_path / "run.toml"
    path.write_text(_model(**coefficients))
    with pytest.raises(ConfigError, match=re.escape(f"{path}: {key}: {needle}")):
        load_config_file(path)


def test_a_cost_model_table_of_one_time_term_or_a_knee_term_with_its_knee_is_taken(tmp_path):
    path = tmp_path / "run.toml"
    for coefficients in ({"step_overhead_ns": 1}, {"token_ns": 1}, {"token_ns": 1, "kv_copy_ns": 5},
                         {"step_overhead_ns": 1, "token_knee": 256, "token_above_knee_ns": 5},
                         {"moe_expert_ns": 3, "num_experts": 8, "experts_per_token": 2},
                         {"attn_pair_ps": 1_000, "kv_read_ps": 1_000}, {"attn_pair_ps": 1_000, "decode_seq_ns": 1}):
        path.write_text(_model(**coefficients))
        model = load_config_file(path).cost_model
        assert model is not None and all(getattr(model, k) == v for k, v in coefficients.items())


def test_calibrate_out_refuses_a_run_config_with_other_settings_and_keeps_it(tmp_path, capsys):
    """`-o run.toml` replaced the user's --config file whole: its preset and [cache] were lost
    without a word. A file of a [cost_model] alone (an earlier fit) is replaced as before."""
    steps = Path(__file__).resolve().parents[1] / "data" / "calibration" / "aic-h200-llama-3.1-8b-tp1.csv"
    config = tmp_path / "run.toml"
    text = 'preset = "dense-attention"\n[cache]\nnum_gpu_blocks = 20000\n'
    config.write_text(text)
    code, stdout, err = run(["calibrate", "--from", str(steps), "-o", str(config)], capsys)
    assert_one_line(code, err, f"{config}: a --config file with settings besides [cost_model] (cache, preset)")
    assert stdout == "" and config.read_text() == text
    earlier = tmp_path / "cost.toml"
    earlier.write_text('[cost_model]\nname = "old"\nstep_overhead_ns = 1\ntoken_ns = 1\nattn_pair_ps = 1\n'
                       'kv_read_ps = 1\ndecode_seq_ns = 1\n')
    code, stdout, err = run(["calibrate", "--from", str(steps), "-o", str(earlier)], capsys)
    assert code == 0, err
    assert load_config_file(earlier).cost_model == calibrate([steps], name="calibrated").model


@pytest.mark.parametrize("text", ['[cache]\nnum_gpu_blocks = 100\nhash_block_size = \n',  # a typo
                                  "TIMESTAMP,ContextTokens,GeneratedTokens\n0,1,2\n",  # another file
                                  '{"timestamp": 0, "input_length": 3}\n'])
def test_calibrate_out_refuses_an_existing_file_that_is_no_toml(tmp_path, capsys, text):
    """A run config with one typo, a trace or a measurements file (no TOML to read its tables)
    was replaced by the fitted model without a word."""
    steps = Path(__file__).resolve().parents[1] / "data" / "calibration" / "aic-h200-llama-3.1-8b-tp1.csv"
    out = tmp_path / "x.toml"
    out.write_text(text)
    code, stdout, err = run(["calibrate", "--from", str(steps), "-o", str(out)], capsys)
    assert_one_line(code, err, f"{out}: exists and is no cost-model TOML (")
    assert stdout == "" and out.read_text() == text


def test_calibrate_from_a_replay_run_of_a_store_says_it_is_no_collected_run(replayed_store):
    """`--run` of a replay said only "no vLLM llm_request spans ... (start vLLM with
    --otlp-traces-endpoint ...)", as if the collection had missed them."""
    with pytest.raises(KVTraceError, match=re.escape(
            f"{replayed_store.path}: run {replayed_store.run_on}: no vLLM llm_request spans: it is a replay (engine "
            "mode), not a collected run (the store's collected runs: none)")):
        calibrate([replayed_store.path], name="x", run_id=replayed_store.run_on)


def test_groups_of_attention_alone_get_no_state_budget_of_the_preset():
    """kimi-hybrid budgets 2,048 blocks for Mamba states; groups replacing its own with
    attention alone (a --config's) took them as attention blocks: --capacity-tokens 100,000
    gave a pool of 3,611 64-token blocks (231k tokens), and --block-size kept neither the
    pool's token capacity nor its blocks."""
    from kvtrace.cache import FullAttentionSpec
    from kvtrace.engine.presets import PRESETS, get_preset
    from kvtrace.numeric import cdiv

    attention = (FullAttentionSpec(64),)
    sized = get_preset("kimi-hybrid", groups=attention, capacity_tokens=100_000, retention_interval=None)
    assert sized.cache_config.num_gpu_blocks == 1 + cdiv(100_000, 64) and sized.state_blocks == 0
    as_given = get_preset("kimi-hybrid", groups=attention, retention_interval=None).cache_config.num_gpu_blocks
    assert as_given == PRESETS["kimi-hybrid"]().cache_config.num_gpu_blocks
    halved = get_preset("kimi-hybrid", groups=attention, block_size=32, retention_interval=None)
    assert (halved.cache_config.num_gpu_blocks - 1) * 32 == (as_given - 1) * 64  # (the same tokens)
    # (its own groups: the budget is kept where the pool is re-blocked; a pool in tokens is the pool, which
    # the states share, as --capacity-blocks's is)
    hybrid = get_preset("kimi-hybrid", capacity_tokens=100_000)
    assert hybrid.cache_config.num_gpu_blocks == 1 + cdiv(100_000, 512) and hybrid.state_blocks == 2_048


def test_the_readme_figures_of_an_external_hit_are_the_8b_models():
    """The README said prefilling a 1,280-token hit costs about 15 ms: token_ns alone. The
    model charges those tokens past the knee and their pairs too: what the hit saves a
    2,048-token prompt is about 27 ms."""
    from kvtrace.engine.clock import COST_MODELS, prefill_pairs

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    said = re.search(r"A\s+1,280-token external hit on the 8B then costs ([\d.]+) ms where prefilling it costs "
                     r"about ([\d.]+) ms", readme)
    assert said is not None
    m, hit, prompt = COST_MODELS["h200-dense-8b"], 1_280, 2_048
    saved = m.step_ns(prompt, prefill_pairs(0, prompt), 0, 0, 0, 0) - m.step_ns(
        prompt - hit, prefill_pairs(hit, prompt - hit), 0, 0, 0, 0)
    assert said.group(1) == f"{m.kv_load_ns * hit / 1e6:.1f}"
    assert said.group(2) == f"{saved / 1e6:.0f}"


def test_the_config_schema_the_readme_points_to_names_every_key_the_reader_takes(tmp_path):
    """README: '--config FILE.toml (... schema in kvtrace/replay/config_file.py)'; its
    [scheduler] example left out max_model_len and enable_chunked_prefill, which it reads."""
    from kvtrace.replay import config_file

    schema = config_file.__doc__ or ""
    for section, keys in (("cache", config_file._CACHE_KEYS), ("scheduler", config_file._SCHEDULER_KEYS)):
        table = schema[schema.index(f"[{section}]"):]
        table = table[:table.index("\n\n")]
        for key in keys:
            assert re.search(rf"^{key} = ", table, flags=re.M), (section, key)
    document = schema[schema.index("```toml") + len("```toml"):schema.index("```\n\nUnknown")]
    path = tmp_path / "example.toml"
    path.write_text(document)
    loaded = load_config_file(path)  # (the example is a file the reader takes)
    assert set(loaded.scheduler) == set(config_file._SCHEDULER_KEYS)


@pytest.mark.parametrize("moe", ["1:1", "8:8", "65536:65536"])
def test_moe_with_every_expert_per_token_is_refused_at_the_flag(capsys, moe):
    """K = E: the experts-touched term is E in every step, which no fit tells from the
    step overhead; the fit was run and said only that the two could not be told apart."""
    steps = Path(__file__).resolve().parents[1] / "data" / "calibration" / "aic-h200-llama-3.1-8b-tp1.csv"
    code, stdout, err = run(["calibrate", "--from", str(steps), "--moe", moe], capsys)
    assert_one_line(code, err, f"--moe: {moe}: with K = E every step touches all", "expected K < E")
    assert stdout == ""
