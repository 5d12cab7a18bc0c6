"""The commands that find, sweep and chart runs, and the help a user reads first."""

from __future__ import annotations

import json
import re

import pytest

from tests.cli.test_cli import MOONCAKE, kvtrace

COMMANDS = ["replay", "sweep", "curve", "runs", "diff", "study", "demo", "export", "dashboard", "generate",
            "convert", "calibrate", "collect", "capture vllm"]


def test_version():
    out = kvtrace("--version")
    assert out.returncode == 0 and re.fullmatch(r"kvtrace \S+\n", out.stdout), out


@pytest.mark.parametrize("command", COMMANDS)
def test_help_names_values_in_words_not_python_types(command):
    out = kvtrace(*command.split(), "--help")
    assert out.returncode == 0, out.stderr
    for python_type in ("<bool>", "<list", "<str>", "<int>", "<path>", "<float>"):
        assert python_type not in out.stdout, (python_type, out.stdout)
    # every option says what it is for
    options = re.findall(r"^  (--[a-z-]+)([^\n]*)$", out.stdout, flags=re.M)
    assert options
    for name, rest in options:
        described = rest.strip() and not re.fullmatch(r"[A-Z0-9:.,|<>\[\]_=-]+( [A-Z0-9:.,|<>\[\]_=-]+)*", rest.strip())
        assert described or name == "--help" or _continued(out.stdout, name), (name, rest)


def _continued(text: str, option: str) -> bool:
    """The option's help sits on the next line (a long metavar pushed it there)."""
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith(f"  {option}"))
    return i + 1 < len(lines) and lines[i + 1].startswith(" " * 10) and lines[i + 1].strip() != ""


def test_replay_help_lists_the_choices():
    out = re.sub(r"-\n\s+", "-", kvtrace("replay", "--help").stdout)  # help wraps at hyphens
    assert "<engine|cache-only>" in out and "<lru|belady>" in out
    assert "kimi-hybrid" in out and "dense-attention" in out
    for behaviour in ("transient-checkpoint-retention", "shared-prefix-pinning", "external-hit-running-cow"):
        assert behaviour in out


def test_a_recorded_run_says_its_id_and_runs_lists_it(tmp_path):
    db = tmp_path / "runs.duckdb"
    out = kvtrace("replay", str(MOONCAKE), "--mode", "cache-only", "--capacity-blocks", "700", "--limit", "150",
                  "--db", str(db), "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["run_id"] == "r1" and f"run r1 recorded in {db}" in out.stderr
    listed = kvtrace("runs", "--db", str(db), "--json")
    assert listed.returncode == 0, listed.stderr
    (run,) = json.loads(listed.stdout)["runs"]
    assert run["run_id"] == "r1" and run["status"] == "complete" and run["mode"] == "cache-only/lru"
    assert (run["capacity_blocks"], run["block_size"]) == (700, 512)
    assert run["prefix_cache_hit_rate"] == summary["prefix_cache_hit_rate"] and run["requests"] == 150
    table = kvtrace("runs", "--db", str(db))
    assert "r1" in table.stdout and "700×512" in table.stdout and "complete" in table.stdout


def test_runs_of_a_missing_store_is_one_line(tmp_path):
    out = kvtrace("runs", "--db", str(tmp_path / "none.duckdb"))
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "no such database" in out.stderr


def test_sweep_json_holds_every_run_with_its_id_and_digest(tmp_path):
    db = tmp_path / "sweep.duckdb"
    out = kvtrace("sweep", str(MOONCAKE), "--mode", "cache-only", "--limit", "150", "--param",
                  "capacity_blocks=300,900", "--db", str(db), "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["sweep_id"].startswith("sweep-")
    assert [r["params"] for r in result["runs"]] == [{"capacity_blocks": 300}, {"capacity_blocks": 900}]
    assert all(r["run_id"] and len(r["digest"]) == 64 for r in result["runs"])
    assert result["runs"][0]["prefix_cache_hit_rate"] < result["runs"][1]["prefix_cache_hit_rate"]
    alone = json.loads(kvtrace("replay", str(MOONCAKE), "--mode", "cache-only", "--limit", "150",
                               "--capacity-blocks", "900", "--json").stdout)
    assert alone["digest"] == result["runs"][1]["digest"]


def test_curve_json_and_table(tmp_path):
    out = kvtrace("curve", str(MOONCAKE), "--limit", "200", "--capacities", "300,600,inf", "--json")
    assert out.returncode == 0, out.stderr
    points = json.loads(out.stdout)["points"]
    assert {(p["policy"], p["capacity_blocks"]) for p in points} == {
        (pol, c) for pol in ("lru", "belady") for c in (300, 600, None)}
    table = kvtrace("curve", str(MOONCAKE), "--limit", "200", "--capacities", "300,600", "--policy", "lru")
    assert table.returncode == 0, table.stderr
    assert "lru hit rate" in table.stdout and "belady" not in table.stdout and "Mattson" in table.stderr


def test_study_sweep_ends_with_one_compact_table():
    out = kvtrace("study", "shared-prefix-pinning", "--limit", "30", "--sweep", "capacity_blocks=96,160")
    assert out.returncode == 0, out.stderr
    tail = out.stdout[out.stdout.rindex("on - off, per capacity_blocks"):]
    assert "Δ prefix_cache_hit_rate" in tail and re.search(r"│ 96 .*pp", tail) and re.search(r"│ 160 .*pp", tail)


def test_dashboard_compare_needs_a_run(tmp_path, replayed_store):
    out = kvtrace("dashboard", "--db", replayed_store.path, "--compare", replayed_store.run_off)
    assert out.returncode == 2 and "--compare needs --run" in out.stderr and out.stderr.count("\n") == 1


def test_runs_reads_no_spans_back_for_a_run_that_holds_none(tmp_path, monkeypatch, capsys):
    """A run without a finished summary was rebuilt from its spans, 50 ms a run with none:
    `runs` of 3,000 failed runs took minutes. Its listing is what its record says."""
    from kvtrace.store import read
    from kvtrace.store.writer import Store
    from tests.cli.support import run

    db = str(tmp_path / "runs.duckdb")
    with Store.open(db) as store:
        for i in range(3):
            rid = store.create_run(f"failed {i}", trace_source="t.jsonl", mode="engine", config={})
            store.finish_run(rid, status="failed", summary={"error": "KeyboardInterrupt: "})
    asked = []
    real = read.summary_with_spans
    monkeypatch.setattr(read, "summary_with_spans", lambda *a, **k: asked.append(a[1]) or real(*a, **k))
    code, out, err = run(["runs", "--db", db, "--json"], capsys)
    listed = json.loads(out)["runs"]
    assert code == 0 and [r["status"] for r in listed] == ["failed"] * 3 and asked == [], (asked, err)
    assert all(r["requests"] is None for r in listed)
