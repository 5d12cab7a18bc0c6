"""The ``kvtrace`` command. It only wires the packages together: each module registers
its commands on ``app`` and imports what a command needs when it runs, so a command
line with a mistake fails fast, before any heavy import.

- ``application.py``: the Typer application the command modules register on
- ``commands.py``: every command registered, and ``run``: one command line, each error one line
- ``replay.py``: replay, sweep, curve
- ``traces.py``: generate, convert
- ``results.py``: runs, diff, study, demo, export, dashboard
- ``calibrate.py``: calibrate
- ``conformance.py``: conformance (kvtrace's manager beside vLLM's)
- ``live.py``: collect, capture vllm
- ``options.py``/``choices.py``: the options and enumerations commands share
- ``output.py``: how commands talk (data on stdout, status and errors on stderr)

This module imports nothing itself: ``main`` is the console script, and a Ctrl-C while
the commands load (a quarter second of imports) is the one-line interrupt that a Ctrl-C
later is, not a traceback from inside an import.
"""

from __future__ import annotations

import os
import signal
from typing import Any

__all__ = ["app", "main"]


def main() -> None:
    """The ``kvtrace`` console script."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # (started so: `kvtrace ... &` in a script)
        from kvtrace.cli.commands import run  # Ctrl-C is ignored throughout, as Python leaves it
    else:
        previous = signal.signal(signal.SIGINT, _interrupted_while_loading)
        try:
            from kvtrace.cli.commands import run
        finally:
            signal.signal(signal.SIGINT, previous)
    run()


def _interrupted_while_loading(signum: int, frame: Any) -> None:
    os.write(2, b"kvtrace: error: interrupted\n")
    os._exit(130)


def __getattr__(name: str) -> Any:
    if name == "app":  # the Typer application, its commands registered
        from kvtrace.cli.commands import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
