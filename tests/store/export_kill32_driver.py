"""An export killed with -9 at its K-th rename of a Parquet file (for test_export_kill32).

    python -m tests.store.export_kill32_driver DB RUN DIR K

Runs kvtrace's own export_parquet of RUN into DIR; the K-th ``os.replace`` onto one of the
exported files or an earlier file set aside (``*.parquet``, ``*.old``) kills the process
with SIGKILL just before it renames (a fixed point of the rename phase, as a kill -9 there).
"""

from __future__ import annotations

import os
import signal
import sys

from kvtrace.store import export_parquet


def main(db: str, run_id: str, out: str, k: str) -> None:
    replace, renames = os.replace, [0]

    def killed_at_the_kth(src, dst) -> None:
        if str(dst).endswith((".parquet", ".old")):
            renames[0] += 1
            if renames[0] == int(k):
                os.kill(os.getpid(), signal.SIGKILL)
        replace(src, dst)

    os.replace = killed_at_the_kth  # type: ignore[assignment]
    export_parquet(db, run_id, out)
    raise SystemExit(f"the export made fewer than {k} renames")


if __name__ == "__main__":
    main(*sys.argv[1:])
