"""The README's CLI reference shows each option's choices and defaults as `kvtrace COMMAND --help` does.

tests/cli/test_reference.py holds that every option is named; this holds what the README says about
it: a `--flag a|b|c` lists exactly the option's choices, a `[--flag VALUE]` with a literal value is
its default, and a command's default that differs from the run settings' is said in its row.
"""

from __future__ import annotations

import re
from pathlib import Path

import typer.main

from kvtrace.cli import app

README = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
SECTION = README[README.index("## CLI reference"):README.index("\n## ", README.index("## CLI reference") + 1)]
RUN_SETTINGS = SECTION[:SECTION.index("| command |")]
# `--flag WORD`, where WORD runs to the next space, bracket or backtick (a `\|` inside a table cell included)
_FLAG_VALUE = re.compile(r"(?<![\w-])(--?[a-z][a-z-]*) ((?:[^\s\]`\\]|\\\|)+)")


def _commands(group, prefix: str):
    for name, cmd in sorted(group.commands.items()):
        if hasattr(cmd, "commands"):  # a group (typer's own click: not click's classes)
            yield from _commands(cmd, f"{prefix} {name}")
        else:
            yield f"{prefix} {name}", cmd


COMMANDS = dict(_commands(typer.main.get_command(app), "kvtrace"))


def _row(command: str) -> str:
    rows = [line for line in SECTION.splitlines() if line.startswith((f"| `{command} ", f"| `{command}`"))]
    assert len(rows) == 1, command
    return rows[0]


def _synopsis(command: str) -> str:
    """The row's first cell: the command line it documents."""
    return _row(command).split("` |", 1)[0]


def _option(cmd, flag: str):
    for p in cmd.params:
        if p.param_type_name == "option" and flag in (*p.opts, *p.secondary_opts):
            return p
    return None


def _default(opt) -> str | None:
    """The option's default as --help shows it (an enum's value)."""
    return None if opt.default is None else str(getattr(opt.default, "value", opt.default))


def _said(text: str) -> dict[str, str]:
    """flag -> the value the text shows after it (the first time it shows one)."""
    out: dict[str, str] = {}
    for flag, value in _FLAG_VALUE.findall(text):
        out.setdefault(flag, value.replace("\\|", "|"))
    return out


def test_every_choice_list_is_the_options_choices():
    """`--mode engine|cache-only`, `--backend kvtrace|vllm`, ...: the README lists what --help accepts."""
    checked = 0
    for command, cmd in COMMANDS.items():
        texts = [_synopsis(command)] + ([RUN_SETTINGS] if "[run settings]" in _row(command) else [])
        for text in texts:
            for flag, value in _said(text).items():
                opt = _option(cmd, flag)
                choices = getattr(opt.type, "choices", None) if opt is not None else None
                if choices is None or "|" not in value:
                    continue
                assert set(value.split("|")) == {str(c) for c in choices}, (command, flag, value)
                checked += 1
    assert checked >= 15  # mode, format, backend, policy of the commands taking run settings; demo, generate


def test_the_preset_list_is_the_presets():
    from kvtrace.names import PRESETS

    said = RUN_SETTINGS[RUN_SETTINGS.index("`--preset NAME` ("):]
    said = said[:said.index(")")]
    assert set(re.findall(r"`([a-z0-9-]+)`", said)) == set(PRESETS)


def test_every_literal_default_in_a_synopsis_is_the_default():
    """`[--port 8501]`, `[--db kvtrace-demo.duckdb]`: a value in lower case is the default, as --help says."""
    checked = 0
    for command, cmd in COMMANDS.items():
        for flag, value in _said(_synopsis(command)).items():
            opt = _option(cmd, flag)
            if opt is None or "|" in value or "," in value or not re.fullmatch(r"[a-z0-9][a-z0-9._-]*", value):
                continue  # a metavar (N, FILE), a choice list, or an example list
            if _default(opt) is None:  # an example (`-o cost.toml`), not a default
                continue
            assert value == _default(opt), (command, flag, value, _default(opt))
            checked += 1
    assert checked >= 6  # demo --db; dashboard --port, --host; collect --port, --grpc-port, --host


def test_a_commands_own_default_mode_is_in_its_row():
    """`curve` replays cache-only unless told: the run settings' --mode defaults to engine elsewhere."""
    for command, cmd in COMMANDS.items():
        opt = _option(cmd, "--mode")
        if opt is None:
            continue
        if _default(opt) == "engine":
            continue
        assert f"default `--mode {_default(opt)}`" in _row(command), command


def test_optional_arguments_are_bracketed_and_required_ones_are_not():
    """`kvtrace generate [WORKLOAD]`: the workload has a default (mixed); TRACE of replay has none."""
    for command, cmd in COMMANDS.items():
        synopsis = _synopsis(command)
        for p in cmd.params:
            if p.param_type_name != "argument":
                continue
            name = (p.name or "").upper()
            if p.required:
                assert re.search(rf"(?<!\[){name}\b", synopsis), (command, name)
            else:
                assert f"[{name}]" in synopsis, (command, name)


def test_the_study_rows_json_keys_are_what_study_prints(tmp_path):
    """`kvtrace study --json`'s keys as the row lists them; with --db it said only "db" was added,
    where the ids of the two runs stored there ("run_off", "run_on") are too."""
    import json

    from typer.testing import CliRunner

    row = _row("kvtrace study")
    said = re.search(r'`--json` prints `\{([^}]+)\}` \(with `--sweep`: of its first value, plus `"sweep": '
                     r'\{([^}]+)\}`; with `--db`, plus ([^)]+)\)', row)
    assert said is not None, row
    keys, sweep_keys, db_keys = (set(re.findall(r'"(\w+)"', g)) for g in said.groups())
    base = ["study", "shared-prefix-pinning", "--limit", "12", "--json"]
    for extra, expected in (([], keys), (["--db", str(tmp_path / "s.duckdb")], keys | db_keys),
                            (["--sweep", "capacity_blocks=100,200"], keys | {"sweep"})):
        result = CliRunner().invoke(app, base + extra)
        assert result.exit_code == 0, result.output
        printed = json.loads(result.stdout)
        assert set(printed) == expected, (extra, sorted(printed))
        if "sweep" in printed:
            assert set(printed["sweep"]) == sweep_keys
