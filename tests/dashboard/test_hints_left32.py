"""The dashboard's "no such database file" line ends with ``kvtrace replay TRACE --db PATH``
to paste: pasted into bash it names the same file (it ``shlex.quote``d the path: a leading
``-`` pasted as a flag-looking word, a newline shown as ``\\n`` inside quotes: another file)."""

from __future__ import annotations

import os
import re

import pytest

from tests.dashboard.apptest import render
from tests.store.test_hints_left32 import pasted, same_file, value_of


@pytest.mark.parametrize("name", ["-x b.duckdb", "a\nb.duckdb", "it's $x.duckdb"])
def test_missing_store_hint_pastes_as_the_same_file(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    at = render(name, monkeypatch)
    assert len(at.error) == 1
    found = re.search(r"(`+) ?(kvtrace replay .*?) ?\1", at.error[0].value)
    assert found, at.error[0].value
    argv = pasted(found.group(2), tmp_path)
    word = value_of(argv, "--db")
    assert argv[:2] == ["replay", "TRACE"] and same_file(tmp_path, word, name) and not word.startswith("-")
    assert not os.path.exists(tmp_path / name)
