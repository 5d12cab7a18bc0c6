"""A terminal narrower than a table still shows its cells: laid out at the terminal's 5
columns, rich left every cell of ``kvtrace runs`` blank and the command exited 0. Tables are
laid out at least 80 columns wide; the terminal wraps the lines."""

from __future__ import annotations

import io
import sys

import pytest
from rich.table import Table

from kvtrace.names import MIN_TERMINAL_WIDTH, stdout_console


@pytest.mark.parametrize("columns", ["5", "1", "79"])
def test_a_narrow_terminal_gets_the_tables_cells(monkeypatch, columns) -> None:
    monkeypatch.setenv("COLUMNS", columns)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    console = stdout_console()
    assert console.width == MIN_TERMINAL_WIDTH
    console.file = io.StringIO()
    table = Table("run", "name", "trace", "status")
    table.add_row("r1", "gen:chat", "gen:chat", "complete")
    console.print(table)
    assert "complete" in console.file.getvalue()


def test_a_wide_terminal_keeps_its_width(monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert stdout_console().width == 200
