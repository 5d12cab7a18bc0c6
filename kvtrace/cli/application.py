"""The ``kvtrace`` Typer application; the command modules register on it."""

from __future__ import annotations

from typing import Annotated

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"max_content_width": 120},
    help="Flight recorder and wind tunnel for hybrid LLM prefix (KV) caches.",
)
capture_app = typer.Typer(no_args_is_help=True, help="Record a live serving engine.")
app.add_typer(capture_app, name="capture")


def _print_version(show: bool) -> None:
    if show:
        from kvtrace import __version__

        typer.echo(f"kvtrace {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool | None, typer.Option("--version", callback=_print_version, is_eager=True,
                                                    help="Print the version and exit.")] = None,
) -> None:
    """Flight recorder and wind tunnel for hybrid LLM prefix (KV) caches."""
