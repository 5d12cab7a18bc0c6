"""What the docs probe (session 26) found: help and README that left out where an option or a
default applies (--config and a curve's --capacities are refused outside engine or cache-only
mode without a word of it), a conformance paragraph that said every step's chunk is compared, a
sweep row silent on its --json, and a benchmark figure that did not say it was the best run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import typer.main

from kvtrace.cli.commands import app
from tests.cli.support import assert_one_line, run

README = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")


def _flat(text: str) -> str:
    return " ".join(text.split())


def _option_help(command: str, flag: str) -> str:
    cmd = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    (param,) = [p for p in cmd.params if flag in getattr(p, "opts", ())]
    return _flat(param.help or "")


def _run_settings() -> str:
    section = README[README.index("## CLI reference"):]
    return _flat(section[:section.index("| command |")])


@pytest.mark.parametrize("command", ["replay", "sweep", "curve", "study"])
def test_config_is_said_to_be_engine_modes_as_a_cache_only_replay_refuses_it(tmp_path, capsys, command):
    """--config's help ("TOML settings overriding the preset") and the README's run settings ("any
    cache, scheduler or cost-model field") did not say engine mode, where --preset, --retention and
    --external-blocks each do; a cache-only replay refuses it."""
    config = tmp_path / "run.toml"
    config.write_text("[scheduler]\nmax_num_seqs = 4\n", encoding="utf-8")
    code, _, err = run(["replay", "gen:chat", "--mode", "cache-only", "--limit", "2", "--config", str(config)], capsys)
    assert_one_line(code, err, "--config", "engine mode only")
    assert "preset (engine mode)" in _option_help(command, "--config")
    said = _run_settings()
    assert "`--config FILE.toml` (engine mode:" in said


def test_the_curve_row_says_engine_mode_needs_block_counts(capsys):
    """The README's curve paragraph said an engine curve is one replay per capacity and nothing of
    `auto`, --capacities' default, being refused there (as `inf` is): `kvtrace curve T --mode engine`
    as written fails."""
    code, _, err = run(["curve", "gen:chat", "--mode", "engine", "--limit", "2", "--no-content"], capsys)
    assert_one_line(code, err, "--capacities", "auto", "engine mode needs explicit block counts")
    curves = _flat(README[README.index("`kvtrace curve TRACE [--capacities"):README.index("## Spans and attributes")])
    assert "`auto` and `inf`, the default and the unbounded cache, are cache-only's" in curves


def test_conformance_compares_chunks_only_where_a_mamba_group_splits_them(capsys):
    """The README said conformance compares "the chunk" per request and step; it compares vLLM's
    Mamba block-aligned split with kvtrace's, so a full-attention configuration compares none."""
    pytest.importorskip("vllm.v1.core.kv_cache_manager")
    code, out, err = run(["conformance", "gen:mixed", "--preset", "dense-attention", "--limit", "3", "--json"], capsys)
    assert code == 0, err
    (result,) = json.loads(out)["runs"]
    assert result["fields"]["chunk"]["compared"] == 0 and result["fields"]["hit_tokens"]["compared"] > 0
    section = _flat(README[README.index("## Conformance with vLLM"):README.index("## Dashboard")])
    assert "compares the chunk (vLLM's Mamba block-aligned split against kvtrace's, where a Mamba group" in section
    assert "`chunk` in `--json` compares none without" in section


def test_the_sweep_row_says_what_its_json_holds(capsys):
    """The sweep row said "a table of deltas against the baseline" and nothing of --json, which
    prints each combination's summary and no deltas: --baseline is checked there, then unused."""
    argv = ["sweep", "gen:chat", "--mode", "cache-only", "--limit", "4", "--param", "capacity_blocks=20,40",
            "--workers", "1", "--json"]
    code, _, err = run([*argv, "--baseline", "capacity_blocks=30"], capsys)
    assert_one_line(code, err, "--baseline", "capacity_blocks=30")
    code, out, err = run([*argv, "--baseline", "capacity_blocks=40"], capsys)
    assert code == 0, err
    printed = json.loads(out)
    assert set(printed) == {"sweep_id", "runs"}
    assert [r["params"] for r in printed["runs"]] == [{"capacity_blocks": 20}, {"capacity_blocks": 40}]
    assert all(r["run_id"] is None and not any("delta" in k for k in r) for r in printed["runs"])
    row = _flat(next(line for line in README.splitlines() if line.startswith("| `kvtrace sweep ")))
    assert "with `--json` one object, `{\"sweep_id\", \"runs\"}`: each combination's summary with its `params` and " \
           "`run_id`, and no deltas (`--baseline` is checked, and shapes the table alone)" in row


def test_the_demo_benchmark_row_says_its_figure_is_the_best_run():
    """The demo row gave "**7.0 s** (8.7, 7.0, 8.4)": 7.0 is neither the median (8.4) nor the mean,
    but the best of the three, which is what bench/demo.py prints and holds to its budget."""
    path = Path(__file__).resolve().parents[1] / "bench" / "demo.py"
    source = path.read_text(encoding="utf-8")
    assert "best = min(times)" in source and "(best of {len(times)}" in source
    row = next(line for line in README.splitlines() if line.startswith("| `kvtrace demo` (#6)"))
    shown = re.search(r"\*\*(\d+\.\d) s\*\*, the best of three \(([\d., ]+)\)", row)
    assert shown is not None, row
    assert float(shown.group(1)) == min(float(t) for t in shown.group(2).split(", "))


def test_a_cache_only_step_span_is_the_millisecond_the_spans_table_says(tmp_path, capsys):
    """The spans table gave a cache-only step's window as `[step × step_ns, (step+1) × step_ns]`,
    the cost model's name for a step's modelled time, where no clock runs: each step (one a
    request) is 1 ms of virtual time."""
    import duckdb

    db = tmp_path / "c.duckdb"
    code, _, err = run(["replay", "gen:chat", "--mode", "cache-only", "--limit", "5", "--db", str(db)], capsys)
    assert code == 0, err
    with duckdb.connect(str(db), read_only=True) as con:
        rows = con.execute("select step, start_ns, end_ns from step_spans order by step").fetchall()
    assert [r[0] for r in rows] == list(range(5))
    assert all((start, end) == (step * 1_000_000, (step + 1) * 1_000_000) for step, start, end in rows)
    row = next(line for line in README.splitlines() if line.startswith("| `kvtrace.engine.step` |"))
    assert "cache-only mode (one step a request, 1 ms each" in row and "`[step × 1 ms, (step + 1) × 1 ms]`" in row
