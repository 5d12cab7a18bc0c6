"""Hint lines that end with a command to paste: pasted into bash, the command names the
same file (a store or trace path with a space, a quote, a ``$``, a newline, a leading ``-``)
and the same run. The store's, the pairing's, the demo's and the cli's hints all quote
their values with ``kvtrace.names.shell_word``/``shell_path`` (the ground floor: one home).
Before, store/errors.py pasted the path as it is (``--db a b.duckdb``: two words), the
pairing and the demo ``shlex.quote``d it (a newline shown as ``\\n`` inside quotes: another
file; ``-x.jsonl`` as ``kvtrace replay``'s first word: a flag)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvtrace.compare import pairing
from kvtrace.compare.demo import DemoResult
from kvtrace.names import BEHAVIOURS, printable, shell_path, shell_word
from kvtrace.store import UnknownRunError, read

KVTRACE = str(Path(sys.executable).with_name("kvtrace"))
# names a user may give a file: each must come back from a pasted command as itself
ODD = ["a b.duckdb", "it's.duckdb", '"q".duckdb', "$HOME.duckdb", "-x.duckdb", "-", "a\nb.duckdb", "t\tab",
       "~x.duckdb", "a;echo hi", "*", "!x", "ü é", "back\\slash", "--db", "{a,b}", "\x1b[31mred"]


def pasted(command: str, cwd: Path) -> list[str]:
    """The words bash gives ``kvtrace`` for ``command`` pasted as shown (a function that
    prints them stands for kvtrace)."""
    script = 'kvtrace() { printf "%s\\0" "$@"; }\n' + command
    done = subprocess.run(["bash", "--norc", "--noprofile", "-c", script], cwd=cwd, capture_output=True,
                          check=False)
    assert done.returncode == 0, done.stderr
    return os.fsdecode(done.stdout).split("\0")[:-1]


def hint(text: str) -> str:
    """The command in an error line as shown (printable), between its backticks."""
    found = re.search(r"`(kvtrace .*)`", printable(text))
    assert found, text
    return found.group(1)


def same_file(cwd: Path, word: str, name: str) -> bool:
    return os.path.normpath(cwd / word) == os.path.normpath(cwd / name)


def value_of(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.mark.parametrize("name", ODD)
def test_shell_word_and_path_paste_back_as_the_same_word(name, tmp_path):
    assert pasted(f"kvtrace {shell_word(name)}", tmp_path) == [name]
    (word,) = pasted(f"kvtrace {shell_path(name)}", tmp_path)
    assert same_file(tmp_path, word, name) and not word.startswith("-")


def test_the_cli_keeps_one_shell_word_from_the_ground_floor():
    from kvtrace import names
    from kvtrace.cli import output

    assert output.shell_word is names.shell_word and output.shell_path is names.shell_path


@pytest.mark.parametrize("name", ODD)
def test_unknown_run_hint_names_the_store(name, tmp_path):
    shown = hint(str(UnknownRunError(name, "r9")))
    argv = pasted(shown, tmp_path)
    assert argv[:1] == ["runs"] and same_file(tmp_path, value_of(argv, "--db"), name)


@pytest.mark.parametrize("name", ["a b.duckdb", "it's $x.duckdb", "-x.duckdb"])
def test_unknown_run_hint_really_pasted_lists_the_runs(name, replayed_store, tmp_path, monkeypatch):
    shutil.copy(replayed_store.path, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnknownRunError) as caught:
        read.run(name, "r-none")
    command = hint(str(caught.value)).replace("kvtrace ", f"{shell_word(KVTRACE)} ", 1) + " --json"
    done = subprocess.run(["bash", "--norc", "-c", command], cwd=tmp_path, capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert replayed_store.run_on in done.stdout


def _run_record(source: str, **extra) -> dict:
    return {"run_id": "r1", "mode": "engine", "trace_source": source, "trace_digest": "d",
            "config": '{"preset": "kimi-hybrid"}', **extra}


@pytest.mark.parametrize("name", ODD)
def test_study_command_names_the_trace_and_the_store(name, tmp_path):
    command = printable(pairing.study_command(_run_record(name), name))  # (as a view shows it)
    argv = pasted(command, tmp_path)
    assert argv[0] == "study"
    assert same_file(tmp_path, value_of(argv, "--trace"), name) and same_file(tmp_path, value_of(argv, "--db"), name)


@pytest.mark.parametrize("name", ODD)
def test_cache_only_command_names_the_trace_first(name, tmp_path):
    record = _run_record(name, mode="cache-only/lru", config='{"capacity_blocks": 8, "policy": "lru"}')
    argv = pasted(printable(pairing.study_command(record, name)), tmp_path)
    assert argv[0] == "replay" and not argv[1].startswith("-") and same_file(tmp_path, argv[1], name)
    assert same_file(tmp_path, value_of(argv, "--db"), name)


@pytest.mark.parametrize("name", ODD)
def test_demo_dashboard_command_names_the_store(name, tmp_path):
    argv = pasted(printable(DemoResult(name).dashboard_command), tmp_path)
    assert argv[0] == "dashboard" and same_file(tmp_path, value_of(argv, "--db"), name)


@pytest.mark.parametrize("name", ["a b.duckdb", "-x.duckdb", "it's $x"])
def test_dashboard_run_hints_paste(name, replayed_store, tmp_path):
    """``kvtrace dashboard --run``'s refusal names ``kvtrace runs --db`` of the same store."""
    shutil.copy(replayed_store.path, tmp_path / name)
    db = f"./{name}"
    done = subprocess.run([KVTRACE, "dashboard", "--db", db, "--run", "r-none"], cwd=tmp_path,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    argv = pasted(hint(done.stderr), tmp_path)
    assert argv[0] == "runs" and same_file(tmp_path, value_of(argv, "--db"), name)


@pytest.mark.parametrize("groups", ["5", '"abc"', '{"a": 1}', "[5, null]", "true"])
def test_study_command_of_a_damaged_record_s_groups(groups, tmp_path):
    """A damaged record's ``cache.groups`` that is no list: the command all the same (an int's
    TypeError before, on the dashboard's Compare page)."""
    record = _run_record("t.jsonl", config='{"preset": "kimi-hybrid", "cache": {"groups": ' + groups + '}}')
    argv = pasted(pairing.study_command(record, "s.duckdb"), tmp_path)
    assert argv[0] == "study" and value_of(argv, "--db") == "s.duckdb"


@pytest.mark.parametrize("value", ['"1; touch pwned"', '"$(touch pwned)"', "2.5", "true", "-3", '"8 --db other"'])
def test_cache_only_command_takes_only_whole_sizes_from_the_record(value, tmp_path):
    """A collected run's config is its sender's, a damaged record's anything: its capacity and
    block size were pasted into the command as they were (a second command run)."""
    config = '{"mode": "cache-only", "policy": "lru", "capacity_blocks": ' + value + ', "block_size": ' + value + "}"
    record = _run_record("t.jsonl", mode="cache-only/lru", config=config)
    argv = pasted(pairing.study_command(record, "s.duckdb"), tmp_path)
    assert not (tmp_path / "pwned").exists()
    assert argv[:2] == ["replay", "t.jsonl"] and value_of(argv, "--db") == "s.duckdb" and argv.count("--db") == 1
    assert value_of(argv, "--capacity-blocks") == "N" and "--block-size" not in argv


@pytest.mark.parametrize("behaviours", ['["$(touch pwned)"]', '{"; touch pwned": true}', '["a b"]'])
def test_study_command_names_only_kvtrace_s_behaviours(behaviours, tmp_path):
    record = _run_record("t.jsonl", behaviours=behaviours)
    argv = pasted(pairing.study_command(record, "s.duckdb"), tmp_path)
    assert not (tmp_path / "pwned").exists()
    assert argv[0] == "study" and argv[1] in BEHAVIOURS and value_of(argv, "--db") == "s.duckdb"
