"""Store errors: one line naming the database file and what was expected."""

from __future__ import annotations

import os
import re

from kvtrace.errors import KVTraceError
from kvtrace.names import printable, shell_path, shown_value

DAMAGED = "damaged kvtrace store"  # how every error about a store's broken insides begins
COMMITTED_STAYS = "(what was committed before stays)"  # how a write the disk refused ends
# DuckDB's async writer wraps the system's reason in JSON (a full disk while a file grows:
# ..."Could not write file \"...\": No space left on device","errno":"28"})
# (at the end of the text, where the JSON closes: a path holding "errno":"2" is the user's, and
# was read as the reason, 'No such file or directory' for a full disk)
_JSON_ERRNO = re.compile(r'"errno":"(?P<errno>\d{1,9})"\}*\s*$')


def write_failure_reason(text: str) -> str:
    """The system's reason in DuckDB's text for a file it could not write: its errno's words
    where DuckDB's JSON gives one, else what follows its last colon."""
    found = _JSON_ERRNO.search(text)
    if found is not None:
        return os.strerror(int(found["errno"]))
    return text.rsplit(": ", 1)[-1]


class StoreError(KVTraceError):
    """A database that cannot be used as a kvtrace store (missing, corrupt, foreign, busy)."""

    def __init__(self, path: str, what: str):
        super().__init__(f"{printable(str(path))}: {what}")  # (a newline in it shown as \n, not joined into a space)
        self.path, self.what = str(path), what


class StoreBusyError(StoreError):
    """Another process held the file for longer than the lock timeout."""


class UnknownRunError(StoreError):
    def __init__(self, path: str, run_id: str):
        # (its repr cut in the middle: an API caller's 5,000-character id was quoted whole)
        super().__init__(path, f"no run with id {shown_value(run_id)} (see `kvtrace runs --db {shell_path(path)}`)")
        self.run_id = run_id
