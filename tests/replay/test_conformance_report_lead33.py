"""``kvtrace conformance``'s text report shows a user's text as printable text (hints33's report)."""

from __future__ import annotations

from typer.testing import CliRunner

from kvtrace.cli import app


def test_a_trace_path_with_an_escape_sequence_is_shown_escaped(tmp_path, vllm_api):
    """A trace file named with an escape sequence (ESC[31m) recoloured the terminal: the report's
    first line printed the path as it was. Now its escapes are shown, as every other line shows a
    user's text; --json keeps the path whole."""
    trace = tmp_path / "e\x1b[31mR.jsonl"
    runner = CliRunner()
    made = runner.invoke(app, ["generate", "chat", "--requests", "3", "-o", str(trace)])
    assert made.exit_code == 0, made.output
    text = runner.invoke(app, ["conformance", str(trace), "--capacity-blocks", "200"])
    assert text.exit_code == 0, text.output
    assert "\x1b" not in text.stdout
    assert "e\\x1b[31mR.jsonl" in text.stdout.splitlines()[0]
    js = runner.invoke(app, ["conformance", str(trace), "--capacity-blocks", "200", "--json"])
    assert js.exit_code == 0 and '"trace": ' in js.stdout and "\\u001b[31mR.jsonl" in js.stdout
