"""A command shown for pasting names the very file or run in any locale (re-probe hints33 of
f29e79b): shell_word ANSI-C quoted a character no line shows as itself by its code point,
``\\xa0`` for U+00A0 (bash reads the byte a0, not the name's UTF-8 c2 a0: another file) and
``\\u202e`` for a bidi control (read under LC_ALL=C as the six characters ``\\u202E``). Now
as its UTF-8 bytes, ``\\xc2\\xa0``. And convert's hint for a ``gen:`` trace pasted the text
after ``gen:`` as it was (``kvtrace generate $(touch pwned) -o FILE``)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from kvtrace.names import shell_path, shell_word
from tests.cli.support import run

NAMES = ["a\u00a0b.duckdb", "a\u0085b", "\u202eevil", "z\u200bw", "\ufeffbom", "x\udcffy", "e\u2028f",
         "\U000e0041tag", "\x7fdel", "sp ace\u00a0'q'"]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("locale", ["C", "C.UTF-8"])
@pytest.mark.parametrize("name", NAMES)
def test_a_pasted_word_is_the_names_bytes_in_any_locale(name, locale):
    env = {**os.environ, "LC_ALL": locale}
    for word in (shell_word(name), shell_path(name)):
        assert word.isprintable()
        done = subprocess.run(["bash", "--norc", "-c", f"printf %s {word}"], capture_output=True, check=False,
                              env=env)
        assert done.stdout == os.fsencode(name), word


@pytest.mark.parametrize("text", ["$(touch pwned)", "a b", "`touch pwned`", "-x", "chat;touch pwned"])
def test_converts_hint_for_a_generated_workload_pastes_no_users_text(text, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(["convert", f"gen:{text}", "-o", "out.jsonl"], capsys)
    assert code == 2 and "`kvtrace generate NAME -o FILE`" in err and text not in err.split("write it with")[1]


def test_converts_hint_names_a_known_workload(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(["convert", "gen:chat", "-o", "out.jsonl"], capsys)
    assert code == 2 and "`kvtrace generate chat -o FILE`" in err


@pytest.mark.parametrize("name", ["=x.duckdb", "=", "==a", "a=b"])
def test_a_word_beginning_with_an_equals_sign_is_quoted_for_zsh(name):
    # (zsh's EQUALS option, on by default, reads a bare leading = as a command's path)
    for word in (shell_word(name), shell_path(name)):
        assert not word.startswith("="), word
        done = subprocess.run(["bash", "--norc", "-c", f"printf %s {word}"], capture_output=True, check=False)
        assert done.stdout == os.fsencode(name)


def test_the_pairing_hint_takes_a_records_limit_in_ascii_digits_alone():
    # (a collected record's digest is its sender's text: "\\d" took "٣" and "１６", which --limit
    # and --trace-block-size refuse, as the README says of numbers typed)
    from kvtrace.compare.pairing import study_command

    run = {"mode": "cache-only/lru", "trace_source": "t.jsonl", "config": {"capacity_blocks": 5, "policy": "lru"}}
    odd = study_command({**run, "trace_digest": "d:limit=٣:trace_block_size=１６"}, "s.duckdb")
    assert "--limit" not in odd and "--trace-block-size" not in odd and odd.isascii()
    plain = study_command({**run, "trace_digest": "d:limit=30:trace_block_size=16"}, "s.duckdb")
    assert "--limit 30 --trace-block-size 16" in plain
