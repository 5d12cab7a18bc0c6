"""A command a line offers for copying takes a name with a character no line shows as itself
(re-probe reenv31 of 3bfb7f9): shell_word quoted it and then wrote its escapes inside the
quotes, ``'a\\nb.duckdb'``, which a shell pastes as a backslash and an n (another file; a
store path with a '\\' is refused), and a byte that is not UTF-8 as the text '\\udcff'. Now
ANSI-C quoted, ``$'a\\nb.duckdb'``, read back by the shell as the very name."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from kvtrace.cli.output import shell_word
from tests.cli.support import assert_one_line, run

NAMES = ["a\nb.duckdb", "x\udcffy.duckdb", "e\x1b[31m.duckdb", "t\tq'\\.duckdb", "\u2028.duckdb"]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("name", [*NAMES, "it's", "sp ace", "a!b", "-x", "é"])
def test_the_shell_reads_the_word_back_as_the_name(name):
    word = shell_word(name)
    assert word.isprintable() and "\n" not in word
    done = subprocess.run(["bash", "-c", f"printf %s {word}"], capture_output=True, check=False)
    assert done.stdout == os.fsencode(name), word


def test_a_missing_stores_hint_pastes_its_name(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(["runs", "--db", "a\nb.duckdb"], capsys)
    assert_one_line(code, err, "kvtrace replay TRACE --db $'a\\nb.duckdb'")
