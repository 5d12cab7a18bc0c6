"""``kvtrace replay`` (the CLI's own main) that sends itself SIGTERM at a fixed virtual point.

    python -m tests.replay.sigterm_driver MARKER N -- REPLAY ARGS...

The store commits every hand-over; after its N-th commit of spans it writes the rows committed so far to MARKER and
signals its own process, as `kill` or `timeout` would; the replay goes on until the signal
lands in the main thread. Only the store's flush is extended, to signal.
"""

from __future__ import annotations

import os
import signal
import sys

from kvtrace import cli
from kvtrace.store.writer import Store

_flush = Store.flush
_state = {"commits": 0, "rows": 0}


def main(marker: str, after: str, *argv: str) -> None:
    def flush(self: Store) -> int:
        rows = _flush(self)
        if rows:
            _state["commits"] += 1
            _state["rows"] += rows
            if _state["commits"] == int(after):
                with open(marker, "w") as f:
                    f.write(str(_state["rows"]))
                os.kill(os.getpid(), signal.SIGTERM)
        return rows

    Store.flush = flush  # type: ignore[method-assign]
    Store.flush_if_due = flush  # type: ignore[method-assign]  # commit every hand-over, as the kill test's driver
    sys.argv = ["kvtrace", *argv]
    cli.main()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *sys.argv[4:])
