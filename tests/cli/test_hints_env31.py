"""The commands a line offers for copying (probe env31) take a path as one shell word, as the
demo's closing command does: `kvtrace replay TRACE --config ./my cost's.toml`, pasted, was
three words and an open quote."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from tests.cli.support import assert_one_line, run

DATA = Path(__file__).resolve().parents[1] / "data"
TRACE = str(DATA / "mooncake_synthetic_trace.jsonl")
STEPS = str(DATA / "calibration" / "aic-h200-llama-3.1-8b-tp1.csv")
ODD = "my cost's [1]?.x"  # (a space, a quote, glob characters)


def _offered(line: str) -> list[str]:
    """The words of the last command a line offers (between backquotes, or after 'use it with:')."""
    found = re.findall(r"`(kvtrace [^`]*)`", line) or re.findall(r"use it with: (kvtrace .*)\)$", line)
    assert found, line
    return shlex.split(found[-1])


def test_calibrates_hint_quotes_the_output(tmp_path, capsys):
    out = str(tmp_path / f"{ODD}.toml")
    code, _, err = run(["calibrate", "--from", STEPS, "-o", out], capsys)
    assert code == 0, err
    words = _offered(err.strip().splitlines()[-1])
    assert words[-2:] == ["--config", out], words


def test_a_missing_stores_hint_quotes_it(tmp_path, capsys):
    db = str(tmp_path / f"{ODD}.duckdb")
    code, _, err = run(["runs", "--db", db], capsys)
    line = assert_one_line(code, err, "no such database")
    assert _offered(line)[-2:] == ["--db", db]


def test_the_dashboards_run_hint_quotes_the_store(tmp_path, capsys):
    db = str(tmp_path / f"{ODD}.duckdb")
    code, _, err = run(["replay", TRACE, "--mode", "cache-only", "--limit", "3", "--db", db], capsys)
    assert code == 0, err
    code, _, err = run(["dashboard", "--db", db, "--run", "r9", "--port", "0"], capsys)
    line = assert_one_line(code, err, "--run: r9: no such run")
    assert _offered(line) == ["kvtrace", "runs", "--db", db]
