"""How commands talk: data on stdout, status and errors on stderr."""

from __future__ import annotations

import json
from typing import Any

import typer


def error(msg: str) -> None:
    typer.echo(f"kvtrace: error: {msg}", err=True)


def status(msg: str) -> None:
    """A status line on stderr, so stdout stays clean for data."""
    typer.echo(msg, err=True)


def echo_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, sort_keys=True))


def recorded(run_id: str | None, db) -> None:
    """Every command that records a run says so, with the id the other commands take."""
    if run_id is not None:
        status(f"kvtrace: run {run_id} recorded in {db}")


def print_rows(rows: list[list[str]], title: str | None = None, left: int = 1) -> None:
    """A table on stdout; the first row is the header, the first ``left`` columns are
    text (left-aligned). Piped output is not wrapped to 80 columns: it is for reading
    whole, or for grep."""
    import sys

    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, header_style="bold")
    for i, name in enumerate(rows[0]):
        table.add_column(name, justify="left" if i < left else "right")
    for row in rows[1:]:
        table.add_row(*row)
    Console(width=None if sys.stdout.isatty() else 250).print(table)
