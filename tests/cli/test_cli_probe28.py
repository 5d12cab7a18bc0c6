"""Found by session 28's generated probe of the whole command line (every command, every
option, boundary values, paths and output plumbing): each a regression test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.support import assert_one_line, run
from tests.support.permissions import read_only

KVTRACE = [sys.executable, "-m", "kvtrace.cli"]


@pytest.mark.parametrize("argv", [[], ["capture"]])
def test_the_help_a_bare_command_prints_to_a_closed_stdout_exits_141_silently(argv):
    """`kvtrace | head -0`, `kvtrace capture` into a closed pipe: the help printed for a command
    given nothing ended in a traceback and exit 1 (`--help` itself exits 141, silently)."""
    proc = subprocess.Popen([*KVTRACE, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and err == b"", err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("argv", [[], ["capture"]])
def test_the_help_a_bare_command_prints_to_a_full_stdout_is_one_line(argv):
    with open("/dev/full", "wb") as full:
        proc = subprocess.run([*KVTRACE, *argv], stdout=full, stderr=subprocess.PIPE, timeout=120, check=False)
    err = proc.stderr.decode()
    assert proc.returncode == 2, err
    assert err.splitlines() == ["kvtrace: error: cannot write to stdout: No space left on device"], err


CALIBRATION = str(Path(__file__).resolve().parents[1] / "data" / "calibration" / "aic-h200-llama-3.1-8b-tp1.csv")


@pytest.mark.parametrize("existing,said", [
    ("not = [toml\n", "exists and is no cost-model TOML"),
    ('preset = "kimi-hybrid"\n', "a --config file with settings besides [cost_model]"),
])
def test_calibrate_names_an_output_with_a_newline_as_typed(tmp_path: Path, capsys, existing, said):
    """calibrate's refusal of an -o it would replace joined the name's newline into a space,
    naming another file ("a b.toml") than the one typed."""
    out = tmp_path / "a\nb.toml"
    out.write_text(existing)
    code, stdout, err = run(["calibrate", "--from", CALIBRATION, "-o", str(out)], capsys)
    assert_one_line(code, err, "a\\nb.toml", said)
    assert out.read_text() == existing and stdout == ""


def test_the_demo_names_a_read_only_store_with_a_newline_as_typed(tmp_path: Path, capsys, monkeypatch):
    db = tmp_path / "d\nx.duckdb"
    db.write_bytes(b"")
    with read_only(monkeypatch, db):
        code, _, err = run(["demo", "--db", str(db)], capsys)
    assert_one_line(code, err, "d\\nx.duckdb", "read-only")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d\nx.duckdb"]


def test_a_moe_value_with_a_newline_is_shown_as_typed(capsys):
    code, _, err = run(["calibrate", "--from", CALIBRATION, "--moe", "8\n:2x"], capsys)
    assert_one_line(code, err, "--moe: 8\\n:2x: expected E:K")


@pytest.mark.parametrize("option", ["--endpoint", "--replay-endpoint"])
@pytest.mark.parametrize("given", ["", " "])
def test_an_empty_capture_endpoint_is_refused_before_anything_is_recorded(tmp_path: Path, capsys, option, given):
    """`--replay-endpoint ''` captured without gap recovery and said nothing of it (a blank one
    was refused), and `--endpoint ''` was told as "--endpoint: : expected ..."."""
    db = tmp_path / "live.duckdb"
    argv = {"--endpoint": "tcp://127.0.0.1:1", "--replay-endpoint": None, option: given}
    code, _, err = run(["capture", "vllm", *(a for k, v in argv.items() if v is not None for a in (k, v)),
                        "--db", str(db), "--duration", "0"], capsys)
    assert_one_line(code, err, f"{option}: {given!r}: expected tcp://HOST:PORT or ipc://PATH, got an empty one")
    assert not db.exists()


@pytest.mark.parametrize("command", [
    ["replay", "gen:chat", "--mode", "cache-only", "--limit", "2"],
    ["sweep", "gen:chat", "--mode", "cache-only", "--limit", "2", "--param", "capacity_blocks=4"],
    ["study", "shared-prefix-pinning", "--limit", "2"],
])
@pytest.mark.parametrize("name", ["", " "])
def test_a_blank_run_name_is_refused(tmp_path: Path, capsys, command, name):
    """`--name ''` ran under the default name as if none was given, and `--name ' '` stored a
    name the runs table shows as nothing."""
    db = tmp_path / "s.duckdb"
    code, stdout, err = run([*command, "--name", name, "--db", str(db)], capsys)
    assert_one_line(code, err, f"--name: {name!r}: expected a run name")
    assert stdout == "" and not db.exists()


def test_a_table_too_wide_for_the_terminal_folds_its_cells_never_cuts_them(monkeypatch, capsys):
    """On an 80-column terminal `kvtrace runs` showed a hit rate of 59.51% as "59…", a TTFT of
    42.357 as "42…" and cut run ids the same way (rich's default overflow, an ellipsis)."""
    import io

    from rich.console import Console

    from kvtrace.cli import output

    screen = io.StringIO()
    monkeypatch.setattr(output, "stdout_console", lambda: Console(file=screen, width=40, force_terminal=False))
    cells = ["r13", "fx_moon.jsonl engine kimi-hybrid no-content", "59.51%", "42.357", "1,234,567"]
    output.print_rows([["run", "name", "prefix_cache_hit_rate", "median_ttft_ms", "prompt_tokens"], cells], left=2)
    text = screen.getvalue()
    assert "…" not in text
    body = text.split("┡", 1)[1].splitlines()[1:-1]  # the rows under the header, without the bottom border
    columns = [[part.strip() for part in line.split("│")[1:-1]] for line in body]
    for i, cell in enumerate(cells):
        assert "".join(line[i] for line in columns).replace(" ", "") == cell.replace(" ", ""), text


@pytest.mark.parametrize("argv,flag", [
    (["replay", "gen:chat", "--mode", "cache-only", "--limit", "{v}"], "--limit"),
    (["replay", "gen:chat", "--mode", "cache-only", "--limit", "2", "--seed", "{v}"], "--seed"),
    (["generate", "chat", "-o", "{out}", "--requests", "{v}"], "--requests"),
    (["capture", "vllm", "--endpoint", "tcp://127.0.0.1:1", "--db", "{db}", "--duration", "{v}"], "--duration"),
    (["conformance", "gen:chat", "--concurrency", "{v}"], "--concurrency"),
])
@pytest.mark.parametrize("given", ["３", "١٢", "1_0"])
def test_a_number_is_taken_in_ascii_digits_alone(tmp_path: Path, capsys, argv, flag, given):
    """click converts with int() and float(): `--limit ３` (a fullwidth 3) replayed 3 requests,
    `--seed ١٢` seeded 12 and `--requests 1_0` wrote 10, where a trace's numbers, an endpoint's
    port and --moe take ASCII digits alone."""
    out, db = tmp_path / "o.jsonl", tmp_path / "s.duckdb"
    code, stdout, err = run([a.format(v=given, out=out, db=db) for a in argv], capsys)
    assert_one_line(code, err, f"{flag}: {given!r}: expected a number in ASCII digits")
    assert stdout == "" and not out.exists() and not db.exists()


def test_ascii_numbers_in_every_form_click_reads_still_run(tmp_path: Path, capsys):
    out = tmp_path / "o.jsonl"
    code, _, err = run(["generate", "chat", "-o", str(out), "--requests", "+2", "--seed", " 7"], capsys)
    assert code == 0, err
    assert "wrote 2 requests" in err


@pytest.mark.parametrize("argv,flag", [
    (["replay", "gen:chat", "--mode", "cache-only", "--limit", "2", "--db", " "], "--db"),
    (["sweep", "gen:chat", "--mode", "cache-only", "--limit", "2", "--param", "capacity_blocks=4", "--db", " "],
     "--db"),
    (["collect", "--db", " "], "--db"),
    (["demo", "--db", " "], "--db"),
    (["generate", "chat", "--requests", "2", "-o", " "], "--out"),
    (["convert", "gen:chat", "-o", " "], "--out"),
    (["calibrate", "--from", CALIBRATION, "-o", " "], "--out"),
    (["capture", "vllm", "--endpoint", "tcp://127.0.0.1:1", "--db", "{db}", "--duration", "0", "--trace-out", " "],
     "--trace-out"),
])
def test_a_store_or_output_named_by_spaces_alone_is_refused(tmp_path: Path, capsys, monkeypatch, argv, flag):
    """`--db ' '` made a store named by a space ("kvtrace: run r1 recorded in  "), `-o ' '` a
    trace no line could show."""
    monkeypatch.chdir(tmp_path)
    code, stdout, err = run([a.format(db=tmp_path / "s.duckdb") for a in argv], capsys)
    assert_one_line(code, err, f"{flag}: ' ': expected a path, got a blank one")
    assert stdout == "" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv,flag,both", [
    (["collect", "--db", "{db}", "--grpc", "--port", "0", "--no-grpc"], "--grpc", "--grpc and --no-grpc"),
    (["diff", "r1", "r2", "--db", "{db}", "--no-force", "--force"], "--force", "--force and --no-force"),
])
def test_an_on_off_flag_given_both_ways_is_refused(tmp_path: Path, capsys, argv, flag, both):
    """click kept the last: `collect --grpc --no-grpc` served no gRPC without a word, as an
    option of one value given twice did before it was refused."""
    db = tmp_path / "s.duckdb"
    code, stdout, err = run([a.format(db=db) for a in argv], capsys)
    assert_one_line(code, err, f"{flag}: given as both {both}; give one")
    assert stdout == "" and not db.exists()


def test_a_flag_given_twice_one_way_or_spelled_as_a_value_still_runs(capsys):
    code, stdout, err = run(["replay", "gen:chat", "--mode", "cache-only", "--limit", "2", "--json", "--json",
                             "--name", "--no-content"], capsys)
    assert code == 0, err
    assert '"requests": 2' in stdout


@pytest.mark.parametrize("flags,flag", [(["--run", " "], "--run"), (["--run", "r1", "--compare", "  "], "--compare")])
def test_the_dashboard_quotes_a_blank_run_it_lacks(tmp_path: Path, capsys, monkeypatch, flags, flag):
    """`dashboard --run ' '` was told as "--run:  : no such run": the value read as none at all."""
    import kvtrace.dashboard

    db = tmp_path / "s.duckdb"
    code, _, err = run(["replay", "gen:chat", "--mode", "cache-only", "--limit", "2", "--db", str(db)], capsys)
    assert code == 0, err
    monkeypatch.setattr(kvtrace.dashboard, "launch", lambda *a, **k: pytest.fail("served"))
    code, _, err = run(["dashboard", "--db", str(db), *flags], capsys)
    assert_one_line(code, err, f"{flag}: {flags[-1]!r}: no such run in")
