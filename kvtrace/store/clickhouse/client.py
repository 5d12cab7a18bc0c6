"""One connection type over both ClickHouse roads: chdb (embedded) and clickhouse-connect.

``ClickHouseConnection`` runs the store's DuckDB-spelled SQL (``query_arrow``/``frame``:
translated by ``kvtrace.store.dialect``) and ClickHouse SQL (``ch_arrow``/``command``),
and inserts Arrow tables by column name. Every session runs with
``dialect.QUERY_SETTINGS``.

chdb holds its data directory with an OS lock: one process at a time, and one
directory per process. kvtrace opens it per use, as it does a DuckDB file, so a writer
and a dashboard in different processes take turns (retrying while the other holds it,
up to the timeout); inside one process every opener of a directory shares one session,
closed ``LINGER_S`` after the last lets go. A chdb session answers one query at a time:
its queries are taken in turn (a dashboard's sessions are threads), else one thread's
parameters and results reached another's query.

chdb 4.4 returns a failed query's partial output as the answer of the next query on the
session; after any error a throwaway query clears it.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import logging
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import polars as pl
import pyarrow as pa

from kvtrace.names import errno_phrase
from kvtrace.store import dialect
from kvtrace.store.backend import ClickHouseTarget
from kvtrace.store.errors import DAMAGED, StoreBusyError, StoreError

_MAP = getattr(pl, "Map", lambda k, v: pl.List(pl.Struct({"key": k, "value": v})))(pl.String, pl.String)
# chdb's failure to start names no cause ("Error initializing EmbeddedServer"): its server
# writes the cause to the process's stderr, where it is caught and the first one reported.
_CAUSE = re.compile(r"Code: \d+\. DB::Exception: .*")
# What chdb's server writes when another process holds the directory (Code: 76): busy at the
# moment it tried, although the holder may be gone before _directory_locked looks.
_HELD = "Another server instance in same directory is already running"
# ClickHouse's codes for data files it cannot read: ATTEMPT_TO_READ_AFTER_EOF, CANNOT_READ_ALL_DATA,
# TOO_LARGE_SIZE_COMPRESSED, CHECKSUM_DOESNT_MATCH, FILE_DOESNT_EXIST, CORRUPTED_DATA,
# CANNOT_DECOMPRESS, UNKNOWN_CODEC
_DATA_DAMAGE = re.compile(r"Code: (?:32|33|39|40|107|246|271|432)\. DB::Exception: (?P<reason>.*)")
_DAMAGED_FILE = re.compile(r"(?:decompressing|[Ff]ile) (?P<file>/[^\s:,()]+)")
_DAMAGED_TABLE = re.compile(r"in table [^\s.]+\.(?P<table>\w+)")
LINGER_S = 2.0
_sessions: dict[str, list[Any]] = {}  # chdb path -> [session, users, the lock its queries take in turn]
_sessions_lock = threading.RLock()


def _missing_extra(err: ImportError) -> StoreError:
    return StoreError("--db", f"ClickHouse needs the optional packages: pip install 'kvtrace[clickhouse]' ({err})")


@contextlib.contextmanager
def _logger_silenced(name: str) -> Iterator[None]:
    """A library's logger quiet for a block whose errors kvtrace reports itself."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class ClickHouseConnection:
    """An open ClickHouse database (see the module docstring)."""

    def __init__(self, target: ClickHouseTarget, session: Any = None, client: Any = None,
                 lock: threading.RLock | None = None):
        self.target = target
        self._session = session  # chdb
        self._lock = lock or threading.RLock()  # chdb: the session's, shared by its threads
        self._client = client  # clickhouse-connect

    # -- DuckDB-spelled SQL (the store's shared queries) -----------------------------------
    def query_arrow(self, sql: str, params: Mapping[str, Any] | None = None) -> pa.Table:
        text, bound = dialect.to_clickhouse(sql, params)
        return self.ch_arrow(text, bound)

    def frame(self, sql: str, params: Mapping[str, Any] | None = None) -> pl.DataFrame:
        return to_frame(self.query_arrow(sql, params))

    # -- ClickHouse SQL ----------------------------------------------------------------------
    def ch_arrow(self, sql: str, params: Mapping[str, Any] | None = None) -> pa.Table:
        """Run ClickHouse SQL with ``{name:Type}`` parameters; the result as Arrow."""
        try:
            if self._client is not None:
                return self._client.query_arrow(sql, parameters=dict(params or {}), use_strings=True)
            return _arrow(self._run(sql, "Arrow", params))
        except StoreError:
            raise
        except Exception as err:
            raise self._damage(err) or StoreError(self.target.label,
                                                  f"ClickHouse refused a query: {_first_line(err)}") from None

    def ch_frame(self, sql: str, params: Mapping[str, Any] | None = None) -> pl.DataFrame:
        return to_frame(self.ch_arrow(sql, params))

    def command(self, sql: str, params: Mapping[str, Any] | None = None) -> None:
        """Run a ClickHouse statement (DDL, INSERT ... SELECT, ALTER)."""
        try:
            if self._client is not None:
                self._client.command(sql, parameters=dict(params) if params else None)
            else:
                self._run(sql, "CSV", params)
        except Exception as err:
            raise self._damage(err) or StoreError(self.target.label,
                                                  f"ClickHouse refused a statement: {_first_line(err)}") from None

    def _damage(self, err: Exception) -> StoreError | None:
        """A "damaged kvtrace store" error naming the file, where ClickHouse failed on the
        store's data files (a flipped byte, garbage of the right size, a file gone), which
        it finds only when a query reads them; else None."""
        text = _first_line(err)
        found = _DATA_DAMAGE.search(text)
        if found is None:
            return None
        reason = found["reason"].split(": While", 1)[0].split(". Most likely", 1)[0]
        where = _DAMAGED_FILE.search(text)
        name = where["file"] if where else None
        if name and self.target.path and name.startswith(self.target.path + os.sep):
            name = name[len(self.target.path) + 1:]
        table = _DAMAGED_TABLE.search(text)
        of = f" of table {table['table']}" if table else ""
        return StoreError(self.target.label, f"{DAMAGED}: ClickHouse cannot read "
                                             f"{name or 'a data file'}{of} ({reason[:100]})")

    def insert_arrow(self, table: str, rows: pa.Table) -> None:
        """Insert ``rows`` into ``table`` by column name (columns it lacks take their defaults)."""
        if rows.num_rows == 0:
            return
        try:
            if self._client is not None:
                self._client.insert_arrow(table, rows)
                return
            kvtrace_rows = _compact_lists(rows)  # noqa: F841  (read by name by chdb's Python() function)
            cols = ", ".join(f"`{c}`" for c in rows.column_names)
            self._run(f"INSERT INTO {table} ({cols}) SELECT {cols} FROM Python(kvtrace_rows)", "CSV", None)
        except Exception as err:
            raise StoreError(self.target.label, f"ClickHouse refused an insert into {table}: "
                                                f"{_first_line(err)}") from None

    def table_names(self) -> set[str]:
        frame = self.ch_frame("SELECT name FROM system.tables WHERE database = currentDatabase()")
        return set(frame["name"].to_list())

    def _run(self, sql: str, fmt: str, params: Mapping[str, Any] | None):
        from clickhouse_connect.driver.binding import bind_query

        bound: dict[str, str] = {}
        if params:
            sql_text, rendered = bind_query(sql, dict(params))
            sql = sql_text.decode() if isinstance(sql_text, bytes) else sql_text
            bound = {k.removeprefix("param_"): v for k, v in rendered.items()}
        with self._lock:
            try:
                return self._session.query(sql, fmt, params=bound or None)
            except Exception:
                with contextlib.suppress(Exception):
                    self._session.query("SELECT 1", "CSV")  # clears chdb's leftover partial result
                raise


def _arrow(result: Any) -> pa.Table:
    """chdb's Arrow result (an Arrow IPC file) as a table: read here, as chdb's own "ArrowTable"
    reads it, without the pandas import that costs every chdb command 0.3 s."""
    if len(result) == 0:
        return pa.table({})
    return pa.ipc.open_file(result.get_memview().view()).read_all()


def to_frame(table: pa.Table) -> pl.DataFrame:
    """Arrow from ClickHouse as a polars frame: an empty list or map reads as NULL
    (ClickHouse has neither a NULL array nor a NULL map, so what DuckDB stores as NULL
    comes back empty)."""
    frame = pl.from_arrow(table)
    assert isinstance(frame, pl.DataFrame)
    empty = {n: pl.col(n).list.len() for n, t in frame.schema.items() if isinstance(t, pl.List)}
    maps = {n for n, t in frame.schema.items() if type(t).__name__ == "Map"}
    if maps:  # polars' Map type: compare through its List(Struct) form
        frame = frame.with_columns(pl.col(n).cast(pl.List(pl.Struct({"key": pl.String, "value": pl.String})))
                                   for n in maps)
        empty |= {n: pl.col(n).list.len() for n in maps}
    if not empty:
        return frame
    frame = frame.with_columns(pl.when(length > 0).then(pl.col(n)).otherwise(None).alias(n)
                               for n, length in empty.items())
    return frame.with_columns(pl.col(n).cast(_MAP) for n in maps)  # back to polars' Map


def _compact_lists(rows: pa.Table) -> pa.Table:
    """chdb's Python() reader refuses a NULL list slot that spans child values (legal
    Arrow); ``take`` rewrites the offsets so NULL slots are empty."""
    if any(pa.types.is_list(f.type) and rows.column(f.name).null_count for f in rows.schema):
        return rows.take(pa.array(range(rows.num_rows)))
    return rows


def _open_session(target: ClickHouseTarget, timeout_s: float) -> Any:
    try:
        from chdb import session as chs
    except ImportError as err:
        raise _missing_extra(err) from None
    assert target.path is not None
    deadline = time.monotonic() + timeout_s
    backoff = 0.01
    while True:
        with _stderr_caught() as written:
            failure: Exception = RuntimeError("chdb did not start")
            try:
                session = chs.Session(target.path)
            except Exception as err:
                session, failure = None, err
        if session is not None:
            if written[0]:  # (what a server that started wrote: shown as it was)
                sys.stderr.write(written[0])
            break
        text = str(failure)
        if "cannot connect with different path" in text:
            raise StoreError(target.label, "this process already has another chdb store open "
                                           "(chdb opens one directory per process)") from None
        if not (_HELD in written[0] or _directory_locked(target.path)):  # not busy: damaged metadata, ...
            cause = _CAUSE.search(written[0])
            raise StoreError(target.label, "cannot open as a chdb store: "
                                           f"{cause.group(0) if cause else _first_line(failure)}"[:500]) from None
        if time.monotonic() >= deadline:
            raise StoreBusyError(target.label, f"held by another process for over {timeout_s:g}s "
                                               "(chdb: one process at a time)") from None
        time.sleep(backoff)
        backoff = min(backoff * 2, 0.1)
    for key, value in dialect.QUERY_SETTINGS.items():
        session.query(f"SET {key} = {int(value)}", "CSV")
    return session


@contextlib.contextmanager
def _stderr_caught() -> Iterator[list[str]]:
    """The process's stderr (file descriptor 2, where chdb's C++ server writes) into a list's
    one item for the block: a waiting opener's retries print nothing, a failed start's cause
    is read back."""
    sys.stderr.flush()
    saved = os.dup(2)
    written: list[str] = [""]
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield written
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            written[0] = caught.read(1 << 20).decode("utf-8", "replace")


def _directory_locked(path: str) -> bool:
    """Whether another server holds the chdb directory: the lock ClickHouse takes on its
    ``status`` file (flock, exclusive) while it runs."""
    try:
        fd = os.open(os.path.join(path, "status"), os.O_RDONLY)
    except OSError:
        return False  # (no status file: nobody runs there)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _close_idle(path: str | None = None) -> None:
    """Close lingering sessions nobody uses (all, or the one of ``path``)."""
    with _sessions_lock:
        for p, entry in list(_sessions.items()):
            if entry[1] == 0 and (path is None or p == path):
                del _sessions[p]
                entry[0].close()


atexit.register(_close_idle)


@contextlib.contextmanager
def connect(target: ClickHouseTarget, timeout_s: float = 30.0) -> Iterator[ClickHouseConnection]:
    """An open ClickHouse connection for the duration of the block.

    chdb: opening a store costs 0.1-0.3 s (it loads every table), so the session lingers
    ``LINGER_S`` after its last user: a dashboard page's reads share one, and another
    process gets the directory a moment later (it retries meanwhile)."""
    if target.embedded:
        assert target.path is not None
        with _sessions_lock:
            if target.path not in _sessions:
                _close_idle()  # chdb: one directory per process
            entry = _sessions.get(target.path)
            if entry is None:
                entry = _sessions[target.path] = [_open_session(target, timeout_s), 0, threading.RLock()]
            entry[1] += 1
        try:
            yield ClickHouseConnection(target, session=entry[0], lock=entry[2])
        finally:
            with _sessions_lock:
                entry[1] -= 1
                if entry[1] == 0:
                    timer = threading.Timer(LINGER_S, _close_idle, (target.path,))
                    timer.daemon = True
                    timer.start()
        return
    try:
        import clickhouse_connect
    except ImportError as err:
        raise _missing_extra(err) from None
    try:
        # (its driver logs "Unexpected Http Driver Exception" before raising: the error is ours to say, once)
        with _logger_silenced("clickhouse_connect"):
            client = clickhouse_connect.get_client(
                host=target.host, port=target.port, username=target.username, password=target.password,
                database=target.database, secure=target.secure, settings=dict(dialect.QUERY_SETTINGS),
                connect_timeout=max(1, int(timeout_s)),
            )
    except Exception as err:
        # (the driver's text wraps the reason in a pool's retry report with a random query id)
        why = errno_phrase(str(err)) or _first_line(err)
        raise StoreError(target.label, f"cannot connect to ClickHouse at {target.host}:{target.port}: {why}") from None
    try:
        yield ClickHouseConnection(target, client=client)
    finally:
        client.close()
