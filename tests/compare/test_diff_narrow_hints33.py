"""kvtrace diff's (and study's) summary table on an 80-column terminal (re-probe hints33 of
323537d, which fixed sweep's): the metric column folded prompt_tokens_by_source.external_kv_transfer
mid-word ("..._kv_tr" / "ansfer"), a name copied with the table's border in it. Where leaving out
Δ% keeps every name and number on one line, it is left out and named (on stderr for stdout's
table, as runs and sweep name theirs); a wider terminal, a pipe, --markdown and --json keep it."""

from __future__ import annotations

import io

from rich.console import Console

from kvtrace.compare import render
from kvtrace.compare.model import diff_summaries

LONG = "prompt_tokens_by_source.external_kv_transfer"


def diff():
    a = {"requests": 5, "prefix_cache_hit_rate": 0.1147, LONG: 0, "capacity_blocks": 10_239, "median_ttft_ms": 43.428}
    b = {"requests": 5, "prefix_cache_hit_rate": 0.0, LONG: 0, "capacity_blocks": 10_239, "median_ttft_ms": 38.815}
    return diff_summaries(a, b, run_a={"run_id": "r1"}, run_b={"run_id": "r2"})


def shown(width: int) -> str:
    console = Console(width=width, file=io.StringIO(), color_system=None)
    render.render(diff(), console)
    return console.file.getvalue()


def test_at_80_columns_every_metric_name_stays_whole_and_the_left_out_column_is_named():
    text = shown(80)
    assert any(LONG in line for line in text.splitlines())
    assert "Δ%" not in text.split("columns left out")[0] and render.REL_LEFT_OUT in " ".join(text.split())
    assert all(len(line) <= 80 for line in text.splitlines() if "│" in line)


def test_a_wide_console_keeps_the_relative_change():
    text = shown(120)
    assert "Δ%" in text and "left out" not in text and LONG in text


def test_stdouts_table_names_the_left_out_column_on_stderr(monkeypatch, capsys):
    buffer = io.StringIO()
    monkeypatch.setattr(render, "stdout_console", lambda: Console(width=80, file=buffer, color_system=None))
    render.render(diff())
    assert render.REL_LEFT_OUT in capsys.readouterr().err and "left out" not in buffer.getvalue()
    assert LONG in buffer.getvalue()


def test_a_console_on_stdout_names_it_on_stderr_too(capsys):
    import sys

    render.render(diff(), Console(width=80, file=sys.stdout, color_system=None))  # (study's console)
    captured = capsys.readouterr()
    assert render.REL_LEFT_OUT in captured.err and "left out" not in captured.out and LONG in captured.out
