"""``kvtrace replay`` (the CLI's own main) that sends itself SIGTERM at a fixed virtual point.

    python -m tests.replay.sigterm_driver MARKER N[:SIGNAL] -- REPLAY ARGS...

The store commits every hand-over; after its N-th commit of spans it writes the rows committed so far to MARKER and
signals its own process (SIGTERM, or the SIGNAL named: SIGHUP), as `kill` or `timeout` would;
the replay goes on until the signal lands in the main thread. SIGNAL ``wait``: no signal of
its own; the commit waits (up to a minute) for one from outside (a terminal's hang-up).
Only the store's flush is extended, to signal.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from kvtrace import cli
from kvtrace.store.writer import Store

_flush = Store.flush
_state = {"commits": 0, "rows": 0}


def main(marker: str, after_signal: str, *argv: str) -> None:
    from kvtrace.process import stop_signalled

    after, _, signame = after_signal.partition(":")

    def flush(self: Store) -> int:
        rows = _flush(self)
        if rows:
            _state["commits"] += 1
            _state["rows"] += rows
            if _state["commits"] == int(after):
                with open(marker, "w") as f:
                    f.write(str(_state["rows"]))
                if signame != "wait":
                    os.kill(os.getpid(), getattr(signal, signame or "SIGTERM"))
                deadline = time.monotonic() + 60
                while signame == "wait" and not stop_signalled() and time.monotonic() < deadline:
                    time.sleep(0.01)
        return rows

    Store.flush = flush  # type: ignore[method-assign]
    Store.flush_if_due = flush  # type: ignore[method-assign]  # commit every hand-over, as the kill test's driver
    sys.argv = ["kvtrace", *argv]
    cli.main()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *sys.argv[4:])
