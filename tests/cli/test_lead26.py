"""Fixes the lead made from the twenty-sixth session's probes (each named in its test)."""

from __future__ import annotations

from tests.cli.support import run

CALIBRATION = "tests/data/calibration/aic-h200-llama-3.1-8b-tp1.csv"


def test_calibrate_to_dev_null_does_not_advise_config_dev_null(capsys):
    """`kvtrace calibrate -o /dev/null` said "use it with: kvtrace replay TRACE --config
    /dev/null", which reads nothing back (docs probe)."""
    code, _, err = run(["calibrate", "--from", CALIBRATION, "-o", "/dev/null"], capsys)
    assert code == 0, err
    assert "--config /dev/null" not in err
    assert "wrote the cost model to /dev/null (not a file" in err


def test_calibrate_to_a_file_says_how_to_use_it(tmp_path, capsys):
    out = tmp_path / "model.toml"
    code, _, err = run(["calibrate", "--from", CALIBRATION, "-o", str(out)], capsys)
    assert code == 0, err
    assert f"use it with: kvtrace replay TRACE --config {out}" in err and out.is_file()


def test_curve_help_says_auto_is_cache_only(capsys):
    """`curve --mode engine` refuses the default `--capacities auto`, where its help said
    nothing of it (docs probe)."""
    code, out, _ = run(["curve", "--help"], capsys)
    assert code == 0
    flat = " ".join(out.replace("│", " ").split())
    assert "auto, cache-only mode" in flat and "Engine mode: explicit block counts (no auto, no inf)" in flat


def _steps_csv(path, attn_pair_ps: int) -> None:
    """Steps whose times are their attention pairs and KV reads alone (no overhead, no per-token cost)."""
    rows = ["num_tokens,prefill_pairs,num_decode_seqs,decode_context_tokens,step_ms,label"]
    for t in (128, 300, 512, 700, 1024, 2048, 4096):
        pairs = t * (t + 1) // 2
        rows.append(f"{t},{pairs},0,0,{pairs * attn_pair_ps * 1e-9:.9f},prefill {t}")
    for seqs, context in ((1, 1000), (4, 8000), (8, 5000), (16, 40000), (32, 100000), (64, 300000)):
        rows.append(f"{seqs},0,{seqs},{context},{context * 3e-5:.9f},decode {seqs}")
    path.write_text("\n".join(rows) + "\n")


def test_calibrate_does_not_write_a_model_replay_would_refuse(tmp_path, capsys):
    """A fit of no step overhead and no per-token cost, its pairs under a ns each, priced a short
    prefill at 0 ns (a TTFT of 0 ms); --config refuses such a model, so -o does not write it
    (engine probe)."""
    csv, out = tmp_path / "steps.csv", tmp_path / "model.toml"
    _steps_csv(csv, attn_pair_ps=500)
    code, _, err = run(["calibrate", "--from", str(csv), "-o", str(out)], capsys)
    assert code == 2 and not out.exists()
    assert err.strip().splitlines()[-1].startswith(f"kvtrace: error: -o {out}: not written: ")
    assert "a prefill of a few tokens would take 0 ns" in err
    _steps_csv(csv, attn_pair_ps=2_000)  # (each pair 2 ns: every step takes time)
    code, _, err = run(["calibrate", "--from", str(csv), "-o", str(out)], capsys)
    assert code == 0 and out.is_file(), err
