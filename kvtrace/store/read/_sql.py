"""The read API's one road to the database: open it, check the run, resolve the time
window, choose each derived table's relation, and run SQL through ``query``.

``query`` is the only function that executes SQL: it takes the open database, the SQL
text and its named parameters, and returns a polars frame; ``connect`` is the only one
that opens the database. Everything else in the package builds SQL text and hands it
here. The database is DuckDB or ClickHouse (``kvtrace.store.backend``: ``chdb:PATH``,
``clickhouse://...``); the SQL is DuckDB's spelling either way, and on ClickHouse
``query`` hands it to ``kvtrace.store.dialect``, which rewrites what ClickHouse says
differently.

Values reach SQL only as bound parameters (``$name``): run ids, hashes, request ids,
windows, limits, group ids, top-N, bin counts, and the seq numbers read back from the
store. DuckDB accepts a parameter everywhere the package needs one, LIMIT included. The
SQL text itself is assembled only from the package's own constants: span names, table
and column names, and the counter expressions of ``kvtrace.metrics``.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

import duckdb
import polars as pl

from kvtrace.names import cut_middle
from kvtrace.store import derived
from kvtrace.store.backend import is_clickhouse
from kvtrace.store.connection import read_connection
from kvtrace.store.errors import DAMAGED, StoreError, UnknownRunError
from kvtrace.store.liveness import checked_status
from kvtrace.store.read._api import BadArgument, checked
from kvtrace.store.schema import META_TABLE, SPAN_EVICT, SPAN_REQUEST

DB = str | Path
if TYPE_CHECKING:
    from kvtrace.store.clickhouse.client import ClickHouseConnection
Connection: TypeAlias = "duckdb.DuckDBPyConnection | ClickHouseConnection"
DEFAULT_WINDOWS = 200  # windows over a run when the caller gives no window_ns


class _NoWindow(enum.Enum):
    NO_WINDOW = "no window"


# ``with_run(..., window_ns=NO_WINDOW)``: the query has no time window, so none is
# resolved (no scan of the run's time extent) and no ``$w`` is bound.
NO_WINDOW = _NoWindow.NO_WINDOW
Window = int | None | Literal[_NoWindow.NO_WINDOW]


def tidy(frame: pl.DataFrame) -> pl.DataFrame:
    """DuckDB sums BIGINTs into HUGEINT (polars Decimal(38, 0)); hand back plain Int64."""
    casts = [
        pl.col(name).cast(pl.Int64)
        for name, dtype in frame.schema.items()
        if isinstance(dtype, pl.Decimal) and dtype.scale == 0
    ]
    return frame.with_columns(casts) if casts else frame


def query(con: Connection, sql: str, params: Mapping[str, Any] | None = None) -> pl.DataFrame:
    """Run ``sql`` on the open database ``con`` with ``params`` bound to its ``$name``
    placeholders (DuckDB refuses a parameter the SQL does not name) and return the whole
    result as a polars frame, HUGEINT sums cast back to Int64."""
    if not isinstance(con, duckdb.DuckDBPyConnection):
        return con.frame(sql, params)  # ClickHouse: translated by kvtrace.store.dialect
    return tidy(con.sql(sql, params=dict(params) if params else None).pl())


def run_status(con: Connection, db: DB, run_id: str, derived: bool = False) -> str:
    """The stored status of ``run_id`` (running | complete | failed | incomplete); with
    ``derived``, for a caller about to read its derived tables, a finished run's derived rows
    checked by ``check_derived``. Raises UnknownRunError naming the file when the store has
    no such run."""
    found = query(con, "SELECT status, mode FROM runs WHERE run_id = $run_id", {"run_id": run_id})
    if found.height == 0:
        raise UnknownRunError(str(db), run_id)
    status = checked_status(found["status"][0], db=str(db), run_id=run_id)
    if derived and status != "running":
        check_derived(con, db, run_id, status, collected=found["mode"][0] == "otlp")
    return status


# A finished run's derived rows as finish_run writes them: span_stats has a row per span name
# of the run (count >= 1, blocks >= 0, never NULL: num_blocks is filled with 0), and the
# tables built from its request and evict spans have rows where span_stats counts such spans;
# their counts, times and percentiles are never NULL (summed, a NULL gave a smaller count).
_NULLS = {
    "evict_counts": "evict_ns IS NULL OR blocks IS NULL OR blocks < 1",
    "latency_cdf": "metric IS NULL OR q IS NULL OR value_ns IS NULL OR n IS NULL OR n < 1",
    "block_values": "metric IS NULL OR x IS NULL OR n IS NULL OR n < 1",
}
_DERIVED_CHECK = f"""
    SELECT count(*) AS names,
           count(*) FILTER (WHERE name IS NULL OR spans IS NULL OR blocks IS NULL OR spans < 1 OR blocks < 0) AS bad,
           coalesce(sum(spans) FILTER (WHERE name = '{SPAN_REQUEST}'), 0) AS requests,
           -- (evicted blocks, not spans: a captured AllBlocksCleared is an evict span naming
           -- none, which gives evicted_blocks and evict_counts no row)
           coalesce(sum(blocks) FILTER (WHERE name = '{SPAN_EVICT}'), 0) AS evictions,
           {", ".join(f"(SELECT count(*) FROM {t} WHERE run_id = $run_id AND ({c})) AS {t}" for t, c in _NULLS.items())}
    FROM span_stats WHERE run_id = $run_id"""


def check_derived(con: Connection, db: DB, run_id: str, status: str, collected: bool = False) -> None:
    """Refuse, as a StoreError naming ``db``, the run and the table, a finished run whose
    derived rows are not what finish_run writes: NULL or negative counts in span_stats (or a
    NULL count, time or percentile in evict_counts, latency_cdf, block_values), or rows
    missing beside its spans (deleted by hand: ``runs`` said 0 spans where ``diff`` said
    1,593, a stopped run's publishes and evictions 0 beside 20,357 evicted blocks by reason,
    and a NULL count was a TypeError). DuckDB only: it writes a run's derived rows in one
    transaction, where ClickHouse rebuilds them by a delete and an insert a reader may fall
    between (and its derived columns hold no NULL). A ``collected`` run (mode otlp) is checked
    for NULLs alone: spans a collector receives after the run's record are stored a moment
    before its derived rows are rebuilt."""
    if not isinstance(con, duckdb.DuckDBPyConnection):
        return
    names, bad, requests, evictions, *nulls = query(con, _DERIVED_CHECK, {"run_id": run_id}).row(0)

    def holds(table: str) -> bool:  # whether ``table`` has a row of the run (found, not counted)
        return bool(query(con, f"SELECT EXISTS (SELECT 1 FROM {table} WHERE run_id = $run_id) AS x",
                          {"run_id": run_id})["x"][0])

    what = None
    nulled = next((t for t, n in zip(_NULLS, nulls) if n), None)
    if bad:
        what = "derived table span_stats holds NULL or negative counts"
    elif nulled is not None:
        what = f"derived table {nulled} holds a NULL or a count below 1"
    elif collected:
        what = None
    elif not names:
        what = "derived table span_stats holds none of its rows, beside its spans" if holds("spans") else None
    elif requests and not holds("latency_cdf"):
        what = "derived table latency_cdf holds none of its rows, beside its request spans"
    elif evictions:
        table = next((t for t in ("evict_counts", "evicted_blocks") if not holds(t)), None)
        what = None if table is None else f"derived table {table} holds none of its rows, beside its evict spans"
    if what is not None:
        raise StoreError(str(db), f"{DAMAGED}: run {run_id} ({status}): {what} (finish_run writes them "
                                  "from the spans; a store edited since?)")


# What a query raises on values no kvtrace run holds (a count near 2^63 written by hand or
# sent to a collector: its sum or difference overflows; polars' cast of such a HUGEINT sum):
# the store's damage, where the read API's SQL and its checked arguments are fixed.
_VALUE_ERRORS = (duckdb.OutOfRangeException, duckdb.ConversionException, pl.exceptions.InvalidOperationError)


# The connection every read of one store shares inside ``one_snapshot``: (db, connection).
_SNAPSHOT: contextvars.ContextVar[tuple[str, Connection] | None] = contextvars.ContextVar("kvtrace_snapshot",
                                                                                          default=None)


@contextlib.contextmanager
def one_snapshot(db: DB) -> Iterator[None]:
    """Every read of ``db`` inside shares one connection, so a figure made of several
    queries reads one committed state of the store: a summary of a running run read its
    requests and hit counters before a writer's commit and its prompt tokens after it
    (``requests`` 93 beside the ``prompt_tokens`` of some 300, where every engine run's
    equal its ``prefix_cache_queries``). A DuckDB writer waits while the connection is open,
    as it waits for any reader. Nested uses share the outer one's connection."""
    pinned = _SNAPSHOT.get()
    if pinned is not None and pinned[0] == str(db):
        yield
        return
    with connect(db) as con:
        token = _SNAPSHOT.set((str(db), con))
        try:
            yield
        finally:
            _SNAPSHOT.reset(token)


@contextlib.contextmanager
def connect(db: DB, run_id: str | None = None) -> Iterator[Connection]:
    """A read-only connection to ``db``: retries while a writer commits, refuses a file
    that is not a kvtrace store, and closes on exit (inside ``one_snapshot``: the one it
    holds, left open). A query that cannot compute what the store holds (an overflow) is a
    StoreError naming ``db`` (and ``run_id``, when given)."""
    pinned = _SNAPSHOT.get()
    if pinned is not None and pinned[0] == str(db):
        opened: contextlib.AbstractContextManager[Connection] = contextlib.nullcontext(pinned[1])
    elif is_clickhouse(db):
        from kvtrace.store.clickhouse.reader import read_connection as clickhouse_read

        opened = clickhouse_read(db)
    else:
        opened = read_connection(db)
    with opened as con:
        try:
            yield con
        except _VALUE_ERRORS as err:
            text = cut_middle(str(err).splitlines()[0] if str(err) else "", 200)  # (not DuckDB's SQL and carets)
            whose = f"run {run_id}'s spans hold" if run_id is not None else "it holds"
            raise StoreError(str(db), f"{DAMAGED}: {whose} values no kvtrace run holds, which a read cannot "
                                      f"compute ({type(err).__name__}: {text})") from None


@contextlib.contextmanager
def open_run(db: DB, run_id: str, derived: bool = False) -> Iterator[tuple[Connection, str]]:
    """``connect(db)`` and the stored status of ``run_id``, checked to exist (``derived``:
    as ``run_status``)."""
    with connect(db, run_id) as con:
        yield con, run_status(con, db, run_id, derived)


@checked  # (public: NaN, a list or a negative span was a raw error or a silent 1)
def nice_window(span_ns: int, windows: int = DEFAULT_WINDOWS) -> int:
    """A round window length in ns (1, 2 or 5 times a power of ten) giving at most about
    ``windows`` windows over ``span_ns``: the smallest such length >= span_ns // windows.
    The store's default and the dashboard's (whose ``windows`` follows the request count)
    both come from here."""
    raw = max(1, int(span_ns) // int(windows))
    scale = 1
    while scale * 10 <= raw:
        scale *= 10
    return next(m * scale for m in (1, 2, 5, 10) if m * scale >= raw)


def resolve_window(con: Connection, run_id: str, window_ns: int | None, status: str = "running") -> int:
    """``window_ns`` itself (it must be positive), or, for None, ``nice_window`` over the
    run's time extent (first span start to last span end: kept in span_stats for a
    finished run, ``status`` other than running; scanned for a running one)."""
    if window_ns is not None:
        if window_ns <= 0:
            raise BadArgument("read", "window_ns", f"must be positive, got {window_ns}")
        return int(window_ns)
    lo = hi = None
    if status != "running":  # the extent finish_run kept (NULL in a store from before it)
        with contextlib.suppress(duckdb.Error, StoreError):
            lo, hi = query(con, "SELECT min(start_ns) AS lo, max(end_ns) AS hi FROM span_stats WHERE run_id = $run_id",
                           {"run_id": run_id}).row(0)
    if lo is None or hi is None:
        extent = query(con, "SELECT min(start_ns) AS lo, max(end_ns) AS hi FROM spans WHERE run_id = $run_id",
                       {"run_id": run_id})
        lo, hi = extent.row(0)
    return nice_window(0 if lo is None or hi is None else hi - lo)


def derived_status(con: Connection, status: str) -> str:
    """The status a run's derived rows are read as: its own, or "running" (the rows computed
    from its spans, as a running run's are) where the store's rows were built by older
    definitions (``derived.DERIVED_VERSION``): a store of 2026-12-04 kept evictions paired
    with publishes by seq, and ``diff`` showed 12 evictions before a partial tail where its
    spans have 1. DuckDB and ClickHouse alike. A store records the version when it is made:
    an older one is never rebuilt in place (a rebuild held a big store from every reader for
    half a minute), so its runs, and the runs appended to it since, are read from their spans.
    So are a newer kvtrace's (a version past ours): rows of definitions this one does not know
    were read as its own."""
    if status == "running":
        return status
    meta = query(con, f"SELECT key, value FROM {META_TABLE} WHERE key = $key", {"key": derived.DERIVED_VERSION_KEY})
    return status if derived.built_version(dict(meta.rows())) == derived.DERIVED_VERSION else "running"


def derived_relation(table: str, status: str) -> str:
    """A parenthesised relation holding a derived table's rows of ``$run_id``: the rows
    ``finish_run`` materialised, or, for a running run, the same rows computed from its
    spans on the fly by the SQL ``finish_run`` uses (so both answer alike)."""
    if status == "running":
        return f"({derived.live_sql(table)})"
    return f"(SELECT * FROM {table} WHERE run_id = $run_id)"


def with_run(
    db: DB,
    run_id: str,
    build: str | Callable[[str], str],
    *,
    window_ns: Window = NO_WINDOW,
    params: Mapping[str, Any] | None = None,
) -> pl.DataFrame:
    """Open ``db``, check ``run_id``, and run one query: ``build`` is the SQL, or a
    function of the run's status returning it (for SQL reading a ``derived_relation``).

    Bound: ``$run_id``, then ``params``, then, unless ``window_ns`` is NO_WINDOW, ``$w``:
    the window length from ``resolve_window`` (``window_ns=None`` picks one)."""
    with open_run(db, run_id, derived=not isinstance(build, str)) as (con, status):
        bound = {"run_id": run_id, **(params or {})}
        if window_ns is not NO_WINDOW:
            bound["w"] = resolve_window(con, run_id, window_ns, status)
        return query(con, build if isinstance(build, str) else build(derived_status(con, status)), bound)
