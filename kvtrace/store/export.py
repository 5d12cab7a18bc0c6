"""Parquet export of one run: spans, the run row, and the evicted-block table (the other
derived tables are computed from the spans, by whoever reads them).

Nothing is written until the store and the run have been checked, and the files appear
whole or not at all: each table is written to a hidden file in the output directory and
the three are renamed into place once all of them are written. A failed export removes
what it wrote, and the directories it created.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from kvtrace.errors import read_only_problem
from kvtrace.process import remove_dead_leftovers, signals_held
from kvtrace.store.backend import is_clickhouse
from kvtrace.store.connection import DEFAULT_TIMEOUT_S, fetch_one, read_connection
from kvtrace.store.errors import StoreError, UnknownRunError
from kvtrace.store.layout import added_columns_missing

EXPORTED_TABLES = ("spans", "runs", "evicted_blocks")
# (one span evicts many blocks, and may evict one block's two keys: a total order on every backend)
_ORDER = {"spans": "ORDER BY seq", "evicted_blocks": "ORDER BY evict_seq, group_id, block_id, block_hash"}

# writes one table (its name) to the file given
_Writer = Callable[[str, Path], None]


def export_parquet(db: str | Path, run_id: str, directory: str | Path) -> dict[str, Path]:
    """Write ``<dir>/{spans,runs,evicted_blocks}.parquet`` for ``run_id`` (zstd).

    Spans have the ``spans`` view's columns (run_id, seq, every typed column, ids as
    hex), so ``read_parquet`` gives back exactly what ``spans`` shows for the run, in
    ``seq`` order.
    Returns table name -> file written. Raises StoreError naming the store (not a store,
    no such run) or the output path (empty, not a directory, cannot be written), leaving
    no file or directory of its own behind.
    """
    out_dir = _output_dir(directory)
    _not_the_stores_own(db, out_dir)
    summary = _unfinished_summary(db, run_id)
    if is_clickhouse(db):
        return _export_clickhouse(db, run_id, out_dir, summary)
    with read_connection(db) as con:
        row = fetch_one(con, f"SELECT {_WRITER} FROM runs WHERE run_id = ?", [run_id])
        if row is None:
            raise UnknownRunError(str(db), run_id)
        stored, shown = _statuses(db, run_id, row)
        # a finished run's derived rows as the read API checks them (an evicted_blocks deleted by
        # hand was exported as an empty file, exit 0, beside its evict spans)
        from kvtrace.store.read._sql import derived_status, run_status

        run_status(con, str(db), run_id, derived=True)
        rows_as = derived_status(con, stored)  # (an older store's derived rows: from its spans)

        def write(table: str, target: Path) -> None:
            # (a column a later kvtrace added, missing from a store written before it, is written
            # as the upgraded store holds it: runs.parquet lacked time_offset_ns, another schema)
            added = added_columns_missing(con, table)
            rel = con.sql(_table_sql(table, rows_as, added), params=_params(table, run_id, shown, summary))
            reader = rel.to_arrow_reader(_BATCH_ROWS)  # (streamed: a 10M-span run is never whole in memory)
            _write_canonical(reader.schema, reader, target, _declared(table))

        return _write_all(out_dir, write)


def _export_clickhouse(db: str | Path, run_id: str, out_dir: Path, summary: str | None) -> dict[str, Path]:
    """The same files from a ClickHouse store (its lists are never NULL: ``[]`` there)."""
    from kvtrace.store.clickhouse.reader import read_connection as clickhouse_read

    with clickhouse_read(db) as con:
        found = con.query_arrow(f"SELECT {_WRITER} FROM runs WHERE run_id = $run_id", {"run_id": run_id})
        if found.num_rows == 0:
            raise UnknownRunError(str(db), run_id)
        stored, shown = _statuses(db, run_id, tuple(found.to_pylist()[0].values()))
        from kvtrace.store.read._sql import derived_status

        rows_as = derived_status(con, stored)  # (an older store's derived rows: from its spans)

        def write(table: str, target: Path) -> None:
            params = _params(table, run_id, shown, summary)
            pages = _page_bounds(con, table, run_id, rows_as)
            if pages is None:  # (the run row; a derived table computed on the fly: one query)
                rows = con.query_arrow(_table_sql(table, rows_as), params)
                _write_canonical(rows.schema, rows.to_batches(_BATCH_ROWS), target, _declared(table))
                return
            key = _PAGE_KEY[table]
            first = con.query_arrow(_table_sql(table, rows_as, page=key), {**params, "lo": pages[0][0],
                                                                          "hi": pages[0][1]})

            def batches() -> Iterator[Any]:
                yield from first.to_batches(_BATCH_ROWS)
                for lo, hi in pages[1:]:
                    yield from con.query_arrow(_table_sql(table, rows_as, page=key),
                                               {**params, "lo": lo, "hi": hi}).to_batches(_BATCH_ROWS)

            _write_canonical(first.schema, batches(), target, _declared(table))

        return _write_all(out_dir, write)


# A ClickHouse result is whole in memory (no streaming read): a run's spans and evicted blocks
# are fetched a page at a time, in ranges of their ordering key. One query of the whole run held
# a 40,000-request cache-only run's 198,152 spans as 195 MB of Arrow and 805 MB of the process.
# Spans: pages of _BATCH_ROWS, ranges of seq, the family tables' sort key after run_id (a page
# reads its own rows). Evicted blocks: pages of 16 batches (about 11 MB of Arrow a batch), as
# their table is sorted by run_id alone and each page scans the run's rows for its range (52
# pages of one batch took a 160,000-request run's export from 40 s to 95 s).
_PAGE_KEY = {"spans": "seq", "evicted_blocks": "evict_seq"}
_PAGE_BATCHES = {"spans": 1, "evicted_blocks": 16}


def _page_bounds(con: Any, table: str, run_id: str, rows_as: str) -> list[tuple[int, int]] | None:
    """The ``(lo, hi)`` ranges (inclusive) of ``table``'s key that cut the run's rows into
    pages of ``_PAGE_BATCHES`` batches each (a page ends where its key changes, so a key's
    rows stay together): one query of the key column alone. None where the table is not
    paged (the run row; a derived table computed from the spans: its SQL would run once a
    page); ``[(0, -1)]`` (no row) for a run without rows."""
    from kvtrace.store import derived

    key = _PAGE_KEY.get(table)
    if key is None or (rows_as == "running" and table in derived.TABLES):
        return None
    # (computed where the rows are: the keys of a 10M-span run, one a span, never reach Python)
    found = con.query_arrow(f"""
        SELECT min(k) AS lo, max(k) AS hi FROM (
            SELECT k, (sum(n) OVER (ORDER BY k ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) - n) // $rows AS page
            FROM (SELECT {key} AS k, count(*) AS n FROM {table} WHERE run_id = $run_id GROUP BY {key}) AS keyed
        ) AS paged GROUP BY page ORDER BY lo""", {"run_id": run_id, "rows": _BATCH_ROWS * _PAGE_BATCHES[table]})
    pages = list(zip(found.column("lo").to_pylist(), found.column("hi").to_pylist(), strict=True))
    return pages or [(0, -1)]


def _unfinished_summary(db: str | Path, run_id: str) -> str | None:
    """The summary every reader shows of a run that kept none (running, killed; a failed
    run's error alone), computed from its spans (``read.summary_with_spans``), as JSON; None
    for a finished run, whose stored summary is exported as stored. (runs.parquet held a
    SIGTERM'd run's error where ``runs`` and ``diff`` showed its numbers.)"""
    from kvtrace.store import read

    stored = read.run(str(db), run_id).get("summary")  # (an unknown run: UnknownRunError)
    if read.finished_summary(stored):
        return None
    return json.dumps(read.summary_with_spans(str(db), run_id, stored))


def _params(table: str, run_id: str, status: str, summary: str | None) -> dict[str, Any]:
    return {"run_id": run_id, "status": status, "summary": summary} if table == "runs" else {"run_id": run_id}


_WRITER = "status, writer_pid, writer_host, writer_start"
_BATCH_ROWS = 65_536


# -- one Parquet schema whichever backend wrote the rows ---------------------------------------
# DuckDB's JSON columns arrive as Arrow's arrow.json extension, ClickHouse's as strings; ClickHouse
# marks list items and columns NOT NULL and keeps an absent list as [] (its arrays are never
# NULL), DuckDB as NULL. An export is the same file from either: JSON as strings, every field
# nullable, an empty list NULL (what the DuckDB store holds for a list a span did not set).
def _canonical_type(t: Any) -> Any:
    import pyarrow as pa

    if isinstance(t, pa.ExtensionType):
        return _canonical_type(t.storage_type)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return pa.list_(pa.field(t.value_field.name, _canonical_type(t.value_type)))
    if pa.types.is_map(t):
        return pa.map_(pa.field(t.key_field.name, t.key_type, nullable=False),
                       pa.field(t.item_field.name, _canonical_type(t.item_type)))
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, _canonical_type(f.type)) for f in t])
    return t


def _canonical_column(column: Any, target: Any) -> Any:
    return _emptied(column).cast(target)


def _emptied(column: Any) -> Any:
    """``column`` with its empty lists and maps NULL, at every depth (a link's attributes too)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    t = column.type
    if isinstance(t, pa.ExtensionType):
        return _emptied(column.storage)
    if column.offset and (pa.types.is_struct(t) or pa.types.is_list(t) or pa.types.is_map(t)):
        # a slice (a batch past a table's first): rebuilt from its offsets and values below, which
        # Arrow refuses for a sliced list with nulls (a chdb run's links past its 65,536th span)
        column = pa.concat_arrays([column])
    if pa.types.is_struct(t):
        return pa.StructArray.from_arrays([_emptied(column.field(i)) for i in range(t.num_fields)],
                                          fields=list(t), mask=column.is_null())
    if pa.types.is_list(t) and pa.types.is_struct(t.value_type):
        column = pa.ListArray.from_arrays(column.offsets, _emptied(column.values), type=t, mask=column.is_null())
    if pa.types.is_list(t) or pa.types.is_map(t):
        offsets = column.offsets  # (lengths from them: list_value_length takes no map)
        empty = pc.equal(pc.subtract(offsets[1:], offsets[:-1]), 0)
        if pc.any(empty).as_py():
            column = pc.if_else(empty, pa.nulls(len(column), t), column)
    return column


def _declared(table: str) -> tuple[str, ...] | None:
    """The columns kvtrace declares for an exported table (None: the ``spans`` view's, all
    of them): a column added to a store's table by hand is not exported (it made one store's
    files of another schema than every other's)."""
    from kvtrace.store import derived
    from kvtrace.store.schema import RUN_COLUMNS

    if table == "runs":
        return tuple(name for name, _, _ in RUN_COLUMNS)
    return tuple(derived.COLUMNS[table]) if table in derived.COLUMNS else None


def _write_canonical(schema: Any, batches: Iterable[Any], target: Path,
                     declared: tuple[str, ...] | None = None) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    # in the declared order (a table rebuilt by hand with its columns in another order wrote them so)
    names = list(schema.names)
    kept = list(range(len(names))) if declared is None else [names.index(n) for n in declared if n in names]
    canonical = pa.schema([pa.field(schema[i].name, _canonical_type(schema[i].type)) for i in kept])
    try:
        with pq.ParquetWriter(str(target), canonical, compression="zstd") as out:
            for batch in batches:
                out.write_batch(pa.RecordBatch.from_arrays(
                    [_canonical_column(batch.column(i), f.type) for i, f in zip(kept, canonical, strict=True)],
                    schema=canonical))
    except OSError as err:  # the output's failure (a full disk), not the store's: the OS's reason alone
        raise OSError(_io_reason(err)) from None


def _statuses(db: str | Path, run_id: str, row: tuple) -> tuple[str, str]:
    """(the stored status, the status ``kvtrace runs`` shows: a dead writer's running run is
    ``incomplete``) of a run's ``_WRITER`` row."""
    from kvtrace.store.liveness import shown_status

    stored, pid, host, start = row
    return str(stored), shown_status(str(stored), pid, host, start, db=str(db), run_id=run_id)


def _table_sql(table: str, status: str, added: tuple[str, ...] = (), page: str | None = None) -> str:
    """The SELECT of one exported table's rows of ``$run_id``: the run row with the status
    and summary the readers show (``$status``; ``$summary``, unless NULL); a derived table's
    rows computed from the spans while the run was never finished (a running or killed one:
    ``finish_run`` never materialised them) or older definitions built them
    (``read._sql.derived_status``), as every reader computes them. ``added``: the
    columns a later kvtrace added that the store lacks, selected as their rows hold them once
    the store is upgraded (``layout.ADDED_DEFAULTS``)."""
    from kvtrace.store import derived
    from kvtrace.store.layout import ADDED_DEFAULTS
    from kvtrace.store.schema import RUN_COLUMNS

    types = {name: typ for name, typ, _ in RUN_COLUMNS} if table == "runs" else derived.COLUMNS.get(table, {})
    more = "".join(f", CAST({ADDED_DEFAULTS.get((table, c), 'NULL')} AS {types[c]}) AS {c}" for c in added)
    if table == "runs":
        return (f"SELECT * REPLACE ($status AS status, coalesce($summary, summary) AS summary){more} "
                "FROM runs WHERE run_id = $run_id")
    source = (f"({derived.live_sql(table)})" if status == "running" and table in derived.TABLES else table)
    within = "" if page is None else f" AND {page} BETWEEN $lo AND $hi"
    return f"SELECT *{more} FROM {source} WHERE run_id = $run_id{within} {_ORDER.get(table, '')}"


def _output_dir(directory: str | Path) -> Path:
    """``directory`` as the export's output path, refused (StoreError naming it) when empty
    or when something other than a directory is there; nothing is created here."""
    text = os.fspath(directory)
    if not str(text).strip():
        raise StoreError(repr(text), "expected an output directory path (an empty path would be the current directory)")
    out_dir = Path(text)
    try:
        if out_dir.exists() and not out_dir.is_dir():
            raise StoreError(str(out_dir), "exists and is not a directory; expected an output directory")
        if out_dir.is_symlink() and not out_dir.exists():  # (mkdir said 'File exists' of it)
            raise StoreError(str(out_dir), f"is a symbolic link (to {os.readlink(out_dir)}) that leads to nothing; "
                                           "create the directory it names first, or export elsewhere")
    except OSError as err:  # (exists() passes a name too long, a permission refused: a traceback)
        raise StoreError(str(out_dir), f"cannot use as export directory: {err.strerror or err}") from None
    for table in EXPORTED_TABLES:  # (each is renamed into place: a rename replaced a 0444 file all the same)
        target = out_dir / f"{table}.parquet"
        problem = read_only_problem(target) or _not_parquet(target)
        if problem is not None:
            raise StoreError(str(target), problem)
    return out_dir


def _not_parquet(target: Path) -> str | None:
    """Why a file at ``target`` is not an earlier export's to replace: it holds something
    else than Parquet (a user's notes named spans.parquet were replaced, exit 0), as
    calibrate keeps a file that is not a cost model."""
    try:
        if not stat.S_ISREG(os.stat(target).st_mode):  # (a FIFO's open would wait for a writer)
            return None
        with open(target, "rb") as f:
            head = f.read(4)
    except OSError:
        return None  # (none there; unreadable: the rename says what it can)
    if not head or head == b"PAR1":
        return None
    return "exists and is not a Parquet file (an earlier export's), so it is not replaced; export elsewhere or move it"


def _not_the_stores_own(db: str | Path, out_dir: Path) -> None:
    """StoreError when ``out_dir`` is the store or one of its own files (a DuckDB store's
    write-ahead log, waiting markers or writer lock, anything inside a chdb directory): an export there
    made the store unopenable (a WAL that was a directory; parquet files in chdb's metadata)."""
    from kvtrace.store.backend import clickhouse_target
    from kvtrace.store.connection import side_files

    out = os.path.realpath(out_dir)
    if is_clickhouse(db):
        home = clickhouse_target(db).path
        inside = home is not None and (out == home or out.startswith(home.rstrip(os.sep) + os.sep))
    else:
        store = os.path.realpath(db)
        inside = out in (store, *side_files(store))
    if inside:
        raise StoreError(str(out_dir), f"is the store {db}'s own (its file, log or directory); "
                                       "export somewhere else")


def _write_all(out_dir: Path, write: _Writer) -> dict[str, Path]:
    """Every table through ``write`` into hidden files in ``out_dir``, then renamed into
    place; on any failure (or interrupt) the hidden files and the directories this call
    created are removed, and an OSError becomes a StoreError naming the output path."""
    created = _missing_dirs(out_dir)
    pending: dict[str, Path] = {}
    try:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise StoreError(str(out_dir), f"cannot create export directory: {err.strerror or err}") from None
        with _renaming(out_dir):  # (no other export mid-rename while a dead one's set-aside file goes back)
            _clean_dead_exports(out_dir)
        for table in EXPORTED_TABLES:
            # a name no other export picks (the pid: whose it is, once that one is gone); the
            # writer creates the file, with the usual permissions
            pending[table] = out_dir / f".{table}.{os.getpid()}-{secrets.token_hex(6)}.parquet.tmp"
            write(table, pending[table])
        targets = {table: out_dir / f"{table}.parquet" for table in pending}
        with _renaming(out_dir):
            for target in targets.values():  # (a rename onto a directory fails: found before the first)
                if target.is_dir():
                    raise StoreError(str(target), "is a directory; the export would not replace it")
            with signals_held():  # the three renames are not cut in half by Ctrl-C
                _replace_all({targets[t]: temp for t, temp in pending.items()})
        return targets
    except OSError as err:
        _clean(pending.values(), created)
        raise StoreError(str(out_dir), f"cannot write the export: {err.strerror or err}") from None
    except BaseException:
        _clean(pending.values(), created)
        raise


# an export's hidden files: each new table, and each earlier file ``_replace_all`` set aside
# (``.old``), which an export killed with -9 in its renames left for good when only the
# first kind was known here
# (its 12 hex digits exactly, as ``_write_all`` names it: a user's ".spans.123-abc.parquet.tmp"
# was removed as a dead export's)
_TEMPORARY = re.compile(rf"\.(?:{'|'.join(EXPORTED_TABLES)})\.([0-9]+)-[0-9a-f]{{12}}\.parquet\.tmp(?:\.old)?")


def _put_back_or_remove(path: str) -> None:
    """A dead export's hidden file removed, but an earlier export's file it had set aside
    (``.old``) put back at its own name where nothing stands there: the export was killed
    between setting it aside and renaming its new file in, and removing it lost that file for
    good once the next export failed or was stopped. Put back by a hard link, which never
    replaces a file that took its place meanwhile (then the set-aside one goes)."""
    if not stat.S_ISREG(os.lstat(path).st_mode):  # (kvtrace writes files alone: a link or folder is not its)
        return
    name = os.path.basename(path)
    if name.endswith(".old"):
        target = os.path.join(os.path.dirname(path), f"{name[1:].split('.', 1)[0]}.parquet")
        try:
            os.link(path, target)
        except FileExistsError:
            pass
        except OSError:  # (a file system without hard links: renamed where nothing stands)
            if not os.path.lexists(target):
                os.replace(path, target)
                return
    os.unlink(path)


def _clean_dead_exports(out_dir: Path) -> None:
    """What exports killed with -9 left in ``out_dir``: an export killed in its renames (an
    earlier file of its set aside, ``.old``) wrote every new file before its first rename, so
    its renames are finished, the folder then holds that export whole; any other's hidden files
    go (``_put_back_or_remove``). Putting back the earlier file alone left one run's spans
    beside the other run's record and evicted blocks, three files that looked whole, once the
    next export failed or was stopped."""
    dead: list[str] = []
    remove_dead_leftovers(out_dir, _temporary_pid, remove=dead.append)
    by_pid: dict[int | None, list[str]] = {}
    for path in dead:
        by_pid.setdefault(_temporary_pid(os.path.basename(path)), []).append(path)
    for paths in by_pid.values():
        renaming = any(p.endswith(".old") and _regular(p) for p in paths)
        for path in sorted(paths, key=lambda p: p.endswith(".old")):  # (its new files first)
            with contextlib.suppress(OSError):
                if renaming and not path.endswith(".old") and _regular(path):
                    name = os.path.basename(path)
                    target = os.path.join(os.path.dirname(path), f"{name[1:].split('.', 1)[0]}.parquet")
                    if not os.path.isdir(target):
                        os.replace(path, target)  # (the killed export's rename, finished)
                        continue
                _put_back_or_remove(path)


def _regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _temporary_pid(name: str) -> int | None:
    """The pid of the export whose hidden file ``name`` is (a new table's or an earlier file
    set aside; None: not one)."""
    m = _TEMPORARY.fullmatch(name)
    return int(m.group(1)) if m else None


RENAME_LOCK_TIMEOUT_S = DEFAULT_TIMEOUT_S  # another export's renames take milliseconds


@contextlib.contextmanager
def _renaming(out_dir: Path) -> Iterator[None]:
    """Held while an export renames its files into ``out_dir`` (an exclusive flock on the
    directory): another export's renames wait, so the three files are one run's (two exports
    into one directory interleaved left one run's spans beside another's run row). A folder
    that cannot be opened to lock (write-only to this user) or a file system without flock
    renames unlocked, as before; a lock held past RENAME_LOCK_TIMEOUT_S (a stopped export,
    another program's flock) is one line naming the folder, not a wait without end."""
    import fcntl
    import time

    timeout_s = RENAME_LOCK_TIMEOUT_S
    try:
        fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # (a folder of mode 0300 takes the files but cannot be opened)
        yield
        return
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise StoreError(str(out_dir), f"another process has held its lock for {timeout_s:g} s (a "
                                                   "stopped export?); nothing was replaced") from None
                time.sleep(0.02)
            except OSError:  # (ENOLCK, EOPNOTSUPP: no locks there)
                break
        yield
    finally:
        os.close(fd)  # (the lock goes with it, as with a killed export)


def _replace_all(files: dict[Path, Path]) -> None:
    """Each target replaced by its new file, all or none: an earlier export's files are set
    aside first and put back if a later rename fails (two of three once held the new run,
    the third the old)."""
    done: list[tuple[Path, Path | None]] = []  # (target, its earlier file set aside, or None)
    try:
        for target, new in files.items():
            aside = None
            if os.path.lexists(target):
                aside = new.with_name(new.name + ".old")
                os.replace(target, aside)
            done.append((target, aside))
            os.replace(new, target)
    except BaseException:
        for target, aside in reversed(done):
            with contextlib.suppress(OSError):
                if aside is not None:
                    os.replace(aside, target)
                elif os.path.lexists(target):  # (the new file: there was none before)
                    os.unlink(target)
        raise
    for _, aside in done:
        if aside is not None:
            with contextlib.suppress(OSError):
                os.unlink(aside)


def _missing_dirs(out_dir: Path) -> list[Path]:
    """The directories ``mkdir(parents=True)`` would create for ``out_dir``, deepest first."""
    missing = []
    path = out_dir.absolute()
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _clean(files: Iterable[Path], created: list[Path]) -> None:
    with signals_held():
        for f in files:
            with contextlib.suppress(OSError):
                f.unlink()
        for d in created:  # deepest first; one that someone else has filled meanwhile stays
            with contextlib.suppress(OSError):
                d.rmdir()


def _io_reason(err: Exception) -> str:
    """The operating system's reason in a DuckDB or pyarrow I/O error (``No space left on device``),
    without the JSON DuckDB wraps it in; else the error's first line, without its prefix."""
    text = str(err)
    errno = re.search(r'"errno"\s*:\s*"?(\d+)', text) or re.search(r"\[errno (\d+)\]", text)  # DuckDB's, pyarrow's
    if errno:
        return os.strerror(int(errno.group(1)))
    start = text.find("{")
    if start >= 0:
        with contextlib.suppress(ValueError):
            detail = json.loads(text[start:])
            if isinstance(detail, dict) and detail.get("exception_message"):
                text = str(detail["exception_message"])
    return text.splitlines()[0].removeprefix("IO Error: ") if text else type(err).__name__
