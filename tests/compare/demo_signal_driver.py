"""``kvtrace demo`` (the CLI's own main) that signals its own process at a fixed virtual point.

    python -m tests.compare.demo_signal_driver SIGNAL WHEN N LIMIT -- demo ARGS...

SIGNAL is TERM or INT. WHEN is ``run`` (after the demo's N-th replay has returned: that run
is recorded whole) or ``commit`` (after the store's N-th commit of spans: in the middle of
a run). Each replay is cut to LIMIT requests, so the demo takes seconds. Before signalling,
the driver writes ``signalled`` to the file named by ``$DEMO_DRIVER_MARKER`` (when set).
"""

from __future__ import annotations

import os
import signal
import sys

from kvtrace import cli
from kvtrace.compare import demo
from kvtrace.store.writer import Store


def main(sig: str, when: str, n: str, limit: str, *argv: str) -> None:
    count = {"run": 0, "commit": 0}

    def tick(what: str) -> None:
        count[what] += 1
        if what == when and count[what] == int(n):
            marker = os.environ.get("DEMO_DRIVER_MARKER")
            if marker:
                with open(marker, "w") as f:
                    f.write("signalled")
            os.kill(os.getpid(), getattr(signal, f"SIG{sig}"))

    replay = demo.run_replay

    def run_replay(*args, **kwargs):
        result = replay(*args, **kwargs)
        tick("run")
        return result

    flush = Store.flush

    def committing_flush(self: Store) -> int:
        rows = flush(self)
        if rows:
            tick("commit")
        return rows

    demo.run_replay = run_replay
    specs = demo.demo_specs

    def demo_specs(*args, **kwargs):
        return specs(*args, **{**kwargs, "limit": int(limit)})

    demo.demo_specs = demo_specs
    Store.flush = committing_flush  # type: ignore[method-assign]
    Store.flush_if_due = committing_flush  # type: ignore[method-assign]  # a commit every hand-over
    sys.argv = ["kvtrace", *argv]
    cli.main()


if __name__ == "__main__":
    main(*sys.argv[1:5], *sys.argv[6:])
