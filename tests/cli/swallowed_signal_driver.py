"""``kvtrace`` (the CLI's own main) with a signal that a library swallows while it records.

    python -m tests.cli.swallowed_signal_driver SIGNAL -- KVTRACE ARGS...

When the store finishes its first run, the process signals itself (SIGINT or SIGTERM, as
Ctrl-C or `kill` would) while "a library" runs, and that library does what DuckDB does
with an interrupt in a query: catches the KeyboardInterrupt and raises an error of its own
with nothing in its context ("Query interrupted"). Only that one call is extended.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from kvtrace import cli
from kvtrace.store.writer import Store


def main(signame: str, *argv: str) -> None:
    finish = Store.finish_run

    def finish_run(self, *args, **kwargs):
        interrupted = False
        try:
            os.kill(os.getpid(), getattr(signal, signame))
            time.sleep(5)  # (the handler runs at once, in this thread)
        except KeyboardInterrupt:
            interrupted = True
        if interrupted:  # raised outside the handler: no KeyboardInterrupt in its context
            raise RuntimeError("Query interrupted")
        return finish(self, *args, **kwargs)

    Store.finish_run = finish_run  # type: ignore[method-assign]
    sys.argv = ["kvtrace", *argv]
    cli.main()


if __name__ == "__main__":
    main(sys.argv[1], *sys.argv[3:])
