"""A ~/.streamlit/credentials.toml Streamlit cannot load (re-probe reenv31 of 88c0633, which
checked config.toml and secrets.toml): the server deleted the user's file, printed its
'Welcome to Streamlit! ... Email:' prompt to a stdin it does not have, and exited 255, the
error line a bare timestamp. Told first, in one line naming the file; the file kept."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.support import assert_one_line, run

DATA = Path(__file__).resolve().parents[1] / "data"
TRACE = str(DATA / "mooncake_synthetic_trace.jsonl")


@pytest.mark.parametrize(("text", "needle"), [
    ("not [toml\n", "not TOML"),
    ("[general]\n", 'expected email = "..." in [general]'),
    ("[general]\nemail = 3\n", 'expected email = "..."'),
    ('[general]\nemail = "a@b@c"\n', "no email address"),
])
def test_credentials_streamlit_cannot_load_are_told_first(tmp_path, capsys, monkeypatch, text, needle):
    db = str(tmp_path / "s.duckdb")
    code, _, err = run(["replay", TRACE, "--mode", "cache-only", "--limit", "2", "--db", db], capsys)
    assert code == 0, err
    home = tmp_path / "home"
    (home / ".streamlit").mkdir(parents=True)
    credentials = home / ".streamlit" / "credentials.toml"
    credentials.write_text(text)
    monkeypatch.setenv("HOME", str(home))
    code, out, err = run(["dashboard", "--db", db, "--port", "0"], capsys)
    assert_one_line(code, err, str(credentials), needle, "fix or move the file")
    assert not out and credentials.read_text() == text


@pytest.mark.parametrize("text", ['[general]\nemail = ""\n', '[general]\nemail = " me@example.org "\n'])
def test_credentials_streamlit_takes_pass(text):
    from kvtrace.dashboard import _credentials_problem

    assert _credentials_problem(text.encode()) is None
