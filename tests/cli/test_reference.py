"""The README's CLI reference names every command and every option it takes."""

from __future__ import annotations

from pathlib import Path

import typer.main

from kvtrace.cli import app
from kvtrace.cli.options import _RUN_OPTIONS

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
SECTION = README[README.index("## CLI reference"):README.index("\n## ", README.index("## CLI reference") + 1)]
RUN_SETTINGS = SECTION[:SECTION.index("| command |")]


def _commands(group, prefix: str):
    for name, cmd in sorted(group.commands.items()):
        if isinstance(cmd, typer.core.TyperGroup):
            yield from _commands(cmd, f"{prefix} {name}")
        else:
            yield f"{prefix} {name}", cmd


COMMANDS = list(_commands(typer.main.get_command(app), "kvtrace"))


def _row(command: str) -> str:
    rows = [line for line in SECTION.splitlines() if line.startswith(f"| `{command} ") or
            line.startswith(f"| `{command}`")]
    assert len(rows) == 1, f"{command}: {len(rows)} rows in the README's CLI reference"
    return rows[0]


def test_every_command_has_one_row_naming_its_own_options():
    assert len(COMMANDS) >= 15
    run_flags = {"--" + name.replace("_", "-") for name in _RUN_OPTIONS} | {"--format", "--without", "--config"}
    for command, cmd in COMMANDS:
        row = _row(command)
        for param in cmd.params:
            if param.param_type_name != "option" or param.name == "help":
                continue
            flags = [*param.opts, *param.secondary_opts]
            if set(flags) & run_flags and "[run settings]" in row:
                continue
            assert any(f"{flag} " in row or f"{flag}]" in row or f"{flag}`" in row for flag in flags), (
                f"{command}: {flags} missing from its README row")


def test_the_run_settings_paragraph_names_every_run_setting():
    for name, (_ann, _default, _field) in _RUN_OPTIONS.items():
        flag = {"fmt": "--format"}.get(name, "--" + name.replace("_", "-"))
        assert f"`{flag}" in RUN_SETTINGS, flag
