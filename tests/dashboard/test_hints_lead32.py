"""The commands the dashboard shows for pasting (found by the left32 probe): ``kvtrace
dashboard`` on a missing store, the Compare page's ``kvtrace diff`` line, the run-not-found
page's ``kvtrace runs``. Each quoted by ``names.shell_path``/``shell_word``; ``shlex.quote``
of a printable()'d path pasted a newline as a backslash and an n (another file)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from kvtrace.errors import KVTraceError
from tests.store.test_hints_left32 import pasted, same_file, value_of

ODD = ["new\nx.duckdb", "-x b.duckdb", "it's $x.duckdb"]


@pytest.mark.parametrize("name", ODD)
def test_the_launchers_hint_pastes_as_the_same_file(name, tmp_path, monkeypatch):
    from kvtrace.dashboard import launch

    monkeypatch.chdir(tmp_path)
    with pytest.raises(KVTraceError) as err:
        launch(name)
    found = re.search(r"`(kvtrace replay TRACE --db .*)`\)", str(err.value), re.S)
    assert found, str(err.value)
    word = value_of(pasted(found.group(1), tmp_path), "--db")
    assert same_file(tmp_path, word, name) and not word.startswith("-")


def test_the_compare_pages_diff_command_runs_as_shown(replayed_store, tmp_path):
    """The Compare page's line, ``kvtrace diff --db DB --markdown -- RUN_A RUN_B``, pasted
    into bash in the store's folder, with a store named like an option: it runs, and prints
    diff's Markdown of the two runs."""
    import shutil

    from kvtrace.names import shell_path, shell_word

    db = "-x b.duckdb"
    shutil.copy(replayed_store.path, tmp_path / db)
    run_a, run_b = replayed_store.run_off, replayed_store.run_on
    command = f"kvtrace diff --db {shell_path(db)} --markdown -- {shell_word(run_a)} {shell_word(run_b)}"
    argv = pasted(command, tmp_path)
    done = subprocess.run([sys.executable, "-m", "kvtrace.cli", *argv], cwd=tmp_path, capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr
    direct = subprocess.run([sys.executable, "-m", "kvtrace.cli", "diff", run_a, run_b, "--db",
                             str(tmp_path / db), "--markdown"], capture_output=True, text=True, check=True)
    assert done.stdout == direct.stdout and done.stdout.startswith("### kvtrace diff:")
