"""What a kvtrace store file must hold, derived from the declarations, and the check that it does.

The tables, views and columns come from the same data the writer's DDL is built from
(``schema.py``: runs, curves, the span family tables and their views, otel_traces;
``derived.py``: the derived tables). A store whose relations or columns are not those
(a table dropped by hand, a column dropped or retyped) is damaged: ``check_layout`` refuses
it when it is opened, with one line naming what is missing or wrong, instead of letting the
first query that meets the hole fail (or the writer re-create an empty table next to the
old run's spans).

Opening pays for the check once per state of the file in a process: DuckDB's catalog
functions take some 20-30 ms on a fresh connection, and a reader opens one per query, so
the answer is kept per (file, size, mtime) of the database and its WAL.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import duckdb

from kvtrace.store import derived
from kvtrace.store.errors import DAMAGED, StoreError
from kvtrace.store.schema import (
    CURVE_COLUMNS,
    FAMILIES,
    META_TABLE,
    OTEL_TRACES_COLUMNS,
    RECORDED_RUNS_COLUMNS,
    RECORDED_RUNS_TABLE,
    RUN_COLUMNS,
    SCHEMA_VERSION,
    SPAN_TABLES,
    SPAN_VIEW_COLUMNS,
    WRITER_COLUMNS,
    family_columns,
    span_column_sql_type,
    view_columns,
)
from kvtrace.store.state import duckdb_file_state

TABLE, VIEW = "table", "view"

# What the writer adds to a store written before it existed (CREATE / ALTER ... IF NOT
# EXISTS when it opens one): a store may lack these and still be whole.
ADDED_TABLES = frozenset({"curves", RECORDED_RUNS_TABLE})
ADDED_COLUMNS: dict[str, tuple[str, ...]] = {"runs": ("time_offset_ns",), **derived.ADDED_COLUMNS}
# The tables of kvtrace's earlier schema versions that today's declares no more: an older
# store's own, never a user's (version 1 and 2 stores kept latency percentiles in
# latency_quantiles, which version 3 replaced by latency_cdf).
RETIRED_TABLES = frozenset({"latency_quantiles"})
# The value such a column holds in the rows written before it (SQL; NULL where not named): what
# the writer's ALTER gives them (runs.time_offset_ns DEFAULT 0: a DuckDB store keeps 0), and so
# what a reader of a store not yet upgraded takes it for (``export``: the same files before and after).
ADDED_DEFAULTS: dict[tuple[str, str], str] = {("runs", "time_offset_ns"): "0"}


def added_columns_missing(con: duckdb.DuckDBPyConnection, table: str) -> tuple[str, ...]:
    """The columns of ``ADDED_COLUMNS[table]`` the store open on ``con`` lacks (a store
    written before them that no writer of this kvtrace has opened since)."""
    added = ADDED_COLUMNS.get(table, ())
    if not added:
        return ()
    have = {row[0] for row in con.execute(
        "SELECT column_name FROM duckdb_columns() WHERE NOT internal AND schema_name = 'main' "
        "AND database_name = current_database() AND table_name = ?", [table]).fetchall()}
    return tuple(c for c in added if c not in have)


@dataclass(frozen=True)
class Relation:
    """A table or view of the store: its kind and its columns (name -> DuckDB type; None
    where the type is not checked: a view's column types follow from its tables)."""

    kind: str
    columns: dict[str, str | None]


@functools.cache
def expected(version: int) -> dict[str, Relation]:
    """The relations a store of schema ``version`` must hold.

    The current version: every table with its columns and types, every view with its
    columns. An older one (readable, never appended to): the runs table as declared and the
    span tables and views by name (its span columns and derived tables were not these).
    """
    out: dict[str, Relation] = {
        META_TABLE: Relation(TABLE, {"key": "VARCHAR", "value": "VARCHAR"}),
        "runs": Relation(TABLE, {name: typ for name, typ, _ in RUN_COLUMNS}),
    }
    current = version >= SCHEMA_VERSION
    for table in SPAN_TABLES:
        out[table] = Relation(TABLE, {c: span_column_sql_type(c) for c in family_columns(table)} if current else {})
    out["spans"] = Relation(VIEW, dict.fromkeys(SPAN_VIEW_COLUMNS + WRITER_COLUMNS) if current else {})
    for table, (view, _, _) in FAMILIES.items():
        out[view] = Relation(VIEW, dict.fromkeys(view_columns(family_columns(table))) if current else {})
    out["otel_traces"] = Relation(VIEW, dict.fromkeys([c for c, _ in OTEL_TRACES_COLUMNS] + ["RunId"])
                                  if current else {})
    if current:
        out["curves"] = Relation(TABLE, dict(CURVE_COLUMNS))
        out[RECORDED_RUNS_TABLE] = Relation(TABLE, dict(RECORDED_RUNS_COLUMNS))
        for table, cols in derived.COLUMNS.items():
            out[table] = Relation(TABLE, dict(cols))
    return out


def _norm_type(sql_type: str) -> str:
    # DuckDB quotes STRUCT field names that are keywords ("name"); the declarations do not
    return sql_type.replace('"', "").upper()


def foreign_relations(con: duckdb.DuckDBPyConnection, version: int) -> list[str]:
    """The tables and views in the store open on ``con`` that kvtrace does not declare (a
    user's own, in any schema), as ``schema.name``: what replacing the file would drop.
    Kvtrace's own are the names of ``version``'s relations and of today's: an older store
    holds derived tables and curves that ``expected`` does not list for its version, and
    tables today's declares no more (``RETIRED_TABLES``: a version 2 demo store's
    latency_quantiles was called a user's own, and the demo refused to replace the store)."""
    retired = RETIRED_TABLES if version < SCHEMA_VERSION else frozenset()  # (in today's store, a user's)
    mine = set(expected(version)) | set(expected(SCHEMA_VERSION)) | retired
    rows = con.execute(
        "SELECT schema_name, table_name FROM duckdb_tables() WHERE NOT internal AND database_name = current_database() "
        "UNION ALL SELECT schema_name, view_name FROM duckdb_views() WHERE NOT internal "
        "AND database_name = current_database() ORDER BY 1, 2").fetchall()
    return [f"{schema}.{name}" for schema, name in rows if not (schema == "main" and name in mine)]


def problems(con: duckdb.DuckDBPyConnection, version: int) -> list[str]:
    """What is missing or wrong in the store open on ``con`` (empty when it is whole)."""
    found = dict(con.execute(
        "SELECT table_name, 'table' FROM duckdb_tables() WHERE NOT internal AND schema_name = 'main' "
        "AND database_name = current_database() "
        "UNION ALL SELECT view_name, 'view' FROM duckdb_views() WHERE NOT internal AND schema_name = 'main' "
        "AND database_name = current_database()").fetchall())
    columns: dict[str, dict[str, str]] = {}
    for rel, col, typ in con.execute(
            "SELECT table_name, column_name, data_type FROM duckdb_columns() WHERE NOT internal "
            "AND schema_name = 'main' AND database_name = current_database() ORDER BY column_index").fetchall():
        columns.setdefault(rel, {})[col] = typ
    out = []
    for name, want in expected(version).items():
        kind = found.get(name)
        if kind is None:
            if name not in ADDED_TABLES:
                out.append(f"{want.kind} {name} is missing")
            continue
        if kind != want.kind:
            out.append(f"{name} is a {kind}, expected a {want.kind}")
            continue
        have = columns.get(name, {})
        for col, typ in want.columns.items():
            if col not in have:
                if col not in ADDED_COLUMNS.get(name, ()):
                    out.append(f"column {name}.{col} is missing")
            elif typ is not None and _norm_type(have[col]) != _norm_type(typ):
                out.append(f"column {name}.{col} is {have[col]}, expected {typ}")
    # runs.run_id is the key every reader looks a run up by: a table rebuilt without it can
    # hold one id twice, and each reader would take whichever row came first
    if found.get("runs") == TABLE and not con.execute(
            "SELECT 1 FROM duckdb_constraints() WHERE database_name = current_database() AND schema_name = 'main' "
            "AND table_name = 'runs' AND constraint_type = 'PRIMARY KEY' AND constraint_column_names = ['run_id']"
    ).fetchall():
        out.append("table runs has lost its primary key run_id")
    return out


_SHOWN = 4  # problems named in the error line
_CHECKED: set[tuple] = set()
_CHECKED_MAX = 256


def damaged(path: str, wrong: list[str]) -> StoreError:
    """The one-line error of a store whose layout is ``wrong`` (its first few problems)."""
    more = f"; and {len(wrong) - _SHOWN} more" if len(wrong) > _SHOWN else ""
    return StoreError(path, f"{DAMAGED}: {'; '.join(wrong[:_SHOWN])}{more}")


def check_layout(con: duckdb.DuckDBPyConnection, path: str, version: int) -> None:
    """Raise a one-line StoreError naming the file unless the store open on ``con`` holds
    every table, view and column of ``expected(version)`` (see the module docstring)."""
    state = duckdb_file_state(path)
    if state is not None and (state, version) in _CHECKED:
        return
    wrong = problems(con, version)
    if wrong:
        raise damaged(path, wrong)
    if state is not None:
        if len(_CHECKED) >= _CHECKED_MAX:
            _CHECKED.clear()
        _CHECKED.add((state, version))
