"""What changes whenever a store can have changed, read from the file system without opening
the store: keys for what a process keeps about a store between opens.

- ``duckdb_file_state``: the database file and its WAL (identity, size, mtime). Every
  commit changes one of them; so does a file replaced, truncated or overwritten.
- ``chdb_catalog_state``: an embedded ClickHouse's metadata directory, where ClickHouse
  renames each table's definition into place on a CREATE, ALTER or DROP.
- ``content_state(db)``: for caches of query results (the dashboard's): the DuckDB file's
  state, or chdb's catalog plus each table's data directory (a part added, merged or
  dropped renames an entry in it), and whether the writers of the running runs read so
  far are still alive. None for a ClickHouse server, or when it cannot be
  told: the caller then keeps its answers until asked to re-read.
"""

from __future__ import annotations

import os

from kvtrace.errors import KVTraceError, wal_path
from kvtrace.store.backend import ClickHouseTarget, clickhouse_target, is_clickhouse
from kvtrace.store.liveness import live_writers_state


def duckdb_file_state(path: str) -> tuple | None:
    """What changes whenever a DuckDB file's catalog or rows can have changed (None: unknown)."""
    try:
        st = os.stat(path)
        key: tuple = (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    except OSError:
        return None
    try:
        wal = os.stat(wal_path(path))
        return (*key, wal.st_size, wal.st_mtime_ns)
    except FileNotFoundError:
        return (*key, None)
    except OSError:
        return None


def chdb_catalog_state(target: ClickHouseTarget) -> tuple | None:
    """What changes whenever a chdb store's tables or columns can have changed (None: a
    server, or not known)."""
    if target.path is None:
        return None
    try:
        st = os.stat(os.path.join(target.path, "metadata", target.database))
    except OSError:
        return None
    return (os.path.realpath(target.path), target.database, st.st_dev, st.st_ino, st.st_mtime_ns)


def _chdb_data_state(target: ClickHouseTarget) -> tuple | None:
    """Each table's data directory (``data/DATABASE/TABLE``, a link into ``store/``) by its
    identity and mtime: ClickHouse adds, merges and drops parts as entries of it."""
    assert target.path is not None
    tables = os.path.join(target.path, "data", target.database)
    try:
        names = sorted(os.listdir(tables))
        out = []
        for name in names:
            st = os.stat(os.path.join(tables, name))
            out.append((name, st.st_ino, st.st_mtime_ns))
    except OSError:
        return None
    return tuple(out)


def content_state(db: str | os.PathLike) -> tuple | None:
    """What changes whenever the store ``db`` names can hold other rows or tables, or its
    runs read another status (None: not known, e.g. a ClickHouse server). About 0.1 ms:
    cheap beside any query.

    A writer killed with -9 changes no file, yet its ``running`` run then reads
    ``incomplete``: so the state also says whether each writer this process's readers found
    alive behind a running run of the store still is (``liveness.live_writers_state``)."""
    text = str(db)
    files = _files_state(text)
    return None if files is None else (files, live_writers_state(text))


def _files_state(text: str) -> tuple | None:
    if not is_clickhouse(text):
        return duckdb_file_state(text)
    try:
        target = clickhouse_target(text)
    except KVTraceError:
        return None
    catalog = chdb_catalog_state(target)
    if catalog is None:
        return None
    data = _chdb_data_state(target)
    return None if data is None else (catalog, data)
