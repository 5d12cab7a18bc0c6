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
