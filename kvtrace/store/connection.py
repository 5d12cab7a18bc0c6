"""Short-lived DuckDB connections with lock retry.

DuckDB lets one process open a file read-write, or any number open it read-only, never
both. kvtrace's writer therefore holds the file only while it commits a batch, and
readers open it read-only for one query at a time. Either side that finds the file
locked retries with backoff until ``timeout_s``.

A replay's writer may keep its connection between the commits of a run (``HeldConnection``:
no open and checkpoint-on-close a second); it lets go after a commit as soon as another
process waits, which says so by touching a marker file: ``<db>.reader-waiting`` for a
reader, ``<db>.writer-waiting`` for a writer.

Writers also take turns under a POSIX lock on ``<db>.write-lock``, held from open to close
(``_WriterLock``): DuckDB 2.0.1 loses a committed transaction now and then when processes take
turns writing one file (4 of 250 races of three processes appending a connection per commit
lost a commit; none with this lock held around each connection's life).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import duckdb

from kvtrace.errors import STORE_SIDE_SUFFIXES, duckdb_magic, wal_owner, wal_path
from kvtrace.names import printable
from kvtrace.store import instances
from kvtrace.store.backend import duckdb_path_problem
from kvtrace.store.errors import COMMITTED_STAYS, DAMAGED, StoreBusyError, StoreError, write_failure_reason
from kvtrace.store.layout import check_layout
from kvtrace.store.schema import META_TABLE, SCHEMA_VERSION, meta_rows, meta_version

DEFAULT_TIMEOUT_S = 30.0
_FIRST_BACKOFF_S = 0.005
_MAX_BACKOFF_S = 0.1
_WRITER_MAX_BACKOFF_S = 0.02
# Writer priority: a writer that finds the file held touches ``<db>.writer-waiting``;
# readers about to open wait (at most READER_YIELD_S) while a fresh marker exists, so a
# dashboard polling in a loop cannot starve a replay's flushes.
READER_YIELD_S = 2.0
_MARKER_FRESH_S = 5.0


def writer_marker(path: str) -> str:
    return f"{path}.writer-waiting"


def reader_marker(path: str) -> str:
    return f"{path}.reader-waiting"


def write_lock_path(path: str) -> str:
    return f"{path}.write-lock"


LOCK_FILE_TEXT = b"kvtrace: the writers' lock of this DuckDB store (removed by its last holder)\n"


def _same_file(fd: int, path: str) -> bool:
    """Whether ``path`` (never followed) is still the regular file open at ``fd``."""
    try:
        now, held = os.stat(path, follow_symlinks=False), os.fstat(fd)
    except OSError:
        return False
    return stat.S_ISREG(now.st_mode) and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def open_lock_file(lock: str, flags: int, text: bytes) -> tuple[int, bool]:
    """(fd, made here) of the lock file at ``lock`` (``flags``: never a link): made with ``text``
    when missing (its text refused by a full disk or a file-size limit: empty, and still ours,
    ``owns_lock_file``), else the one there. OSError as ``os.open`` raises it."""
    try:
        fd = os.open(lock, flags | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return os.open(lock, flags), False
    with contextlib.suppress(OSError):
        os.write(fd, text)
    return fd, True


def owns_lock_file(fd: int, lock: str, text: bytes, made: bool) -> bool:
    """Whether ``lock`` (never followed) is still the regular file open at ``fd`` and kvtrace's:
    holding ``text``, or ``made`` here and empty. Only such a file is removed (a user's file of
    that name, even an empty one, or one put in its place, stays)."""
    if not _same_file(fd, lock):
        return False
    try:
        held = os.pread(fd, len(text) + 1, 0)
    except OSError:
        return False
    return held == text or (made and not held)


def side_files(path: str) -> tuple[str, ...]:
    """The files DuckDB and kvtrace keep beside a store file: its write-ahead log, markers and locks."""
    return tuple(f"{path}{suffix}" for suffix in STORE_SIDE_SUFFIXES)


def others_waiting(path: str) -> bool:
    """Whether another process waits for the file (a fresh reader or writer marker, named
    after the file's real path, as every process names them whatever name it was given)."""
    real = os.path.realpath(path)
    return _marker_is_fresh(reader_marker(real)) or _marker_is_fresh(writer_marker(real))


def _marker_is_fresh(marker: str) -> bool:
    try:
        return time.time() - os.stat(marker).st_mtime < _MARKER_FRESH_S
    except OSError:
        return False


def _yield_to_writer(path: str) -> None:
    marker = writer_marker(path)
    deadline = time.monotonic() + READER_YIELD_S
    while _marker_is_fresh(marker) and time.monotonic() < deadline:
        time.sleep(0.005)


def _touch(marker: str) -> bool:
    """Make or freshen a waiting marker; False where none can be (a read-only directory: no
    priority, plain retry) or something not a regular file has its name (never followed, never
    waited on: a FIFO there held a reader's open for good)."""
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        os.utime(fd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _is_lock_conflict(err: Exception) -> bool:
    text = str(err)
    return "Could not set lock" in text or "Conflicting lock" in text


def _classify(path: str, err: Exception, writing: bool = False) -> StoreError:
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    reason = _write_failure(err) if writing else None
    if reason is not None:  # creating the file on a full disk, in a read-only directory
        return StoreError(path, f"cannot write: {reason}")
    if "not a valid DuckDB database" in text or ("database file" in text.lower() and "valid" in text):
        return StoreError(path, "not a DuckDB database (expected a kvtrace store file)")
    if "in-memory database" in text:  # read-only open of a file DuckDB reads as data (see _check_is_a_file)
        return StoreError(path, _READ_AS_DATA)
    if "Could not read enough bytes" in text or "orrupt" in text:
        return StoreError(path, f"corrupt or truncated DuckDB file ({text})")
    if "version" in text.lower() and "storage" in text.lower():
        return StoreError(path, f"unsupported DuckDB storage version: {text}")
    return StoreError(path, f"cannot open as a kvtrace store: {text}")


def _is_damage(err: Exception) -> bool:
    """A DuckDB error that means the file itself is bad (found by a query, after the open)."""
    text = str(err)
    return "orrupt" in text or "Could not read enough bytes" in text or isinstance(err, duckdb.IOException)


_CANNOT_OPEN = re.compile(r'Cannot open file "(?P<file>[^"]*)": (?P<reason>.+)$')


def _write_failure(err: Exception) -> str | None:
    """The reason of a DuckDB error that says the file could not be written (a full disk, a
    quota, an I/O error at commit, a WAL the directory refuses to hold), else None."""
    text = str(err).splitlines()[0] if str(err) else ""
    if "Could not write" in text or "No space left" in text:  # (a file size limit: "File too large")
        return write_failure_reason(text)
    found = _CANNOT_OPEN.search(text)  # the WAL (or a temp file) in a read-only directory, at commit
    if found is not None and isinstance(err, (duckdb.TransactionException, duckdb.IOException)):
        return f"{found['file']}: {found['reason']}"
    return None


# What DuckDB says when a store query names a table, view or column the file lacks: the
# safety net behind check_layout (a store damaged after it was opened, a relation or column
# it does not know to check).
_MISSING_OBJECT = (duckdb.CatalogException, duckdb.BinderException)


@contextlib.contextmanager
def _named_damage(path: str) -> Iterator[None]:
    """A damaged file met mid-query, or a write the disk refused, is a one-line StoreError
    naming the file, like a damaged file met at open."""
    try:
        yield
    except duckdb.Error as err:
        reason = _write_failure(err)
        if reason is not None:
            raise StoreError(path, f"cannot write: {reason} {COMMITTED_STAYS}") from None
        if isinstance(err, _MISSING_OBJECT):
            text = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise StoreError(path, f"{DAMAGED} ({text})") from None
        if not _is_damage(err):
            raise
        raise _classify(path, err) from None


def _quiet(con: duckdb.DuckDBPyConnection) -> None:
    """No progress bar on long queries. Inside a Jupyter kernel DuckDB refuses the SET
    (it wants ipywidgets) although the bar is already off there, so a refusal is fine."""
    with contextlib.suppress(duckdb.InvalidInputException):
        con.execute("SET enable_progress_bar = false")


_READ_AS_DATA = "not a DuckDB database (DuckDB reads this file as data, e.g. a trace); expected a kvtrace store file"


def _check_is_a_file(con: duckdb.DuckDBPyConnection, path: str) -> None:
    """DuckDB opens an existing file it reads as data (a ``.jsonl`` trace, a ``.csv``) as
    a new in-memory database, without error: nothing written there would be kept."""
    rows = con.execute("SELECT path FROM duckdb_databases() WHERE database_name = current_database()").fetchall()
    if rows and rows[0][0] is None:
        instances.detach(con)
        raise StoreError(path, _READ_AS_DATA)


class _WriterLock:
    """The writers' turn at a store: a POSIX lock on ``<db>.write-lock``, taken before a
    read-write open and let go after the close (see the module docstring).

    POSIX locks belong to a process: a forked child holds none of its parent's (a sweep's
    workers), and a second connection in one process takes none of its own. So the lock is
    counted per process (connections of one process share DuckDB's database instance) and
    forgotten in a forked child. A writer that makes the file writes ``LOCK_FILE_TEXT`` in it;
    the last holder removes it, while it still holds it, only where the path is still that
    file and holds that text (a user's file of that name, or one put in its place, stays);
    whoever locked a file no longer at the path tries again on the new one. Where no lock
    file can be made (a read-only folder, a name at the length limit, something not a file
    there) writers go unguarded, as before.
    """

    _guard: ClassVar[threading.Lock] = threading.Lock()
    _held: ClassVar[dict[str, list[int]]] = {}  # lock path -> [fd (-1: unguarded), connections, made here]

    @classmethod
    def acquire(cls, path: str) -> bool:
        """Whether this process now holds the lock (False: another process does)."""
        import fcntl

        lock = write_lock_path(os.path.realpath(path))  # (one lock whatever name a writer opens the file by)
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        with cls._guard:
            held = cls._held.get(lock)
            if held is not None:
                held[1] += 1
                return True
            while True:
                try:
                    fd, made = open_lock_file(lock, flags, LOCK_FILE_TEXT)
                except FileNotFoundError:
                    continue  # (removed by its last holder between the two opens)
                except OSError:
                    cls._held[lock] = [-1, 1, 0]
                    return True
                if not stat.S_ISREG(os.fstat(fd).st_mode):  # (a FIFO there locks too: never the store's lock)
                    os.close(fd)
                    cls._held[lock] = [-1, 1, 0]
                    return True
                try:
                    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as err:
                    os.close(fd)
                    if err.errno in (errno.EACCES, errno.EAGAIN):
                        return False
                    cls._held[lock] = [-1, 1, 0]  # (a file system without POSIX locks)
                    return True
                if _same_file(fd, lock):
                    cls._held[lock] = [fd, 1, int(made)]
                    return True
                os.close(fd)  # removed by its last holder meanwhile: lock the new one

    @classmethod
    def release(cls, path: str) -> None:
        lock = write_lock_path(os.path.realpath(path))
        with cls._guard:
            held = cls._held.get(lock)
            if held is None:
                return
            held[1] -= 1
            if held[1] > 0:
                return
            del cls._held[lock]
            fd, _, made = held
            if fd < 0:
                return
            try:
                if owns_lock_file(fd, lock, LOCK_FILE_TEXT, bool(made)):
                    os.unlink(lock)
            except OSError:
                pass
            finally:
                os.close(fd)  # (lets the POSIX lock go)

    @classmethod
    def forget(cls) -> None:
        """In a forked child: the parent's locks are not the child's."""
        for fd, _, _ in cls._held.values():
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        cls._held = {}
        cls._guard = threading.Lock()


os.register_at_fork(after_in_child=_WriterLock.forget)


_NO_STORE = "no such database file (run `kvtrace replay --db` or `kvtrace demo` first)"


def rewritten_path_problem(path: str, writing: bool) -> str | None:
    """Why DuckDB would not open ``path`` as kvtrace names it; None where it would.

    DuckDB 2.0.1 rewrites a path before it opens it: a leading ``~`` is the home folder,
    joined as text (``~/s.duckdb`` is $HOME/s.duckdb where kvtrace checked ./~/s.duckdb, and
    ``~x.duckdb`` is $HOME + ``x.duckdb``, a file beside the home folder), and every ``\\`` is
    a ``/`` (a Windows separator: ``a\\b/s.duckdb`` opened ``a/b/s.duckdb``, another file, for
    reading and writing). And it names the write-ahead log by putting ``.wal`` before the
    first ``?`` of the store's real path: a ``?`` in the store's folder sends the log to
    another folder (``q?x/s.duckdb``'s to ``q.wal?x/s.duckdb``), where every commit failed (a
    missing folder, an empty database left behind) or the log went into someone else's
    folder. (A ``?`` in the file's own name keeps the log beside it, under a name DuckDB
    reads back, but not ``<file>.wal``: ``a?b.duckdb``'s is ``a.wal?b.duckdb``, where a DuckDB
    database of its own, another store, would be taken for the log and deleted.)"""
    real = os.path.realpath(path)  # (DuckDB's: links followed, relative to the current directory)
    if path.startswith("~"):
        home = os.environ.get("HOME") or "~"
        return (f"DuckDB reads a leading '~' as the home folder: it would open {printable(home + path[1:])}, not "
                f"{printable(real)}; write the path out ($HOME/..., or ./{printable(path)} for that name here)")
    if "\\" in path or "\\" in real:
        return (f"DuckDB reads a '\\' in a path as '/' (a Windows separator): it would open "
                f"{printable(real.replace(chr(92), '/'))}, another file; rename the folder or file without '\\'")
    folder = os.path.dirname(real)
    if not writing or "?" not in real:
        return None
    log = wal_path(path)
    if "?" in folder:
        return (f"a '?' in its folder {printable(folder)}: DuckDB would write the store's log at "
                f"{printable(log)} (it reads a '?' as the start of URL parameters); choose a folder without '?'")
    # A '?' in the file's own name: its log is beside it, but not at <file>.wal (backend's
    # duckdb_path_problem asks of that name): at a.wal?b.duckdb for a?b.duckdb, where a store of
    # that name was replayed into a?b.duckdb as its log and deleted, its runs lost.
    if duckdb_magic(log):
        return (f"{printable(log)} is a DuckDB database of its own, which DuckDB would read as this store's "
                "write-ahead log (it puts '.wal' before a '?' in the name), and delete; rename that file first")
    owner = wal_owner(path)
    if owner is not None and duckdb_magic(owner) is not None:
        return (f"is the write-ahead log's name of the store {printable(owner)} (DuckDB puts '.wal' before a '?' "
                "in the name: it would take a store here for that store's log, and delete it); choose another name")
    return None


class _TurnTaken(Exception):
    """Another process's writer holds the store (its write lock)."""


def _open(path: str, read_only: bool, timeout_s: float) -> duckdb.DuckDBPyConnection:
    """A connection to ``path``; a read-write one holds the writer lock until ``_close_writer``."""
    problem = duckdb_path_problem(path, missing=_NO_STORE if read_only else None)
    if problem is None:
        problem = rewritten_path_problem(path, writing=not read_only)
    if problem is not None:
        raise StoreError(path or "''", problem)
    real = os.path.realpath(path)  # (the markers and the lock of the file, whatever name it is reached by)
    if read_only:
        _yield_to_writer(real)
    deadline = time.monotonic() + timeout_s
    backoff = _FIRST_BACKOFF_S
    marker = None
    try:
        while True:
            try:
                if not read_only and not _WriterLock.acquire(path):
                    raise _TurnTaken(f"another process holds {write_lock_path(real)}")
                con = None
                try:
                    con = instances.attach(path, read_only=read_only)
                    _check_is_a_file(con, path)
                    _quiet(con)
                except BaseException:
                    if con is not None:  # (a stop signal here left it open: the stop path's own open of
                        with contextlib.suppress(Exception):  # the file, to mark the run failed, was refused)
                            instances.detach(con)
                    if not read_only:
                        _WriterLock.release(path)
                    raise
                return con
            except (duckdb.Error, _TurnTaken) as err:
                if not isinstance(err, _TurnTaken) and not _is_lock_conflict(err):
                    raise _classify(path, err, writing=not read_only) from None
                if time.monotonic() >= deadline:
                    raise StoreBusyError(
                        path, f"locked by another process for over {timeout_s:g}s ({err})".splitlines()[0]
                    ) from None
                wanted = reader_marker(real) if read_only else writer_marker(real)
                if _touch(wanted):  # kept fresh while we wait (a held writer lets go at its next commit)
                    marker = wanted
                time.sleep(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF_S if read_only else _WRITER_MAX_BACKOFF_S)
    finally:
        if marker is not None:
            with contextlib.suppress(OSError):
                os.unlink(marker)


EMPTY_DATABASE = ("no kvtrace store in it yet: an empty DuckDB database (a writer killed while it created the "
                  "store?); `kvtrace replay --db` into it creates the store")


def check_store(con: duckdb.DuckDBPyConnection, path: str) -> int:
    """Raise StoreError unless ``con`` is a kvtrace store of a schema version we read, whole
    (``layout.check_layout``: every table, view and column it declares); return that version."""
    try:
        rows = con.execute(f"SELECT key, value FROM {META_TABLE}").fetchall()
    except duckdb.CatalogException:
        if not fetch_value(con, "SELECT count(*) FROM duckdb_tables() WHERE database_name = current_database()"):
            # what a writer killed (-9) while it created the store leaves: nothing can remove it then
            raise StoreError(path, EMPTY_DATABASE) from None
        raise StoreError(path, f"not a kvtrace store (DuckDB file without a {META_TABLE} table)") from None
    except duckdb.BinderException:
        raise StoreError(path, f"{DAMAGED}: table {META_TABLE} has no key and value columns") from None
    except duckdb.Error as err:
        raise _classify(path, err) from None
    version = meta_version(meta_rows(rows, path), path)
    check_layout(con, path, version)
    return version


@contextlib.contextmanager
def read_connection(path: str | Path, timeout_s: float = DEFAULT_TIMEOUT_S) -> Iterator[duckdb.DuckDBPyConnection]:
    """A read-only connection for one query or a few; closed on exit so writers can proceed."""
    path = str(path)
    con = _open(path, read_only=True, timeout_s=timeout_s)
    try:
        with _named_damage(path):
            version = check_store(con, path)
            with _older_schema(path, version):
                yield con
    finally:
        instances.detach(con)


@contextlib.contextmanager
def _older_schema(path: str, version: int) -> Iterator[None]:
    """A read that names a table or column an older store never had (a version 2 store
    has latency_quantiles, not latency_cdf, and no external query column) is that store's
    version, in one line: ``diff`` and ``export`` of one called it a damaged store."""
    try:
        yield
    except _MISSING_OBJECT as err:
        if version >= SCHEMA_VERSION:
            raise
        text = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise StoreError(path, f"store schema version {version} predates this kvtrace's ({SCHEMA_VERSION}) and "
                               f"lacks what this read needs ({text}); read it with the kvtrace that wrote it, or "
                               "replay its trace into a new store file") from None


@contextlib.contextmanager
def write_connection(path: str | Path, timeout_s: float = DEFAULT_TIMEOUT_S) -> Iterator[duckdb.DuckDBPyConnection]:
    path = str(path)
    con = _open(path, read_only=False, timeout_s=timeout_s)
    try:
        with _named_damage(path):
            yield con
    finally:
        _close_writer(path, con)


def _close_writer(path: str, con: duckdb.DuckDBPyConnection) -> None:
    try:
        instances.detach(con)
    finally:
        _WriterLock.release(path)


# the WAL a held writer lets grow before DuckDB checkpoints (its rows stay in memory until then)
HELD_CHECKPOINT_THRESHOLD = "128MB"


class HeldConnection:
    """One writer connection kept between transactions (see the module docstring).

    ``use()`` yields the connection, opening it when none is held; after the block it is
    closed again when another process waits for the file, or when the block raised.
    ``release()`` closes it (before this process opens the file another way, and at the end).
    """

    def __init__(self, path: str, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.path = path
        self.timeout_s = timeout_s
        self._con: duckdb.DuckDBPyConnection | None = None

    @property
    def held(self) -> bool:
        return self._con is not None

    @contextlib.contextmanager
    def use(self) -> Iterator[duckdb.DuckDBPyConnection]:
        if self._con is None:
            self._con = _open(self.path, read_only=False, timeout_s=self.timeout_s)
            # DuckDB checkpoints whenever the WAL passes 16 MB: every second or two of a replay,
            # each time compressing every table's open row group again (a row group's first
            # rows some 20 times over a long run). Held, the file checkpoints every
            # HELD_CHECKPOINT_THRESHOLD of WAL and when it is let go; commits are as durable
            # (each one's WAL is synced). Commits' CPU ~0.7x (bench/span_path.py).
            self._con.execute(f"SET checkpoint_threshold = '{HELD_CHECKPOINT_THRESHOLD}'")
        ok = False
        try:
            with _named_damage(self.path):
                yield self._con
            ok = True
        finally:
            if not ok or others_waiting(self.path):
                self.release()

    def release(self) -> None:
        con, self._con = self._con, None
        if con is not None:
            _close_writer(self.path, con)  # (DuckDB checkpoints here: the file is whole for whoever opens it next)


def fetch_value(con: duckdb.DuckDBPyConnection, sql: str, params=None) -> Any:
    """The single value of a query that always returns one row (an aggregate)."""
    rows = con.execute(sql, params or []).fetchall()
    return rows[0][0]


def fetch_one(con: duckdb.DuckDBPyConnection, sql: str, params=None) -> tuple | None:
    """First row of a query, with the result fully consumed (DuckDB 2 refuses new work on a
    connection whose previous result is still pending)."""
    rows = con.execute(sql, params or []).fetchall()
    return rows[0] if rows else None
