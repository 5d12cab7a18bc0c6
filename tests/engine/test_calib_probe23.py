"""The twenty-third session's probe of calibration, cost models, presets and TOML configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtrace.engine.clock import CostModel, prefill_pairs
from kvtrace.errors import ConfigError
from kvtrace.replay.calibrate import calibrate
from kvtrace.replay.config_file import load_config_file

KNOWN = CostModel("known", 4_000_000, 15_000, 900, 30_000, 2_000)


def _bench_one_at_a_time(model: CostModel, lengths: list[int], budget: int = 8192) -> dict:
    """A ``vllm bench serve`` result of requests served one at a time by ``model``: each TTFT
    its prompt's chunks of ``budget``, each gap one decode step (no start_times)."""
    ins, outs, ttfts, itls = [], [], [], []
    for i, n in enumerate(lengths):
        o = 4 + i % 5
        ttft, start = 0, 0
        while start < n:
            chunk = min(budget, n - start)
            ttft += model.step_ns(chunk, prefill_pairs(start, chunk), 0, 0, 0, 0)
            start += chunk
        ins.append(n)
        outs.append(o)
        ttfts.append(ttft / 1e9)
        itls.append([model.step_ns(1, 0, n + j, 1, 0, 0) / 1e9 for j in range(1, o)])
    return {"max_concurrency": 1, "input_lens": ins, "output_lens": outs, "ttfts": ttfts, "itls": itls}


def test_a_bench_result_with_a_gap_more_than_its_tokens_still_fits_exactly(tmp_path):
    """vllm bench serve times every streamed chunk that has choices, an empty one too, so a
    request can have more gaps than output tokens - 1. Without start_times each gap was read as
    a decode step: one trailing gap of 2 us among 53 observations fitted every coefficient but
    the token terms to 0, median error 100% (the timeline reading, with start_times, took the
    request's gaps together, as it does those of a client that read several tokens a chunk)."""
    doc = _bench_one_at_a_time(KNOWN, [100, 300, 700, 1500, 3000, 6000, 9000, 12000, 20])
    doc["itls"][2].append(2e-6)  # request 2: one gap more than its tokens after the first
    doc["itls"][4].append(3e-6)
    doc["output_lens"].append(1)  # a request of one token, and a chunk after it: no decode step
    doc["input_lens"].append(500)
    doc["ttfts"].append(KNOWN.step_ns(500, prefill_pairs(0, 500), 0, 0, 0, 0) / 1e9)
    doc["itls"].append([2e-6])
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(doc))
    fit = calibrate([path], name="fitted", knee=0)
    assert fit.max_error < 1e-3, fit.max_error  # (the empty chunks' few microseconds, in their requests' decodes)
    for c in ("step_overhead_ns", "token_ns", "attn_pair_ps", "kv_read_ps", "decode_seq_ns"):
        assert abs(getattr(fit.model, c) - getattr(KNOWN, c)) <= max(100, 0.01 * getattr(KNOWN, c)), (c, fit.model)


@pytest.mark.parametrize("text, key, hint", [
    ("[cache]\nnum_gpu_block = 100\n", "cache.num_gpu_block", "(did you mean num_gpu_blocks?)"),
    ("[scheduler]\nmax_num_batched_token = 100\n", "scheduler.max_num_batched_token",
     "(did you mean max_num_batched_tokens?)"),
    ("presett = 'kimi-hybrid'\n", "presett", "(did you mean preset?)"),
    ("num_gpu_blocks = 100\n", "num_gpu_blocks", "here (it belongs in [cache])"),
    ("[cache]\nmax_num_seqs = 4\n", "cache.max_num_seqs", "here (it belongs in [scheduler])"),
    ("[scheduler]\ntoken_ns = 4\n", "scheduler.token_ns", "here (it belongs in [cost_model])"),
    ("[cost_model]\nname = 'x'\nexperts_per_tokn = 1\n", "cost_model.experts_per_tokn",
     "(did you mean experts_per_token?)"),
    ("[cache]\ngroups = [{type = 'full_attention', block_sise = 16}]\n", "cache.groups[0].block_sise",
     "(did you mean block_size?)"),
    ("[cache]\ngroups = [{type = 'full_atention', block_size = 16}]\n", "cache.groups[0].type",
     "(did you mean full_attention?)"),
])
def test_an_unknown_key_is_told_the_key_it_is_likely_a_typo_of(tmp_path, text, key, hint):
    """A typo'd key was refused with the list of every key its section knows (eleven in
    [cache]) and no word of which was meant; a key of another section, or of a section given
    at the top, was 'unknown' where it is only misplaced."""
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config_file(path)
    message = str(info.value)
    assert message.startswith(f"{path}: {key}: "), message
    assert hint in message, message
    assert "\n" not in message


def test_a_key_like_none_the_section_knows_is_given_no_guess(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[cache]\nzzz = 1\n")
    with pytest.raises(ConfigError, match=r"cache\.zzz: unknown key; expected one of \[") as info:
        load_config_file(path)
    assert "did you mean" not in str(info.value) and "belongs in" not in str(info.value)


def test_calibrate_says_it_prints_the_error_per_kind_of_measurement_as_it_does(tmp_path, capsys):
    """The help and the README said 'its error per term': the report gives the error per kind
    of measurement (prefill, decode) and a value, not an error, per term."""
    from tests.cli.support import run

    data = tmp_path / "steps.csv"
    rows = ["num_tokens,prefill_pairs,num_decode_seqs,decode_context_tokens,step_ns"]
    for n in (128, 512, 2048, 8192):
        rows.append(f"{n},{prefill_pairs(0, n)},0,0,{KNOWN.step_ns(n, prefill_pairs(0, n), 0, 0, 0, 0)}")
    for seqs, ctx in ((1, 512), (8, 4096), (64, 65536), (256, 1 << 20), (16, 2048)):
        rows.append(f"{seqs},0,{seqs},{ctx},{KNOWN.step_ns(seqs, 0, ctx, seqs, 0, 0)}")
    data.write_text("\n".join(rows) + "\n")
    code, out, err = run(["calibrate", "--from", str(data), "--knee", "0"], capsys)
    assert code == 0, err
    report = out.splitlines()
    kinds = [line.split(":")[0].strip() for line in report if "median |error|" in line]
    assert kinds == ["decode", "prefill"], report
    assert not any("error" in line for line in report if " = " in line), report  # a term has a value
    code, out, _ = run(["calibrate", "--help"], capsys)
    assert code == 0
    said = " ".join(out.split())
    assert "error per kind of measurement" in said and "error per term" not in said, said
    readme = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text().split())
    assert "fit error per term" not in readme
    assert "per kind (prefill, decode)" in readme


def test_flags_beside_a_config_file_do_what_its_schema_says(tmp_path):
    """The schema said flags override every key; --without adds to the file's without (both
    behaviours go off), as the schema now says, and the other flags take their key's place."""
    from kvtrace.replay.run import RunSpec, engine_preset

    path = tmp_path / "run.toml"
    path.write_text('preset = "dense-attention"\n[cache]\nnum_gpu_blocks = 300\nwithout = ["shared-prefix-pinning"]\n'
                    "[scheduler]\nmax_num_seqs = 7\n")
    from kvtrace.replay import config_file

    schema = " ".join((config_file.__doc__ or "").split())
    assert "--without adds to these" in schema and "as flags do every key" not in schema
    preset = engine_preset(RunSpec("gen:mixed", config_file=str(path), without=("transient-checkpoint-retention",)))
    assert preset.name == "dense-attention" and preset.cache_config.num_gpu_blocks == 300
    assert not {"shared-prefix-pinning", "transient-checkpoint-retention"} & preset.cache_config.behaviours
    assert preset.scheduler_config.max_num_seqs == 7
    preset = engine_preset(RunSpec("gen:mixed", preset="kimi-hybrid", capacity_blocks=500, config_file=str(path)))
    assert preset.name == "kimi-hybrid" and preset.cache_config.num_gpu_blocks == 500


def test_the_config_flags_help_says_a_flag_beside_it_wins():
    """--config's help said "TOML settings overriding the preset" and nothing of the flags beside it."""
    from typer.testing import CliRunner

    from kvtrace.cli import app

    shown = " ".join(CliRunner().invoke(app, ["replay", "--help"], env={"COLUMNS": "200"}).output.split())
    assert "a flag beside it overrides the key it sets (--without adds to the file's without)" in shown


def test_a_fit_of_ttfts_says_they_are_read_as_whole_prompts_prefilled(tmp_path):
    """Neither a bench result nor vLLM's spans say how many prompt tokens hit the prefix cache
    (on by default in vLLM): a cached 512-token system prompt in two thirds of the requests
    fitted 0 ns of step overhead, attn_pair_ps twice the truth and 4 ms a decoding sequence at
    a median error of 0.0%, and nothing in the report said what the TTFTs were taken to be."""
    from kvtrace.replay.calibrate import fit_report

    doc = _bench_one_at_a_time(KNOWN, [600, 1200, 2500, 5000, 9000, 12000])
    for i, n in enumerate(doc["input_lens"][:3]):  # these three found a 512-token prefix cached
        doc["ttfts"][i] = KNOWN.step_ns(n - 512, prefill_pairs(512, n - 512), 0, 0, 0, 0) / 1e9
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(doc))
    report = fit_report(calibrate([path], name="fitted", knee=0))
    note = [line for line in report if "whole prompt prefilled" in line]
    assert len(note) == 1 and "--no-enable-prefix-caching" in note[0], report
    steps = tmp_path / "steps.csv"  # step timings say their own prefill pairs: no such note
    steps.write_text("num_tokens,prefill_pairs,num_decode_seqs,decode_context_tokens,step_ns\n" + "".join(
        f"{n},{prefill_pairs(s, n)},0,0,{KNOWN.step_ns(n, prefill_pairs(s, n), 0, 0, 0, 0)}\n"
        for n, s in ((128, 0), (512, 512), (2048, 0), (8192, 4096)))
        + "".join(f"{b},0,{b},{c},{KNOWN.step_ns(b, 0, c, b, 0, 0)}\n" for b, c in ((1, 600), (8, 9000), (64, 70000))))
    assert not any("prefilled" in line for line in fit_report(calibrate([steps], name="fitted", knee=0)))
    readme = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text().split())
    assert "`vllm serve --no-enable-prefix-caching`" in readme


def test_experts_per_token_without_experts_is_refused_at_its_key(tmp_path):
    """A [cost_model] with experts_per_token and no num_experts was taken, and the value never
    used (the MoE term needs E), as token_above_knee_ns without token_knee is refused."""
    path = tmp_path / "cm.toml"
    five = "step_overhead_ns = 1\ntoken_ns = 1\nattn_pair_ps = 1\nkv_read_ps = 1\ndecode_seq_ns = 1\n"
    path.write_text(f'[cost_model]\nname = "x"\n{five}experts_per_token = 8\n')
    with pytest.raises(ConfigError, match=r"cm\.toml: cost_model\.experts_per_token: 8 has no effect without num_"):
        load_config_file(path)
    path.write_text(f'[cost_model]\nname = "x"\n{five}experts_per_token = 8\nnum_experts = 64\n')
    assert load_config_file(path).cost_model.experts_per_token == 8  # with E it is the routing


def test_calibrate_to_stdout_writes_the_model_alone_there(tmp_path):
    """`calibrate -o /dev/stdout > fit.toml` wrote the report into the TOML beside the model
    (exit 0; --config fit.toml then said "invalid TOML"), and advised --config /dev/stdout."""
    import subprocess
    import sys
    from pathlib import Path

    from kvtrace.replay.run import RunSpec, engine_preset

    data = Path(__file__).resolve().parents[1] / "data" / "calibration" / "aic-h200-llama-3.1-8b-tp1.csv"
    saved = tmp_path / "fit.toml"
    with open(saved, "wb") as stdout:
        proc = subprocess.run([sys.executable, "-m", "kvtrace.cli", "calibrate", "--from", str(data), "-o",
                               "/dev/stdout"], stdout=stdout, stderr=subprocess.PIPE, text=True, check=False,
                              timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert saved.read_text().startswith("[cost_model]\n") and "median error" in proc.stderr
    assert "--config /dev/stdout" not in proc.stderr and "wrote the cost model to stdout" in proc.stderr
    assert engine_preset(RunSpec("gen:chat", config_file=str(saved))).cost_model.name == "calibrated"


@pytest.mark.parametrize(("text", "key", "told"), [
    ("[cache]\ncapacity_blocks = 100\n", "cache.capacity_blocks", "(--capacity-blocks is [cache] num_gpu_blocks here)"),
    ("capacity_blocks = 100\n", "capacity_blocks", "(--capacity-blocks is [cache] num_gpu_blocks here)"),
    ("[cache]\nblock_size = 16\n", "cache.block_size", "(--block-size is each [cache] groups entry's block_size here)"),
    ("[cache]\nretention = 0\n", "cache.retention", "(--retention is [cache] retention_interval here)"),
])
def test_a_flags_name_written_as_a_key_is_told_its_key(tmp_path, text, key, told):
    """A flag's name written as a key was told the known key nearest in spelling:
    capacity_blocks "did you mean external_capacity_blocks?", block_size "hash_block_size?"."""
    from kvtrace.errors import ConfigError
    from kvtrace.replay.run import RunSpec, engine_preset

    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        engine_preset(RunSpec("gen:chat", config_file=str(path)))
    assert str(err.value).startswith(f"{path}: {key}: unknown key {told}; expected one of ")
    assert "did you mean" not in str(err.value)
