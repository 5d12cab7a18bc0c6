"""The lead's fixes of the twenty-eighth session's CLI findings."""

from __future__ import annotations

import pytest

from tests.cli.support import run


@pytest.mark.parametrize(("name", "text", "said"), [
    ("a\nb.csv", None, "no such file"),
    ("c\nd.csv", "x,y\n1,2\n", "missing column(s)"),
    ("e\nf.csv", "num_tokens,prefill_pairs,num_decode_seqs,decode_context_tokens,step_ms\n1,1,0,0,abc\n",
     "step_ms: expected"),
    ("g\nh.json", "{}", "input_lens, output_lens, ttfts, itls: missing"),
])
def test_calibrate_names_a_file_with_a_newline_as_typed(tmp_path, capsys, name, text, said):
    """Each --from file with a newline in its name was named with a space there instead:
    another file's name (the cli probe of the twenty-eighth session)."""
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    code, _, err = run(["calibrate", "--from", str(path)], capsys)
    shown = str(path).replace("\n", "\\n")
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"kvtrace: error: {shown}") and said in err


@pytest.mark.parametrize("mode", ["cache-only", "engine"])
def test_a_runs_latency_keys_are_its_percentiles_whatever_the_mode(mode):
    """A cache-only replay at --percentiles 10 also held p99_ttft_ms and p99_itl_ms (null), keys
    an engine run at the same percentiles has not: one summary, one set of keys."""
    from kvtrace.metrics import LATENCY_KEYS, is_latency_key, latency_keys
    from kvtrace.replay.run import RunSpec, run_replay

    content = {"content": False} if mode == "engine" else {}
    summary = run_replay(RunSpec("gen:chat", mode=mode, limit=3, percentiles=(10.0,), **content)).summary
    assert {k for k in summary if is_latency_key(k)} == {k for m in LATENCY_KEYS for k in latency_keys(m, (10.0,))}


def test_the_replay_summary_keeps_a_digest_too_wide_for_the_terminal_whole():
    """On an 80-column terminal the summary table cut the digest with an ellipsis: the one
    value a user copies to compare two runs (the cli probe). Folded across rows, it was copied
    with the table's borders; where the table does not fit, it goes whole under it (fa17347)."""
    import io

    from rich.console import Console

    from kvtrace.replay.report import print_summary

    digest = "d2650e63a5ff3b15e6b62fdfdcde7176f580033741a1f70bbedd6e839882c2fe"
    screen = io.StringIO()
    print_summary({"requests": 5, "digest": digest}, console=Console(file=screen, width=40, force_terminal=False))
    text = screen.getvalue()
    assert "…" not in text
    assert f"\ndigest: {digest}\n" in text, text
    assert "│ digest" not in text


def test_a_piped_table_keeps_every_row_on_one_line_for_grep(capsys):
    """Piped, a table was laid out at 250 columns: a runs table wider than that folded its
    cells mid-word (`grep transient-checkpoint-retention` found none; before the fold, an
    ellipsis cut them). The README says piped output is for grep."""
    from kvtrace.cli.output import print_rows

    name = "transient-checkpoint-retention+shared-prefix-pinning+external-hit-running-cow"  # (no space to wrap at)
    names = [name] * 5
    print_rows([["run", *(f"behaviours{i}" for i in range(5))], ["r1", *names]])
    out = capsys.readouterr().out
    (row,) = [line for line in out.splitlines() if line.startswith("│ r1")]
    assert row.count(name) == 5 and "…" not in out


def test_diff_tables_fold_on_a_narrow_terminal_never_cut(replayed_store):
    """An 80-column `kvtrace diff` cut prompt_tokens_by_source.external_kv_t… and, at 60 columns,
    its values (29,0…, +287…): only `kvtrace runs`' table folded (the re-probe of the cli fixes)."""
    import io

    from rich.console import Console

    from kvtrace.compare.render import render
    from kvtrace.compare.source import diff_runs

    diff = diff_runs(replayed_store.path, replayed_store.run_off, replayed_store.run_on)
    screen = io.StringIO()
    render(diff, Console(file=screen, width=60, force_terminal=False))
    assert "…" not in screen.getvalue()


@pytest.mark.parametrize("typed", ["５０", "5_0", "٥٠"])
def test_percentiles_and_gate_thresholds_are_ascii_numbers(typed):
    """--percentiles ５０ stored p50 keys and --fail-if evictions:１０ read 10: float() takes any
    script's digits and underscores, where README says numbers are ASCII digits alone."""
    from kvtrace.compare.gates import parse_gate
    from kvtrace.errors import KVTraceError
    from kvtrace.metrics import parse_percentiles

    with pytest.raises(ValueError, match="ASCII digits"):
        parse_percentiles(f"90,{typed}")
    with pytest.raises(KVTraceError, match="is not a number"):
        parse_gate(f"evictions:{typed}")
    assert parse_percentiles("50, 99.9") == (50.0, 99.9) and parse_gate("evictions:+10%") is not None


@pytest.mark.parametrize("argv", [
    ["calibrate", "--from", "tests/data/calibration/aic-h200-llama-3.1-8b-tp1.csv", "-o", "{dir}/x.toml"],
    ["replay", "gen:chat", "--limit", "2", "--db", "{dir}/x.duckdb"],
    ["generate", "chat", "-o", "{dir}/x.jsonl"],
])
def test_a_path_with_a_newline_is_named_as_typed_in_every_error(tmp_path, capsys, argv):
    """A KVTraceError joined its lines with spaces: `-o $'no\\ndir/x.toml'` was told as
    'no dir/x.toml', another file's name, wherever a message quoted a path without
    printable() (the re-probe of the cli fixes found five commands doing it)."""
    missing = tmp_path / "no\ndir"
    code, _, err = run([a.replace("{dir}", str(missing)) for a in argv], capsys)
    assert code == 2 and err.count("\n") == 1 and "no\\ndir" in err and "no dir" not in err, err
