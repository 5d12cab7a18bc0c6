"""``ClickHouseStore``: the store writer on ClickHouse (chdb or a server).

The same lifecycle and buffering as the DuckDB ``Store`` (it is a subclass); what differs
is how a flush, a run row and the derived tables are written:

- a flush inserts each family's Arrow rows by column name, with ``run_id``, the run's
  ``time_offset_ns`` and span/event times shifted by it (the views subtract it);
- ClickHouse has no transactions: a run's derived rows are deleted, then rebuilt
  server-side (``INSERT ... SELECT`` of the SQL the DuckDB store runs), and only then is
  the run's status set, so a crash in between leaves the run ``running`` and recovery
  (``Store.open``) builds them again;
- the runs table is updated with synchronous mutations (it holds one row per run).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from kvtrace.process import signals_held
from kvtrace.store import derived
from kvtrace.store.backend import ClickHouseTarget, clickhouse_target
from kvtrace.store.clickhouse import client, collector
from kvtrace.store.clickhouse.schema import column_type, derived_columns, store_ddl
from kvtrace.store.clickhouse.tables import check_creatable, check_meta, materialise
from kvtrace.store.errors import StoreError, UnknownRunError
from kvtrace.store.liveness import host_name, process_start_token
from kvtrace.store.schema import (
    CURVE_COLUMNS,
    LARGEST_NUMBERED_RUN_SQL,
    LEFTOVER_SPANS,
    LEFTOVER_SPANS_SQL,
    META_TABLE,
    RECORDED_RUNS_TABLE,
    RUN_COLUMNS,
    SCHEMA_VERSION,
    SEQ_COLUMN,
    SHIFTED_COLUMNS,
    SPAN_TABLES,
    STORE_MAGIC,
    TIME_OFFSET_COLUMN,
    named_run_name,
    next_run_id,
)
from kvtrace.store.state import chdb_catalog_state
from kvtrace.store.writer import Store, _file_identity, _json_or_none, described, writer_alive_or_damaged

_RUN_TYPES = {"INTEGER": pa.int32(), "BIGINT": pa.int64()}


def _trim_partial_flush(con: client.ClickHouseConnection, run_id: str) -> None:
    """Drop the spans past a dead writer's first missing seq. A flush is one insert per
    family table, not one transaction: a kill between them kept part of the last batch,
    a gap in seq. What is left is the contiguous prefix a DuckDB store's rollback keeps."""
    params = {"r": run_id}
    found = con.ch_frame("SELECT count() AS n, max(seq) AS last FROM spans WHERE run_id = {r:String}", params)
    if not found["n"][0] or found["last"][0] + 1 == found["n"][0]:  # (seqs are unique: no gap)
        return
    first = con.ch_frame("SELECT min(seq) AS s FROM (SELECT seq, toInt64(row_number() OVER (ORDER BY seq)) - 1 AS i "
                         "FROM spans WHERE run_id = {r:String}) WHERE seq != i", params)["s"][0]
    for table in SPAN_TABLES:
        con.command(f"DELETE FROM {table} WHERE run_id = {{r:String}} AND seq >= {{s:Int64}}",
                    {**params, "s": int(first)})


def _take_back(con: client.ClickHouseConnection, done: list[tuple[str, str, list[int]]]) -> None:
    """The rows a flush that failed part way inserted (family, run id, their seq), deleted again, as
    far as the store lets (best effort: the failure itself is what the caller answers with). A flush
    is one insert per family, no transaction: a failure after the first kept its rows, and the
    sender's retry of the request (a collector answers the failure 503) stored them again, two spans
    at one seq. Not waited for (``lightweight_deletes_sync = 0``): the failure is likely a full disk,
    where a delete waited for never finished, under the signals the flush holds."""
    for family, run_id, seqs in done:
        try:
            con.command(f"DELETE FROM {family} WHERE run_id = {{r:String}} AND has({{s:Array(Int64)}}, seq) "
                        "SETTINGS lightweight_deletes_sync = 0", {"r": run_id, "s": seqs})
        except Exception:
            continue


_CREATING = threading.Lock()


def _give_up_a_shared_id(con: client.ClickHouseConnection, label: str, row: dict[str, Any]) -> None:
    """On a server, another process can take the same id between the read and the insert:
    a run id recorded twice damages the store (``tables._check_unique_runs``). So a writer
    that finds its id taken besides its own record takes its record back and stops (a
    writer that found it alone went on: whichever came first keeps the id)."""
    mine = {"r": row["run_id"], "h": row["writer_host"] or "", "p": row["writer_pid"], "s": row["writer_start"] or ""}
    if con.ch_frame("SELECT count() AS n FROM runs WHERE run_id = {r:String}", {"r": mine["r"]})["n"][0] < 2:
        return
    con.command("DELETE FROM runs WHERE run_id = {r:String} AND ifNull(writer_host, '') = {h:String} "
                "AND writer_pid = {p:Int64} AND ifNull(writer_start, '') = {s:String}", mine)
    raise StoreError(label, f"run id {row['run_id']} was taken by another writer at the same moment "
                            "(nothing of this run is stored); run it again")


# (catalog state, OTel table) of chdb stores this process laid out, as they were then: a
# store opened again with its catalog unchanged needs none of the ~90 statements (about
# 0.4 s on chdb, at every open of a writer)
_LAID_OUT: set[tuple] = set()


def init_schema(con: client.ClickHouseConnection, target: ClickHouseTarget) -> None:
    """kvtrace's tables and views (idempotent), and the collector table's materialised views."""
    version = check_meta(con, target.label)
    if version == SCHEMA_VERSION and (chdb_catalog_state(target), target.otel_table) in _LAID_OUT:
        return
    if version is None:
        check_creatable(con, target.label)
    elif version < SCHEMA_VERSION:
        raise StoreError(target.label, f"store schema version {version} predates this kvtrace's ({SCHEMA_VERSION}); "
                                       "write to a new database")
    for stmt in store_ddl():
        con.command(stmt)
    for table in derived.TABLES:  # a store from before a derived column (span_stats' extent)
        for col, duck in derived_columns(table):
            con.command(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS `{col}` {column_type(col, duck)}")
    if version is None:  # the meta rows last: what a kill before them leaves, the next writer finishes
        con.insert_arrow(META_TABLE, pa.table({"key": ["magic", "schema_version", derived.DERIVED_VERSION_KEY],
                                               "value": [STORE_MAGIC, str(SCHEMA_VERSION),
                                                         str(derived.DERIVED_VERSION)]}))
    collector.attach(con, target)
    state = chdb_catalog_state(target)
    if state is not None:  # (None: a server, whose catalog other clients change unseen)
        if len(_LAID_OUT) >= 256:
            _LAID_OUT.clear()
        _LAID_OUT.add((state, target.otel_table))


def _shift(rows: pa.Table, offset: int) -> pa.Table:
    """Span start/end and event times plus ``offset``."""
    for name in SHIFTED_COLUMNS:
        if name in rows.column_names:
            i = rows.column_names.index(name)
            rows = rows.set_column(i, name, pc.add(rows.column(i), pa.scalar(offset, pa.int64())))
    if "events" in rows.column_names and rows.column("events").null_count < rows.num_rows:
        i = rows.column_names.index("events")
        events = rows.column(i).combine_chunks()
        flat = events.flatten()
        times = pc.add(flat.field("time_ns"), pa.scalar(offset, pa.int64()))
        inner = pa.StructArray.from_arrays([times, flat.field("name"), flat.field("attributes")],
                                           fields=list(flat.type))
        shifted = pa.ListArray.from_arrays(events.offsets, inner, mask=events.is_null())
        rows = rows.set_column(i, "events", shifted)
    return rows


class ClickHouseStore(Store):
    """Writer handle on a ClickHouse kvtrace store (``chdb:PATH`` or ``clickhouse://...``)."""

    def __init__(self, path: Any, *, flush_rows: int, flush_interval_s: float, lock_timeout_s: float,
                 hold: bool = False):
        # (hold: nothing to hold, as a server takes every writer at once)
        self.target = clickhouse_target(path)
        super().__init__(self.target.label, flush_rows=flush_rows, flush_interval_s=flush_interval_s,
                         lock_timeout_s=lock_timeout_s)
        self._offsets: dict[str, int] = {}

    def _connect(self):
        self._same_file()  # (a chdb directory removed or renamed: chdb made a new one there, and failed in its words)
        return client.connect(self.target, self.lock_timeout_s)

    def _setup(self) -> None:
        if self.target.path is not None:
            problem = self.target.write_problem()
            if problem is not None:  # (chdb would fail on it later, with a traceback)
                raise StoreError(self.target.label, problem)
            try:
                os.makedirs(self.target.path, exist_ok=True)
            except OSError as err:
                raise StoreError(self.target.label, f"cannot create the directory: {err.strerror or err}") from None
        with self._connect() as con:
            init_schema(con, self.target)
            collector.register_collected_runs(con)
            self.recovered_runs = self._recover(con)
        if self.target.path is not None:  # (the directory this store writes, watched as a DuckDB file is)
            self._file_path = self.target.path
            self._file = _file_identity(self.target.path)

    def _recover(self, con: client.ClickHouseConnection) -> list[str]:
        frame = con.ch_frame("SELECT run_id, writer_pid, writer_host, writer_start, mode, name FROM runs "
                             "WHERE status = 'running' ORDER BY run_id")
        dead = {r: (mode, name) for r, pid, host, start, mode, name in frame.rows()
                if not writer_alive_or_damaged(pid, host, start, self.path, r)}
        for run_id, (mode, name) in dead.items():
            # a run its sender named keeps its sender's seq, which has gaps for good reasons (a
            # request still in flight, one a sender failed to deliver): a gap there is no partial
            # flush, and trimming at it deleted spans the collector had acknowledged (a partial
            # request was never acknowledged, and its retry is told apart by its ids and seq). A
            # collector's own run is numbered by arrival, as a replay's: trimmed as one.
            if not (mode == "otlp" and name == named_run_name(run_id)):
                _trim_partial_flush(con, run_id)
            materialise(con, run_id)
            self._update_run(con, run_id, status="incomplete")
        return list(dead)

    # -- runs --------------------------------------------------------------------------
    def create_run(self, name: str, *, created: str | None = None, trace_source: str | None = None,
                   trace_digest: str | None = None, config: Any = None, behaviours: Any = None,
                   mode: str | None = None, run_id: str | None = None, time_offset_ns: int | None = None) -> str:
        from kvtrace.store.schema import created_now

        if created is None:
            created = created_now()
        if time_offset_ns is None:  # the run's wall-clock start: metadata, no digest sees it
            time_offset_ns = time.time_ns() // 1_000_000_000 * 1_000_000_000
        # the read of the largest id (or of the id's absence) and the insert, uncut by another
        # writer of this process: four writers in threads all recorded r1 (ClickHouse keeps no
        # primary key). chdb's other processes wait for the directory meanwhile.
        with _CREATING, self._connect() as con:
            if run_id is None:
                largest = con.ch_frame(LARGEST_NUMBERED_RUN_SQL.format(matches="match(run_id, '^r[0-9]+$')"))
                run_id = next_run_id(largest["run_id"][0] if largest.height else None)
                while self._leftover(con, run_id):  # (never another run's spans)
                    run_id = next_run_id(run_id)
            elif self._exists(con, run_id):
                raise StoreError(self.path, f"run id {run_id!r} already exists")
            elif self._leftover(con, run_id):
                raise StoreError(self.path, f"run id {run_id!r}: {LEFTOVER_SPANS}")
            pid = os.getpid()
            row = {"run_id": run_id, "name": name, "created": created, "trace_source": trace_source,
                   "trace_digest": trace_digest, "config": _json_or_none(config),
                   "behaviours": _json_or_none(behaviours), "mode": mode, "status": "running", "writer_pid": pid,
                   "writer_host": host_name(), "writer_start": process_start_token(pid),
                   TIME_OFFSET_COLUMN: int(time_offset_ns)}
            con.insert_arrow("runs", pa.table({c: pa.array([row.get(c)], _RUN_TYPES.get(t, pa.string()))
                                               for c, t, _ in RUN_COLUMNS}))
            if self.target.path is None:
                _give_up_a_shared_id(con, self.target.label, row)
            self._open_runs.add(run_id)  # (at once: an interrupt from here on finds it ours to mark, as DuckDB's)
        self._next_seq[run_id] = 0
        self._offsets[run_id] = int(time_offset_ns)
        return run_id

    def describe_run(self, run_id: str, **fields: Any) -> None:
        given = described(fields)
        if not given:
            return
        with self._connect() as con:
            if not self._exists(con, run_id):
                raise UnknownRunError(self.path, run_id)
            sets = ", ".join(f"{k} = {{{k}:String}}" for k in given)
            con.command(f"ALTER TABLE runs UPDATE {sets} WHERE run_id = {{run_id:String}} SETTINGS mutations_sync = 2",
                        {**given, "run_id": run_id})

    def record_curve(self, curve_id: str, points: list[dict[str, Any]]) -> None:
        arrow = {"VARCHAR": pa.string(), "BIGINT": pa.int64()}
        table = pa.table({c: pa.array([p.get(c) for p in points], arrow[kind]) for c, kind in CURVE_COLUMNS.items()})
        # The new points first, then the earlier recording's, told apart by their created time
        # (readers take a curve's newest recording alone): a kill between the two leaves both,
        # never neither. ClickHouse has no transaction: a DELETE then an insert lost the curve
        # committed before to a kill -9 between them, or to a SIGTERM, which said it was kept.
        created = {p.get("created") for p in points}
        with signals_held(), self._connect() as con:
            older = set(con.ch_frame("SELECT DISTINCT ifNull(created, '') AS c FROM curves WHERE curve_id = {c:String}",
                                     {"c": curve_id})["c"].to_list())
            if older & created:  # (recorded again within its second: not told apart by time)
                con.command("DELETE FROM curves WHERE curve_id = {c:String}", {"c": curve_id})
                con.insert_arrow("curves", table)
                return
            con.insert_arrow("curves", table)
            for when in sorted(older):
                con.command("DELETE FROM curves WHERE curve_id = {c:String} AND ifNull(created, '') = {w:String}",
                            {"c": curve_id, "w": when})

    def _update_run(self, con: client.ClickHouseConnection, run_id: str, status: str | None,
                    digest: str | None = None, summary: str | None = None, trace_digest: str | None = None) -> None:
        con.command(
            "ALTER TABLE runs UPDATE status = coalesce({status:Nullable(String)}, status), "
            "digest = coalesce({digest:Nullable(String)}, digest), "
            "summary = coalesce({summary:Nullable(String)}, summary), "
            "trace_digest = coalesce({trace_digest:Nullable(String)}, trace_digest) WHERE run_id = {run_id:String} "
            "SETTINGS mutations_sync = 2",
            {"status": status, "digest": digest, "summary": summary, "trace_digest": trace_digest, "run_id": run_id},
        )

    def _finish(self, run_id: str, status: str | None, digest: str | None, summary: str | None,
                trace_digest: str | None = None, recorded: bool = False) -> None:
        with self._connect() as con:
            if not self._exists(con, run_id):
                raise UnknownRunError(self.path, run_id)
            materialise(con, run_id)
            self._update_run(con, run_id, status, digest, summary, trace_digest)
            # (after the finish, with no transaction here: a kill between them leaves the run finished
            # unmarked, which its record, sent again, finishes again alike, never one marked unfinished;
            # and an insert that fails leaves it so too, the run finished, as its caller is told)
            if recorded:
                with contextlib.suppress(StoreError):
                    con.insert_arrow(RECORDED_RUNS_TABLE, pa.table({"run_id": pa.array([run_id], pa.string())}))

    def _leftover(self, con: client.ClickHouseConnection, run_id: str) -> bool:
        return con.ch_frame(LEFTOVER_SPANS_SQL.format(id="{r:String}"), {"r": run_id}).height > 0

    def _exists(self, con: client.ClickHouseConnection, run_id: str) -> bool:
        return con.ch_frame("SELECT 1 AS x FROM runs WHERE run_id = {r:String}", {"r": run_id}).height > 0

    def has_run(self, run_id: str) -> bool:
        with self._connect() as con:
            return self._exists(con, run_id)

    def drop_empty_run(self, run_id: str) -> bool:
        if run_id not in self._open_runs:
            return False
        with self._connect() as con:
            if con.ch_frame("SELECT 1 AS x FROM spans WHERE run_id = {r:String} LIMIT 1", {"r": run_id}).height:
                return False
            con.command("DELETE FROM runs WHERE run_id = {r:String}", {"r": run_id})
        self._forget_run(run_id)
        self._offsets.pop(run_id, None)
        return True

    def time_offset_ns(self, run_id: str) -> int:
        if run_id not in self._offsets:
            with self._connect() as con:
                found = con.ch_frame(f"SELECT {TIME_OFFSET_COLUMN} AS o FROM runs WHERE run_id = {{r:String}}",
                                     {"r": run_id})
            if found.height == 0:
                raise UnknownRunError(self.path, run_id)
            self._offsets[run_id] = int(found["o"][0])
        return self._offsets[run_id]

    # -- spans -------------------------------------------------------------------------
    def _resume_seq(self, run_id: str) -> int:
        self.time_offset_ns(run_id)  # UnknownRunError for a run the store lacks
        with self._connect() as con:
            found = con.ch_frame("SELECT max(seq) AS s FROM spans WHERE run_id = {r:String}", {"r": run_id})
        last = found["s"][0]
        return 0 if last is None else int(last) + 1

    def _commit(self, inserts: list[tuple[str, str, pa.Table]]) -> None:
        offsets = {run_id: self.time_offset_ns(run_id) for _, run_id, _ in inserts}
        with self._connect() as con, signals_held():
            # every insert of the flush and the buffer's forgetting, uncut by Ctrl-C or SIGTERM
            # (no transaction: the interrupt's own flush inserted the first families again)
            done: list[tuple[str, str, list[int]]] = []
            try:
                for family, run_id, rows in inserts:
                    offset = offsets[run_id]
                    rows = _shift(rows, offset)
                    n = rows.num_rows
                    rows = rows.append_column("run_id", pa.repeat(pa.scalar(run_id, pa.string()), n))
                    rows = rows.append_column(TIME_OFFSET_COLUMN, pa.repeat(pa.scalar(offset, pa.int64()), n))
                    con.insert_arrow(family, rows)
                    done.append((family, run_id, rows.column(SEQ_COLUMN).to_pylist()))
            except BaseException:
                _take_back(con, done)
                raise
            self._buffer, self._buffered_rows = [], 0


