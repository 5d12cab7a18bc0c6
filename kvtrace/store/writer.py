"""The store writer: runs, bulk span appends, crash-safe flushes.

The writer never keeps the DuckDB file open between flushes (see connection.py): each
flush opens the file, inserts every buffered Arrow table in one transaction through
DuckDB's Arrow scan, commits and closes. A committed flush survives kill -9 (DuckDB's
WAL); what was still buffered in memory is lost. Readers in other processes get the file
between flushes.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import json
import os
import time
from collections.abc import Iterable, Iterator
from itertools import chain, groupby
from operator import itemgetter
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrace.errors import wal_path
from kvtrace.process import signals_held, stop_exception, stop_pending
from kvtrace.store import derived, instances, layout
from kvtrace.store.backend import is_clickhouse, store_to_write_problem
from kvtrace.store.connection import (
    DEFAULT_TIMEOUT_S,
    HeldConnection,
    _is_lock_conflict,
    check_store,
    fetch_one,
    fetch_value,
    open_lock_file,
    others_waiting,
    owns_lock_file,
    read_connection,
    write_connection,
)
from kvtrace.store.errors import COMMITTED_STAYS, StoreBusyError, StoreError, UnknownRunError
from kvtrace.store.liveness import host_name, process_start_token, writer_alive
from kvtrace.store.schema import (
    CURVE_COLUMNS,
    CURVES_DDL,
    FAMILIES,
    FAMILY_OF_NAME,
    LARGEST_NUMBERED_RUN_SQL,
    LEFTOVER_SPANS,
    LEFTOVER_SPANS_SQL,
    META_TABLE,
    NUM_BLOCKS_COLUMN,
    OTHER_TABLE,
    RECORDED_RUNS_DDL,
    RECORDED_RUNS_TABLE,
    RUN_STATUSES,
    RUNS_DDL,
    SCHEMA_VERSION,
    SEQ_COLUMN,
    SPAN_ARROW_SCHEMA,
    STORE_MAGIC,
    created_now,
    family_columns,
    has_block_lists,
    next_run_id,
    otel_traces_view_ddl,
    span_tables_ddl,
)

# Store subclasses of other backends, by module and class name: Store.open imports the one
# a --db form names when it is first needed (a plugin lookup, so this module, which the
# ClickHouse store subclasses, does not import it, and DuckDB users never load chdb).
BACKENDS: dict[str, str] = {"clickhouse": "kvtrace.store.clickhouse.writer:ClickHouseStore"}
DEFAULT_FLUSH_ROWS = 262_144  # fewer, larger DuckDB transactions: ~2x the insert rate of 64k
DEFAULT_FLUSH_INTERVAL_S = 1.0

# Where each appended column must end up; producers may send narrower ints etc.
_ARROW_TYPES = {f.name: f.type for f in SPAN_ARROW_SCHEMA}


# the schema metadata of a buffered table whose seq its caller gave (append_spans(seq=...))
_CALLER_NUMBERED = {b"kvtrace.seq": b"caller"}


# the runs columns a producer describes its run by (``describe_run``), beside its status and results
DESCRIBED_FIELDS = ("name", "created", "trace_source", "config", "behaviours")


def described(fields: dict[str, Any]) -> dict[str, str]:
    """``describe_run``'s fields as stored (JSON fields as text), those given (not None)."""
    unknown = sorted(set(fields) - set(DESCRIBED_FIELDS))
    if unknown:
        raise ValueError(f"describe_run: not a descriptive field: {unknown}")
    return {k: str(_json_or_none(v) if k in ("config", "behaviours") else v)
            for k, v in fields.items() if v is not None}


def _json_or_none(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        json.loads(value)  # must already be JSON text
        return value
    return json.dumps(value, sort_keys=True, default=str)


def _conform(table: pa.Table) -> pa.Table:
    """Check column names against the span schema and cast to its types."""
    unknown = [n for n in table.column_names if n not in _ARROW_TYPES]
    if unknown:
        hint = " (ids are uint64: trace_id_hi, trace_id_lo, span_id, parent_span_id)" if "trace_id" in unknown else ""
        raise ValueError(f"append_spans: columns not in SPAN_ARROW_SCHEMA: {unknown}{hint}")
    for i, name in enumerate(table.column_names):
        want = _ARROW_TYPES[name]
        if table.schema.field(i).type != want:
            table = table.set_column(i, name, table.column(i).cast(want))
    return table


def split_by_family(table: pa.Table) -> list[tuple[str, pa.Table]]:
    """(family table, rows) pairs: each row goes to its name's family table, unless it sets a
    column that table lacks (then to spans_other, which has every column)."""
    names = table.column("name") if "name" in table.column_names else pa.nulls(table.num_rows, pa.string())
    unique = [n for n in names.unique().to_pylist()]
    families = {FAMILY_OF_NAME.get(n, OTHER_TABLE) for n in unique}
    if len(families) == 1 and OTHER_TABLE not in families:
        (fam,) = families
        if set(table.column_names) <= set(family_columns(fam)):  # the exporter's per-family parts
            return [(fam, table)]
    out: list[tuple[str, pa.Table]] = []
    other_masks = []
    for fam in sorted(families):
        if fam == OTHER_TABLE:
            continue
        in_fam = pc.is_in(names, value_set=pa.array(FAMILIES[fam][1]))
        keep = set(family_columns(fam))
        stray = [c for c in table.column_names if c not in keep]
        misfit = None
        for c in stray:
            valid = pc.is_valid(table.column(c))
            misfit = valid if misfit is None else pc.or_(misfit, valid)
        mask = in_fam if misfit is None else pc.and_(in_fam, pc.invert(misfit))
        rows = table.filter(mask) if len(families) > 1 or misfit is not None else table
        if rows.num_rows:
            out.append((fam, rows.select([c for c in rows.column_names if c in keep])))
        if misfit is not None:
            other_masks.append(pc.and_(in_fam, misfit))
    known = pc.is_in(names, value_set=pa.array(list(FAMILY_OF_NAME)))
    other = pc.invert(pc.fill_null(known, False))
    for m in other_masks:
        other = pc.or_(other, m)
    if pc.any(other).as_py():
        out.append((OTHER_TABLE, table.filter(other)))
    return out


def _with_num_blocks(rows: pa.Table) -> pa.Table:
    counts = pa.nulls(rows.num_rows, pa.int32())
    for col in ("block_ids", "block_hashes"):
        if col in rows.column_names:
            counts = pc.coalesce(counts, pc.list_value_length(rows.column(col)).cast(pa.int32()))
    return rows.append_column(NUM_BLOCKS_COLUMN, pc.fill_null(counts, 0))


def _family_inserts(buffer: list[tuple[str, pa.Table]]) -> list[tuple[str, str, pa.Table]]:
    """(family table, run id, rows) per INSERT of a flush: the buffered tables split by
    family, consecutive pieces of one family and run joined into one table of one chunk.

    One INSERT per family costs DuckDB about a quarter less than one per buffered table:
    each INSERT fills and compresses its own row groups, so many small ones each leave a
    partial row group to merge and compress again. And DuckDB's Arrow scan pays per chunk:
    a second's engine batches as one chunk a family commit about a tenth faster. Row order
    in each family table is unchanged.
    """
    pieces: dict[str, list[tuple[str, pa.Table]]] = {}
    for run_id, table in buffer:
        for family, rows in split_by_family(table):
            pieces.setdefault(family, []).append((run_id, rows))
    out = []
    for family in sorted(pieces):
        for run_id, group in groupby(pieces[family], key=itemgetter(0)):
            tables = [rows for _, rows in group]
            table = tables[0] if len(tables) == 1 else pa.concat_tables(tables, promote_options="default")
            table = table.combine_chunks()
            if has_block_lists(family):
                table = _with_num_blocks(table)
            out.append((family, run_id, table))
    return out


def _init_schema(con: duckdb.DuckDBPyConnection, path: str) -> None:
    """Create the schema in a new file; in an existing store, check it is whole first (a
    table or column missing is refused as damage, never re-created empty: a new run would
    reuse the ids of the runs whose records are gone), then add what newer kvtraces added and
    make the views again: unless all of it is there already (``_schema_is_current``)."""
    tables = {r[0] for r in con.execute(
        "SELECT table_name FROM duckdb_tables() WHERE database_name = current_database()").fetchall()}
    if tables and META_TABLE not in tables:
        raise StoreError(path, f"not a kvtrace store (DuckDB file with tables {sorted(tables)[:5]} "
                               f"but no {META_TABLE})")
    if META_TABLE in tables:
        if "spans" in tables:  # a pre-release layout: one spans table instead of families
            raise StoreError(path, "store written by an older kvtrace layout (spans table); re-create it")
        version = check_store(con, path)  # (and every table, view and column there)
        if version < SCHEMA_VERSION:  # appending needs this version's tables (v2: integer ids)
            raise StoreError(path, f"store schema version {version} predates this kvtrace's ({SCHEMA_VERSION}); "
                                   "cannot append to it: write to a new store file")
        if _schema_is_current(con):
            return  # (all the statements below would make is there: the usual open of a store)
    con.execute("BEGIN")
    con.execute(f"CREATE TABLE IF NOT EXISTS {META_TABLE} (key VARCHAR PRIMARY KEY, value VARCHAR)")
    con.execute(
        f"INSERT OR IGNORE INTO {META_TABLE} VALUES ('magic', ?), ('schema_version', ?)",
        [STORE_MAGIC, str(SCHEMA_VERSION)],
    )
    for stmt in chain.from_iterable(_schema_ddl()):
        con.execute(stmt)
    for view in _VIEWS:
        con.execute(f"COMMENT ON VIEW {view} IS '{_schema_stamp()}'")
    if not tables:  # (a new store: every run's rows built by today's definitions; see read._sql.derived_status)
        con.execute(f"INSERT OR IGNORE INTO {META_TABLE} VALUES (?, ?)",
                    [derived.DERIVED_VERSION_KEY, str(derived.DERIVED_VERSION)])
    con.execute("COMMIT")


# The views of a store, each stamped (its DuckDB comment) with the digest of the DDL that made
# them: a writer's open re-creates the views only where a stamp differs (made by another
# kvtrace, which replaces every view it opens and so drops the stamps, or by hand), instead of
# at every open (35 ms of the 60 an open of an existing store took: binding the views' unions).
_VIEWS = tuple(name for name, rel in layout.expected(SCHEMA_VERSION).items() if rel.kind == layout.VIEW)
_ADDED_COLUMNS = tuple(f"{table}.{col}" for table, cols in layout.ADDED_COLUMNS.items() for col in cols)


@functools.cache
def _schema_ddl() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The writer's DDL after the meta table: (tables and their added columns, views)."""
    spans = span_tables_ddl()
    views = [s for s in spans if s.startswith("CREATE OR REPLACE VIEW")]
    tables = [
        RUNS_DDL,
        "ALTER TABLE runs ADD COLUMN IF NOT EXISTS time_offset_ns BIGINT DEFAULT 0",  # stores before it
        CURVES_DDL,
        RECORDED_RUNS_DDL,  # (stores before it too)
        *(s for s in spans if s not in views),
        *derived.DDL,
        *(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {col} {derived.COLUMNS[table][col]}"  # span_stats of
          for table, columns in derived.ADDED_COLUMNS.items() for col in columns),  # stores before the extent
    ]
    views.append(otel_traces_view_ddl())
    assert len(views) == len(_VIEWS)
    return tuple(tables), tuple(views)


@functools.cache
def _schema_stamp() -> str:
    tables, views = _schema_ddl()
    return "kvtrace schema " + hashlib.sha256("\n".join((*tables, *views)).encode()).hexdigest()[:32]


def _schema_is_current(con: duckdb.DuckDBPyConnection) -> bool:
    """Whether the store open on ``con`` (whole: ``check_store`` passed) holds what
    ``_schema_ddl`` makes: every view stamped by it, and the tables and columns an older
    store may lack (the only ones ``check_store`` lets be missing) there."""
    views, tables, columns = con.execute(
        "SELECT (SELECT count(*) FROM duckdb_views() WHERE database_name = current_database() "
        "AND schema_name = 'main' AND comment = $stamp AND list_contains($views, view_name)), "
        "(SELECT count(*) FROM duckdb_tables() WHERE database_name = current_database() "
        "AND schema_name = 'main' AND list_contains($tables, table_name)), "
        "(SELECT count(*) FROM duckdb_columns() WHERE database_name = current_database() "
        "AND schema_name = 'main' AND list_contains($columns, table_name || '.' || column_name))",
        {"stamp": _schema_stamp(), "views": list(_VIEWS), "tables": sorted(layout.ADDED_TABLES),
         "columns": list(_ADDED_COLUMNS)}).fetchone() or (0, 0, 0)
    return (views, tables, columns) == (len(_VIEWS), len(layout.ADDED_TABLES), len(_ADDED_COLUMNS))


def creation_lock_path(path: str) -> str:
    return f"{path}.creating"


@contextlib.contextmanager
def _creation_lock(path: str) -> Iterator[bool]:
    """Held while this process creates the store at ``path``, so that writers starting on one
    new store create it one at a time (the next finds it made). DuckDB creating a file it
    found missing writes a new database's header over whatever another process made there
    meanwhile: of two replays starting on one new store, the second wiped the first's store
    and run r1, made its own r1, and the first wrote on into it (one r1, every seq twice); or
    it found the first's file still empty and stopped: "not a DuckDB database". The lock
    file (``<db>.creating``) is removed once the store is made; one a kill left, by the
    next writer to open the store (a waiter holding it finds the store made all the same).
    Yields whether the lock is held (False where the folder takes no lock file: a name at
    the length limit; created unguarded, as before)."""
    import fcntl

    lock = creation_lock_path(path)
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW  # (never a link: a symlink there made a file at its target)
    try:
        fd, made = open_lock_file(lock, flags, CREATION_LOCK_TEXT)
    except OSError:
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        if owns_lock_file(fd, lock, CREATION_LOCK_TEXT, made):
            with contextlib.suppress(OSError):
                os.unlink(lock)  # (a writer waiting on it finds the store made, or makes it, when it gets the lock)
        os.close(fd)


# What a creation lock file holds: a file of that name without it is the user's, never removed
# (``connection.owns_lock_file``)
CREATION_LOCK_TEXT = b"kvtrace: the creation lock of this DuckDB store (removed when the store is made)\n"


def _remove_stale_creation_lock(path: str) -> None:
    """Remove the ``<db>.creating`` a creation killed with -9 left: a lock file (its text) no
    process holds. Another file of that name (the user's, a link) stays, and so does the lock
    of a creation still running (it removed a file the user kept there, whatever it held)."""
    import fcntl

    lock = creation_lock_path(path)
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        if not owns_lock_file(fd, lock, CREATION_LOCK_TEXT, False):
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return  # (held: a creation under way)
        with contextlib.suppress(OSError):
            os.unlink(lock)
    finally:
        os.close(fd)


def _remove_failed_creation(path: str) -> bool:
    """Remove the file (and WAL) a failed creation left, unless it holds a store after all
    (another process made one there meanwhile) or another process has it open; whether
    nothing is left."""
    try:
        con = instances.attach(path, read_only=True)
    except duckdb.Error as err:
        if _is_lock_conflict(err):
            return False  # in use: not ours to judge
    else:
        try:
            found = con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = ? "
                                "AND database_name = current_database()", [META_TABLE]).fetchall()
        finally:
            instances.detach(con)
        if found[0][0]:
            return False
    for leftover in (path, wal_path(path)):
        with contextlib.suppress(OSError):
            os.unlink(leftover)
    return not os.path.lexists(path)


def _new_database(path: str) -> bool:
    """Whether DuckDB would make a new database at ``path``: nothing there, or an empty file."""
    try:
        return os.stat(path).st_size == 0
    except FileNotFoundError:
        return True
    except OSError:
        return False  # (what it is, the open says)


def _interrupted(err: BaseException) -> bool:
    """Whether DuckDB stopped a query for a Ctrl-C or SIGTERM (it raises its own error for one)."""
    return isinstance(err, duckdb.InterruptException) or (
        isinstance(err, RuntimeError) and "Query interrupted" in str(err))


@contextlib.contextmanager
def _stops_as_stops() -> Iterator[None]:
    """A query DuckDB interrupted for this command's Ctrl-C or SIGTERM raises the stop itself
    (KeyboardInterrupt, Terminated), as a stop anywhere else does: as DuckDB's RuntimeError
    ("Query interrupted") a finish gave its run up as tried and failed, so a sweep's Ctrl-C
    left the run it was finishing 'running' (incomplete at the next open, its error lost),
    and a replay's stored error read 'RuntimeError: Query interrupted'."""
    try:
        yield
    except Exception as err:
        if _interrupted(err) and stop_pending():
            raise stop_exception() from None
        raise


def _file_identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of the file ``path`` names now; None when there is none."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return (st.st_dev, st.st_ino)


def writer_alive_or_damaged(pid, host, start, path: str, run_id: str) -> bool:
    """``writer_alive``, and True for a run whose writer record is damaged (a pid that is no
    process id): left as it is, listed ``damaged`` by the readers, and no bar to the
    store's other runs (it refused every replay into the store)."""
    try:
        return writer_alive(pid, host, start, db=path, run_id=run_id)
    except StoreError:
        return True


def recover_orphaned_runs(con: duckdb.DuckDBPyConnection, path: str) -> list[str]:
    """Mark runs whose writer died (kill -9, power loss) ``incomplete``; return their ids."""
    rows = con.execute(
        "SELECT run_id, writer_pid, writer_host, writer_start FROM runs WHERE status = 'running'"
    ).fetchall()
    dead = [r[0] for r in rows if not writer_alive_or_damaged(r[1], r[2], r[3], path, r[0])]
    for run_id in dead:
        con.execute("BEGIN")
        derived.materialise(con, run_id)
        con.execute("UPDATE runs SET status = 'incomplete' WHERE run_id = ?", [run_id])
        con.execute("COMMIT")
    return dead


class Store:
    """Writer handle on one store file. Not thread-safe; one per producing process.

    ``flush_rows``/``flush_interval_s``: a flush happens when this many rows are buffered
    or this long has passed since the last flush (checked on append). ``lock_timeout_s``:
    how long a flush waits for readers to release the file.
    """

    def __init__(self, path: str | Path, *, flush_rows: int, flush_interval_s: float, lock_timeout_s: float,
                 hold: bool = False):
        self.path = str(path)
        # hold: keep the connection between flushes (HeldConnection), for a producer that
        # flushes every second until it finishes (a replay); others open one per flush
        self._held = HeldConnection(self.path, lock_timeout_s) if hold else None
        self.flush_rows = flush_rows
        self.flush_interval_s = flush_interval_s
        self.lock_timeout_s = lock_timeout_s
        self._buffer: list[tuple[str, pa.Table]] = []
        self._buffered_rows = 0
        self._last_flush = time.monotonic()
        self._next_seq: dict[str, int] = {}
        self._open_runs: set[str] = set()  # created here and not finished yet
        self._closed = False
        self.recovered_runs: list[str] = []
        # the file this store was opened on ((st_dev, st_ino), once set up): a path removed or
        # replaced while a replay wrote it had the held connection commit into the unlinked file
        # and the run's finish mark another store's run of the same id complete (see _same_file)
        self._file: tuple[int, int] | None = None
        self._file_path = self.path  # (what _file identifies: a chdb store's directory)
        # the writer record (pid, host, start token) each run created here was given: a file
        # overwritten in place (``cp other.duckdb`` onto it, or a second writer creating the
        # store anew over it) keeps its inode, so _same_file sees nothing, and this process's
        # spans and finish went into that store's run of the same id (see _check_owned)
        self._owners: dict[str, tuple[int, str, str | None]] = {}

    # -- lifecycle -------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        path: str | Path,
        *,
        flush_rows: int = DEFAULT_FLUSH_ROWS,
        flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
        lock_timeout_s: float = DEFAULT_TIMEOUT_S,
        hold: bool = False,
    ) -> Store:
        """Create or open a store; mark runs left ``running`` by dead writers ``incomplete``.

        ``hold``: keep the file open between flushes, letting go whenever another process
        waits for it (a replay's store: a second's open and checkpoint saved per flush; a
        ClickHouse store has nothing to hold)."""
        if cls is Store and is_clickhouse(path):  # chdb:PATH or clickhouse://...
            module, _, name = BACKENDS["clickhouse"].partition(":")
            backend: type[Store] = getattr(importlib.import_module(module), name)
            return backend.open(path, flush_rows=flush_rows, flush_interval_s=flush_interval_s,
                                               lock_timeout_s=lock_timeout_s)
        store = cls(path, flush_rows=flush_rows, flush_interval_s=flush_interval_s, lock_timeout_s=lock_timeout_s,
                    hold=hold)
        store._setup()
        return store

    def _setup(self) -> None:
        """Create the schema (or check it) and recover runs left by dead writers."""
        problem = store_to_write_problem(self.path)  # (a name too long, a FIFO, a missing folder)
        if problem is not None:
            raise StoreError(self.path or "''", problem)
        wal = wal_path(self.path)
        if os.path.islink(wal) or (os.path.lexists(wal) and not os.path.isfile(wal)):
            # (DuckDB writes its log through a link, into the file it names, and deletes the link at its
            # checkpoint: a link to a user's file beside a store had the file overwritten with the log)
            what = ("a symbolic link, where DuckDB keeps this store's log (it would write through the link, then "
                    "delete it)" if os.path.islink(wal) else "not a file, where DuckDB keeps this store's log")
            raise StoreError(self.path, f"{wal} is {what}; move it away or remove it first")
        if os.path.lexists(wal) and _new_database(self.path):
            # (DuckDB takes it for the new database's log, finds it belongs to none, and deletes it:
            # a file of the user's there was lost without a word)
            raise StoreError(self.path, f"{wal} exists with no database beside it, and DuckDB would delete it as "
                                        "this new store's log; move it away or remove it first")
        creating = not os.path.lexists(self.path) and not os.path.lexists(wal)
        if not creating:  # (the lock file of a creation killed with -9, if any)
            _remove_stale_creation_lock(self.path)
        with _creation_lock(self.path) if creating else contextlib.nullcontext(True):
            # (another writer may have made it while this one waited for the lock)
            creating = creating and not os.path.lexists(self.path) and not os.path.lexists(wal)
            self._create_or_open(creating)

    def _create_or_open(self, creating: bool) -> None:
        try:
            with self._connect() as con:
                _init_schema(con, self.path)
                self.recovered_runs = recover_orphaned_runs(con, self.path)
            self._file = _file_identity(self.path)
        except StoreBusyError:
            raise  # another process made the file and holds it: not ours to remove
        except BaseException as err:
            # A store this open was creating and could not finish (a full disk, a read-only
            # directory, Ctrl-C): take the file away again, or every later try would find
            # an empty or half-written file and refuse it as not a DuckDB database.
            if not creating or not _remove_failed_creation(self.path):
                raise
            if isinstance(err, StoreError) and err.what.endswith(COMMITTED_STAYS):
                what = err.what.removesuffix(COMMITTED_STAYS)
                raise StoreError(self.path, f"{what}(nothing was kept: the new file is removed)") from None
            raise

    @contextlib.contextmanager
    def _connect(self) -> Iterator[duckdb.DuckDBPyConnection]:
        self.release()  # (one process cannot open the file twice)
        self._same_file()  # (before: opening a removed path would create an empty database there)
        with write_connection(self.path, timeout_s=self.lock_timeout_s) as con:
            self._same_file()  # (and after: replaced between the check and the open)
            yield con

    @contextlib.contextmanager
    def _read(self) -> Iterator[duckdb.DuckDBPyConnection]:
        self.release()
        self._same_file()
        with read_connection(self.path, timeout_s=self.lock_timeout_s) as con:
            self._same_file()
            yield con

    def _same_file(self) -> None:
        """Raise StoreError unless the path still names the file this store was opened on:
        one removed, or replaced by another file (a copy, another store renamed over it), while
        this process wrote it is never written again: a held connection committed into the
        unlinked file, and a finish opened the replacement and marked its run of the same id."""
        if self._file is None:
            return
        now = _file_identity(self._file_path)
        if now == self._file:
            return
        runs = f" (run {', '.join(sorted(self._open_runs))})" if self._open_runs else ""
        what = "removed (or renamed)" if now is None else "replaced by another file"
        raise StoreError(self.path, f"was {what} while this process wrote to it{runs}; nothing more is written "
                                    "to that path, and the spans written since it was opened are not in it")

    def release(self) -> None:
        """Close a held connection (DuckDB checkpoints then): the file is free and whole for other
        processes at once, not at the next flush. The next flush opens it again."""
        if self._held is not None:
            self._held.release()

    def close(self) -> None:
        """Flush, and mark runs created here but never finished ``incomplete``."""
        if self._closed:
            return
        try:
            self.flush()
            for run_id in sorted(self._open_runs):
                self.finish_run(run_id, status="incomplete")
        finally:
            self.release()
            self._closed = True

    def __enter__(self) -> Store:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        # Ctrl-C or an error mid-run: keep every span we hold, then mark our runs failed.
        try:
            self.flush()
            for run_id in sorted(self._open_runs):
                self.finish_run(run_id, status="failed", summary={"error": f"{exc_type.__name__}: {exc}"})
        finally:
            self.release()
            self._closed = True

    # -- runs ------------------------------------------------------------------------
    def create_run(
        self,
        name: str,
        *,
        created: str | None = None,
        trace_source: str | None = None,
        trace_digest: str | None = None,
        config: Any = None,
        behaviours: Any = None,
        mode: str | None = None,
        run_id: str | None = None,
        time_offset_ns: int | None = None,
    ) -> str:
        """Register a run (status ``running``) and return its id (default ``r<N>``).

        ``created`` is the caller's timestamp (ISO 8601); when omitted the current UTC time
        is stored (the store is not part of the deterministic digest).
        ``config``/``behaviours``: JSON text or JSON-serialisable values.
        ``time_offset_ns``: what span times are shifted by where they are stored (see
        ``schema.RUN_COLUMNS``); a DuckDB store keeps 0, a ClickHouse one defaults to the
        current wall clock (whole seconds).
        """
        if created is None:
            created = created_now()
        if time_offset_ns is not None and time_offset_ns != 0:
            raise ValueError("create_run: a DuckDB store keeps virtual times as they are (time_offset_ns 0)")
        with self._connect() as con:
            leftover = LEFTOVER_SPANS_SQL.format(id="$id")
            if run_id is None:
                largest = fetch_one(con, LARGEST_NUMBERED_RUN_SQL.format(matches="run_id SIMILAR TO 'r[0-9]+'"))
                run_id = next_run_id(largest[0] if largest else None)
                while fetch_one(con, leftover, {"id": run_id}):  # (never another run's spans)
                    run_id = next_run_id(run_id)
            elif fetch_one(con, "SELECT 1 FROM runs WHERE run_id = ?", [run_id]):
                raise StoreError(self.path, f"run id {run_id!r} already exists")
            elif fetch_one(con, leftover, {"id": run_id}):
                raise StoreError(self.path, f"run id {run_id!r}: {LEFTOVER_SPANS}")
            pid = os.getpid()
            con.execute(
                "INSERT INTO runs (run_id, name, created, trace_source, trace_digest, config, behaviours, mode,"
                " status, writer_pid, writer_host, writer_start, time_offset_ns)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'running', ?, ?, ?, 0)",
                [run_id, name, created, trace_source, trace_digest, _json_or_none(config),
                 _json_or_none(behaviours), mode, pid, host_name(), process_start_token(pid)],
            )
            # before the commit: an interrupt from here on finds the run ours to mark failed (it
            # found a committed run nobody marked: incomplete at the next open); marking a run
            # whose row an interrupt kept from committing updates nothing
            self._open_runs.add(run_id)
            self._owners[run_id] = (pid, host_name(), process_start_token(pid))
        self._next_seq[run_id] = 0
        return run_id

    def _check_owned(self, con: duckdb.DuckDBPyConnection, run_ids: Iterable[str]) -> None:
        """Raise StoreError unless each run this process created and writes still has its
        writer record here: in a file overwritten in place (same inode) the run of that id is
        another writer's, or gone, and is never written into."""
        mine = sorted(set(run_ids) & self._open_runs)
        if not mine:
            return
        # (one query for all of them: a collector's flush of 50 runs spent 50 ms asking run by run)
        found = {r[0]: tuple(r[1:]) for r in con.execute(
            "SELECT run_id, writer_pid, writer_host, writer_start FROM runs WHERE list_contains(?, run_id)",
            [mine]).fetchall()}
        for run_id in mine:
            row = found.get(run_id)
            if row is not None and row == self._owners.get(run_id, row):
                continue
            whose = "is gone from it" if row is None else f"is another writer's (pid {row[0]})"
            raise StoreError(self.path, f"was overwritten while this process wrote to it (run {run_id} {whose}: "
                                        "the file copied over, or created anew by another writer); nothing more is "
                                        "written to it, and the spans written since it was opened are not in it")

    def describe_run(self, run_id: str, **fields: Any) -> None:
        """Set a run's descriptive fields its producer sent later (a collector's run, from the
        ``kvtrace.run`` record: any of DESCRIBED_FIELDS; None keeps the stored value)."""
        given = described(fields)
        if not given:
            return
        with self._connect() as con:
            if not fetch_one(con, "SELECT 1 FROM runs WHERE run_id = ?", [run_id]):
                raise UnknownRunError(self.path, run_id)
            con.execute(f"UPDATE runs SET {', '.join(f'{k} = ?' for k in given)} WHERE run_id = ?",
                        [*given.values(), run_id])

    def record_curve(self, curve_id: str, points: list[dict[str, Any]]) -> None:
        """Store a capacity curve's points (``CURVE_COLUMNS`` keys), replacing any earlier
        recording of the same curve id."""
        arrow = {"VARCHAR": pa.string(), "BIGINT": pa.int64()}
        schema = pa.schema([(c, arrow[kind]) for c, kind in CURVE_COLUMNS.items()])
        table = pa.Table.from_pylist([{c: p.get(c) for c in CURVE_COLUMNS} for p in points], schema=schema)
        with self._connect() as con:
            con.execute(CURVES_DDL)  # a store created before curves existed
            con.execute("BEGIN")
            con.execute("DELETE FROM curves WHERE curve_id = ?", [curve_id])
            con.register("curve_points", table)
            con.execute(f"INSERT INTO curves SELECT {', '.join(CURVE_COLUMNS)} FROM curve_points")
            con.unregister("curve_points")
            con.execute("COMMIT")

    def finish_run(
        self,
        run_id: str,
        status: str = "complete",
        digest: str | None = None,
        summary: Any = None,
        trace_digest: str | None = None,
        *,
        recorded: bool = False,
    ) -> None:
        """Flush, build the run's derived tables, and set its final status/digest/summary
        (and ``trace_digest``, when the replay found out what it replayed: a ``--limit`` that
        cut nothing). ``recorded``: a collected run its sender's ``kvtrace.run`` record
        finishes, marked so with the finish (``RECORDED_RUNS_TABLE``): a collector started
        later on the store lets no second record finish it again."""
        if status not in RUN_STATUSES or status == "running":
            raise ValueError(f"finish_run: status must be one of complete|failed|incomplete, not {status!r}")
        self.flush()
        try:
            with _stops_as_stops():
                self._finish(run_id, status, digest, _json_or_none(summary), trace_digest, recorded)
        except Exception:  # tried once: close() does not try it again (it would fail the same way)
            self._open_runs.discard(run_id)
            raise
        # (an interrupt inside leaves the run open: the Ctrl-C/SIGTERM path marks it failed, where
        # it stayed running, then incomplete at the next open)
        self._open_runs.discard(run_id)

    def refresh_run(self, run_id: str) -> None:
        """Rebuild a run's derived tables, its status, digest and summary kept: for spans
        that came after it was finished (a collector's late arrivals)."""
        self.flush()
        self._finish(run_id, None, None, None)

    def _finish(self, run_id: str, status: str | None, digest: str | None, summary: str | None,
                trace_digest: str | None = None, recorded: bool = False) -> None:
        # Derived tables are computed on a read-only connection (other readers carry on) and
        # then written in one short read-write transaction with the status change.
        with self._read() as con:
            if not fetch_one(con, "SELECT 1 FROM runs WHERE run_id = ?", [run_id]):
                raise UnknownRunError(self.path, run_id)
            tables = derived.compute(con, run_id)
        with self._connect() as con:
            con.execute("BEGIN")
            self._check_owned(con, [run_id])
            derived.store(con, run_id, tables)
            con.execute(
                "UPDATE runs SET status = coalesce(?, status), digest = coalesce(?, digest), "
                "summary = coalesce(?, summary), trace_digest = coalesce(?, trace_digest) "
                "WHERE run_id = ?",
                [status, digest, summary, trace_digest, run_id],
            )
            if recorded:  # (in the finish's transaction: never one without the other)
                con.execute(f"INSERT OR IGNORE INTO {RECORDED_RUNS_TABLE} VALUES (?)", [run_id])
            con.execute("COMMIT")

    def time_offset_ns(self, run_id: str) -> int:
        """The offset this store adds to the run's span times (0: DuckDB keeps them as they are)."""
        return 0

    def has_run(self, run_id: str) -> bool:
        """Whether the store holds a run with this id (any status)."""
        with self._read() as con:
            return fetch_one(con, "SELECT 1 FROM runs WHERE run_id = ?", [run_id]) is not None

    def drop_empty_run(self, run_id: str) -> bool:
        """Take back a run this store made and has not finished, if it holds no span (a
        collector's request whose commit failed after its run was made: the run stayed, and
        was finished ``complete`` with no span); whether it did. A run of spans stays."""
        if run_id not in self._open_runs:
            return False
        with self._connect() as con:
            con.execute("BEGIN")
            self._check_owned(con, [run_id])
            if fetch_one(con, "SELECT 1 FROM spans WHERE run_id = ? LIMIT 1", [run_id]):
                con.execute("ROLLBACK")
                return False
            con.execute("DELETE FROM runs WHERE run_id = ?", [run_id])
            con.execute("COMMIT")
        self._forget_run(run_id)
        return True

    def _forget_run(self, run_id: str) -> None:
        self._open_runs.discard(run_id)
        self._owners.pop(run_id, None)
        self._next_seq.pop(run_id, None)

    # -- spans -----------------------------------------------------------------------
    def append_spans(
        self,
        spans: pa.Table | pa.RecordBatch | Iterable[pa.RecordBatch],
        run_id: str | None = None,
        *,
        flush_when_due: bool = True,
        seq: pa.Array | None = None,
    ) -> int:
        """Buffer spans (Arrow, columns from SPAN_ARROW_SCHEMA) for one run; flush when due.

        ``run_id`` may be omitted when the table has a single-valued ``run_id`` column.
        ``flush_when_due=False`` only buffers (a caller appending several parts of one batch
        then calls ``flush_if_due``). ``seq``: the rows' seq numbers, one per row, none null,
        given by the caller (a collector keeping its sender's numbering, ``kvtrace.seq``);
        else they are numbered on from the run's last, past every number given before (a
        number given is not taken back by ``discard_buffer``: a gap, never a number twice).
        Returns the number of rows accepted.
        """
        if isinstance(spans, pa.RecordBatch):
            table = pa.Table.from_batches([spans])
        elif isinstance(spans, pa.Table):
            table = spans
        else:
            table = pa.Table.from_batches(list(spans))
        if table.num_rows == 0:
            return 0
        if "run_id" in table.column_names:
            ids = table.column("run_id").unique().to_pylist()
            if len(ids) != 1 or (run_id is not None and ids[0] != run_id):
                raise ValueError(f"append_spans: one run per call, got run_id values {ids[:5]}")
            run_id = ids[0]
            table = table.drop_columns(["run_id"])
        if run_id is None:
            raise ValueError("append_spans: pass run_id or a run_id column")
        # one chunk: pyarrow's kernels and DuckDB's Arrow scan pay per chunk (a table of 2,000
        # one-row chunks took 1.3 s to split and commit, 0.1 s as one)
        table = _conform(table).combine_chunks()
        n = table.num_rows
        if seq is not None:
            seq = seq.cast(pa.int64())
            if len(seq) != n or seq.null_count:
                raise ValueError(f"append_spans: seq must give each of the {n} rows a number, got {len(seq)} "
                                 f"({seq.null_count} null)")
            start = self._next_seq.get(run_id)  # (an append the store numbers goes on past every number given)
            self._next_seq[run_id] = max(self._resume_seq(run_id) if start is None else start, pc.max(seq).as_py() + 1)
            table = table.append_column(SEQ_COLUMN, seq).replace_schema_metadata(_CALLER_NUMBERED)
            self._buffer.append((run_id, table))
            self._buffered_rows += n
            if flush_when_due:
                self.flush_if_due()
            return n
        start = self._next_seq.get(run_id)
        if start is None:
            start = self._resume_seq(run_id)
        # (the buffer of a numpy range: no polars import on the write path, 0.2 s a process)
        numbers = pa.Array.from_buffers(pa.int64(), n,
                                        [None, pa.py_buffer(np.arange(start, start + n, dtype=np.int64))])
        table = table.append_column(SEQ_COLUMN, numbers)
        self._next_seq[run_id] = start + n
        self._buffer.append((run_id, table))
        self._buffered_rows += n
        if flush_when_due:
            self.flush_if_due()
        return n

    def flush_if_due(self) -> int:
        """Flush when ``flush_rows`` are buffered or ``flush_interval_s`` has passed."""
        if self._buffered_rows >= self.flush_rows or time.monotonic() - self._last_flush >= self.flush_interval_s:
            return self.flush()
        return 0

    def flush_when_idle(self) -> bool:
        """For a producer's quiet moments (a replay's export thread between two hand-overs):
        commit what is buffered once ``flush_interval_s`` has passed, as an append would, so
        the commit is not put off to the next append (seconds later where an engine's steps
        are slow: a kill -9 lost them all), and let a held file go to a reader or writer that
        waits for it (it waited for the next hand-over's commit: `kvtrace runs` took 7.6 s
        beside a dense-attention replay). True while there is still something to do (rows
        wait, or the file is held), False once there is none."""
        if self._buffer:
            self.flush_if_due()
        elif self._held is not None and self._held.held and others_waiting(self.path):
            self._held.release()
        return bool(self._buffer) or (self._held is not None and self._held.held)

    def _resume_seq(self, run_id: str) -> int:
        with self._connect() as con:
            row = fetch_one(con, "SELECT status FROM runs WHERE run_id = ?", [run_id])
            if row is None:
                raise UnknownRunError(self.path, run_id)
            return int(fetch_value(con, "SELECT coalesce(max(seq) + 1, 0) FROM spans WHERE run_id = ?", [run_id]))

    def discard_buffer(self) -> int:
        """Drop the spans appended since the last flush (a producer whose commit failed and
        that told its client so); their seq numbers are given out again, so the run's seq
        stays contiguous. Returns the rows dropped."""
        for run_id, table in self._buffer:
            if table.schema.metadata != _CALLER_NUMBERED:  # (numbered by its caller: no count of ours to restore)
                self._next_seq[run_id] -= table.num_rows
        dropped, self._buffer, self._buffered_rows = self._buffered_rows, [], 0
        return dropped

    def flush(self) -> int:
        """Commit every buffered span in one transaction; return rows written."""
        if not self._buffer:
            self._last_flush = time.monotonic()
            return 0
        inserts, rows = _family_inserts(self._buffer), self._buffered_rows
        with _stops_as_stops():
            self._commit(inserts)  # (it empties the buffer with the commit, as one step no signal cuts)
        self._last_flush = time.monotonic()
        return rows

    def _commit(self, inserts: list[tuple[str, str, pa.Table]]) -> None:
        """Write (family table, run id, rows) inserts in one transaction."""
        if self._held is not None:
            self._same_file()  # (a held connection's file may have been removed or replaced since)
        with self._connect() if self._held is None else self._held.use() as con:
            if self._held is not None:
                self._same_file()  # (one opened here: replaced between the check and the open)
            # One DuckDB thread: it appends the chunks of each INSERT in order into one row-group
            # collection. With two, each thread builds its own small collections that the
            # insert then merges (a second copy of every row), and the producer loses its core.
            con.execute("SET threads = 1")
            con.execute("BEGIN")
            self._check_owned(con, (run_id for _, run_id, _ in inserts))
            for family, run_id, table in inserts:
                con.register("kvtrace_append", table)
                con.execute(
                    f"INSERT INTO {family} BY NAME SELECT *, $run_id AS run_id FROM kvtrace_append", {"run_id": run_id}
                )
                con.unregister("kvtrace_append")
            # committed and forgotten together: an interrupt after the COMMIT (as the connection
            # closes, DuckDB checkpointing) had the interrupt's own flush commit every row again
            with signals_held():
                con.execute("COMMIT")
                self._buffer, self._buffered_rows = [], 0
