"""Store errors: one line naming the database file and what was expected."""

from __future__ import annotations

from kvtrace.errors import KVTraceError
from kvtrace.names import printable

DAMAGED = "damaged kvtrace store"  # how every error about a store's broken insides begins


class StoreError(KVTraceError):
    """A database that cannot be used as a kvtrace store (missing, corrupt, foreign, busy)."""

    def __init__(self, path: str, what: str):
        super().__init__(f"{printable(str(path))}: {what}")  # (a newline in it shown as \n, not joined into a space)
        self.path, self.what = str(path), what


class StoreBusyError(StoreError):
    """Another process held the file for longer than the lock timeout."""


class UnknownRunError(StoreError):
    def __init__(self, path: str, run_id: str):
        super().__init__(path, f"no run with id {run_id!r} (see `kvtrace runs --db {printable(str(path))}`)")
        self.run_id = run_id
