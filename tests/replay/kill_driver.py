"""A replay that stops itself at a fixed virtual point, for the kill -9 test.

    python -m tests.replay.kill_driver TRACE LIMIT DB MARKER N

Replays TRACE (engine mode, the first LIMIT requests) into DB through a store that
commits every batch it is handed; after its N-th commit it writes the number of rows
committed to MARKER and waits to be killed. The replay is kvtrace's own (run_replay);
only the store's flush is extended, to signal.
"""

from __future__ import annotations

import os
import sys
import time

from kvtrace.replay.run import RunSpec, run_replay
from kvtrace.store.writer import Store


class SignallingStore(Store):
    marker: str = ""
    after: int = 0
    commits = 0
    committed = 0

    def flush(self) -> int:
        rows = super().flush()
        if rows:
            self.commits += 1
            self.committed += rows
            if self.commits == self.after:
                tmp = f"{self.marker}.tmp"
                with open(tmp, "w") as f:
                    f.write(str(self.committed))
                os.replace(tmp, self.marker)
                time.sleep(600)  # the test kills us here
        return rows


def main(trace: str, limit: str, db: str, marker: str, after: str) -> None:
    store = SignallingStore.open(db, flush_interval_s=0.0)  # commit every hand-over
    store.marker, store.after = marker, int(after)
    run_replay(RunSpec(trace, limit=int(limit)), store=store)
    raise SystemExit(f"the replay ended before {after} commits")


if __name__ == "__main__":
    main(*sys.argv[1:])
