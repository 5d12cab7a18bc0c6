"""A chdb replay whose writer dies halfway through a flush, for the recovery test.

    python -m tests.clickhouse.partial_flush_driver TRACE LIMIT DB MARKER N

Replays TRACE (engine mode, the first LIMIT requests) into DB (``chdb:DIR``), committing
every hand-over; the N-th commit of spans of several families inserts every family table's
rows but those of the batch's first span, writes the rows fully committed before it to
MARKER and ends the process at once, as a kill -9 between two of a flush's inserts would.
"""

from __future__ import annotations

import os
import sys

from kvtrace.replay.run import RunSpec, run_replay
from kvtrace.store import Store
from kvtrace.store.clickhouse.writer import ClickHouseStore

_commit = ClickHouseStore._commit


def main(trace: str, limit: str, db: str, marker: str, after: str) -> None:
    state = {"commits": 0, "rows": 0}

    def commit(self, inserts) -> None:
        if len(inserts) > 1:
            state["commits"] += 1
        if state["commits"] == int(after):
            first = min(inserts, key=lambda insert: insert[2].column("seq")[0].as_py())
            _commit(self, [insert for insert in inserts if insert is not first])
            with open(marker, "w") as f:
                f.write(str(state["rows"]))
            os._exit(9)
        _commit(self, inserts)
        state["rows"] += sum(rows.num_rows for _, _, rows in inserts)

    ClickHouseStore._commit = commit  # type: ignore[method-assign]
    store = Store.open(db, flush_interval_s=0.0)  # commit every hand-over
    run_replay(RunSpec(trace, limit=int(limit)), store=store)
    raise SystemExit(f"the replay ended before {after} commits")


if __name__ == "__main__":
    main(*sys.argv[1:])
