"""``python -m kvtrace.dashboard --db PATH [--port N] [--host H]``: the same as ``kvtrace dashboard``."""

from __future__ import annotations

import argparse
import sys

from kvtrace.dashboard import launch
from kvtrace.errors import KVTraceError
from kvtrace.names import printable
from kvtrace.process import sigterm_as_interrupt, terminated


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtrace.dashboard")
    parser.add_argument("--db", required=True)
    parser.add_argument("--port", type=int, default=8501)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args(argv)
    try:
        with sigterm_as_interrupt():  # SIGTERM or SIGHUP stops the server as Ctrl-C does, then exits 143 or 129
            return launch(args.db, host=args.host, port=args.port)
    except KVTraceError as err:
        print(f"kvtrace: error: {printable(err)}", file=sys.stderr)  # (the path as typed, never terminal codes)
        return 2
    except KeyboardInterrupt:
        by = terminated()
        if by is not None:
            print(f"kvtrace: error: terminated ({by.name})", file=sys.stderr)
            return 128 + by
        print("kvtrace: error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
