"""The ClickHouse DDL of a kvtrace store, derived from ``kvtrace.store.schema`` (and the
derived tables' DuckDB DDL in ``kvtrace.store.derived``): the same tables, columns and
views as the DuckDB store, in ClickHouse types.

- Family tables and ``spans_other``: ``MergeTree ORDER BY (run_id, seq)``, scalars
  Nullable (ids, name, seq and the offset not), lists ``Array`` (no NULL list: ``[]``),
  plus ``time_offset_ns``: span start/end and event times are stored shifted by it.
- Views ``spans`` and the family views: ids as hex, times with the offset subtracted,
  so they show what DuckDB's show.
- ``runs``: a small MergeTree updated with synchronous mutations (no transactions).
- Derived tables: their DuckDB columns, ``MergeTree ORDER BY run_id``.
"""

from __future__ import annotations

import re

from kvtrace.store import derived
from kvtrace.store.dialect import _split_args, clickhouse_type
from kvtrace.store.schema import (
    CURVE_COLUMNS,
    FAMILIES,
    META_TABLE,
    NUM_BLOCKS_COLUMN,
    OTHER_TABLE,
    RECORDED_RUNS_TABLE,
    RUN_COLUMNS,
    SEQ_COLUMN,
    SPAN_COLUMN_DEFS,
    SPAN_VIEW_COLUMNS,
    TIME_OFFSET_COLUMN,
    VIEW_SQL_TYPES,
    WRITER_COLUMNS,
    family_columns,
    view_columns,
)

SPAN_TABLES = (*FAMILIES, OTHER_TABLE)
# The collector path's own relations (``collector.attach``): its Null table of checked spans and
# its materialised views, which have the exporter's columns and are no exporter's table
CHECKED_TABLE = "otel_checked"
VIEW_PREFIX = "kvtrace_from_"


def collector_relation(name: str) -> bool:
    """Whether a relation is the collector path's own: ``otel_checked`` or one of its views."""
    return name == CHECKED_TABLE or name.startswith(VIEW_PREFIX)


# Columns every row has: not Nullable (sorting keys must not be, and it is cheaper).
_NOT_NULL = {"run_id", "name", SEQ_COLUMN, NUM_BLOCKS_COLUMN, TIME_OFFSET_COLUMN}
_LOW_CARDINALITY = {"run_id", "name", "source", "service_name", "scope_name", "scope_version", "publish_kind",
                    "evict_reason", "copy_reason", "span_kind", "status_code"}


def column_type(name: str, duck: str, low_cardinality: bool = True) -> str:
    if not low_cardinality:
        return clickhouse_type(duck, nullable=name not in _NOT_NULL)
    if name in _NOT_NULL:
        base = clickhouse_type(duck, nullable=False)
        return f"LowCardinality({base})" if name in _LOW_CARDINALITY else base
    ch = clickhouse_type(duck)
    if name in _LOW_CARDINALITY and ch == "Nullable(String)":
        return "LowCardinality(Nullable(String))"
    return ch


def stored_columns(table: str) -> tuple[str, ...]:
    """A family table's columns in ClickHouse: DuckDB's plus the time offset."""
    return (*family_columns(table), TIME_OFFSET_COLUMN)


_STORED_TYPES = {c.name: c.sql for c in SPAN_COLUMN_DEFS} | {NUM_BLOCKS_COLUMN: "INTEGER"}


def _stored_type(column: str) -> str:
    return _STORED_TYPES.get(column, "BIGINT")  # seq, time_offset_ns: BIGINT


def span_table_ddl(table: str) -> str:
    cols = ",\n    ".join(f"`{c}` {column_type(c, _stored_type(c))}" for c in stored_columns(table))
    return f"CREATE TABLE IF NOT EXISTS {table} (\n    {cols}\n) ENGINE = MergeTree ORDER BY (run_id, seq)"


# --- views -------------------------------------------------------------------------------
_HEX_TRACE = "printf('%016x%016x', {0}trace_id_hi, {0}trace_id_lo)"
_HEX_SPAN = "printf('%016x', {0}{1})"
_OFF = TIME_OFFSET_COLUMN


def _view_type(column: str) -> str:
    return column_type(column, VIEW_SQL_TYPES.get(column, "BIGINT"), low_cardinality=False)


# Source columns are qualified (``s.``): in ClickHouse an alias shadows the column of
# the same name everywhere in the SELECT, ``links`` inside ``... AS links`` included.
_PRESENTED: dict[str, tuple[str, tuple[str, ...]]] = {
    "trace_id": (_HEX_TRACE.format("s."), ("trace_id_hi", "trace_id_lo")),
    "span_id": (_HEX_SPAN.format("s.", "span_id"), ("span_id",)),
    "parent_span_id": (_HEX_SPAN.format("s.", "parent_span_id"), ("parent_span_id",)),
    "start_ns": (f"s.start_ns - s.{_OFF}", ("start_ns",)),
    "end_ns": (f"s.end_ns - s.{_OFF}", ("end_ns",)),
    "events": (f"arrayMap(e -> CAST(tuple(e.time_ns - s.{_OFF}, e.name, e.attributes), "
               "'{type}'), s.events)", ("events",)),
    "links": (f"arrayMap(l -> CAST(tuple({_HEX_TRACE.format('l.')}, {_HEX_SPAN.format('l.', 'span_id')}, "
              "l.trace_state, l.attributes), '{type}'), s.links)", ("links",)),
}


def _empty(column: str) -> str:
    typ = _view_type(column)
    if column == NUM_BLOCKS_COLUMN:
        return f"CAST(0 AS {typ}) AS {column}"
    if typ.startswith(("Array(", "Map(")):
        return f"CAST({'[]' if typ.startswith('Array(') else 'map()'} AS {typ}) AS {column}"
    return f"CAST(NULL AS {typ}) AS {column}"


def _select_as(table: str, columns: tuple[str, ...], where: str = "") -> str:
    have = set(stored_columns(table))

    def item(c: str) -> str:
        expr, needs = _PRESENTED.get(c, (c, (c,)))
        if not all(n in have for n in needs):
            return _empty(c)
        if expr == c:
            return f"`{c}`"
        return f"{expr.replace('{type}', _view_type(c)[len('Array('):-1])} AS {c}"  # {type}: the element's

    return f"SELECT {', '.join(map(item, columns))} FROM {table} AS s{where}"


def span_views_ddl() -> list[str]:
    everything = SPAN_VIEW_COLUMNS + WRITER_COLUMNS
    union = "\nUNION ALL ".join(_select_as(t, everything) for t in SPAN_TABLES)
    stmts = [f"CREATE OR REPLACE VIEW spans AS\n{union}"]
    for table, (view, names, _) in FAMILIES.items():
        cols = view_columns(family_columns(table))
        in_names = ", ".join(f"'{n}'" for n in names)
        stmts.append(f"CREATE OR REPLACE VIEW {view} AS\n{_select_as(table, cols)}\n"
                     f"UNION ALL {_select_as(OTHER_TABLE, cols, f' WHERE s.name IN ({in_names})')}")
    return stmts


# --- runs, meta, derived -------------------------------------------------------------------
RUNS_TABLE = "runs"


def runs_ddl(table: str = RUNS_TABLE) -> str:
    special = {"run_id": "String", TIME_OFFSET_COLUMN: "Int64 DEFAULT 0"}
    cols = ",\n    ".join(f"`{name}` {special.get(name) or clickhouse_type(typ)}" for name, typ, _ in RUN_COLUMNS)
    return f"CREATE TABLE IF NOT EXISTS {table} (\n    {cols}\n) ENGINE = MergeTree ORDER BY run_id"


def curves_ddl() -> str:
    cols = ",\n    ".join(f"`{c}` {clickhouse_type(t)}" for c, t in CURVE_COLUMNS.items())
    return f"CREATE TABLE IF NOT EXISTS curves (\n    {cols}\n) ENGINE = MergeTree ORDER BY tuple()"


META_DDL = f"CREATE TABLE IF NOT EXISTS {META_TABLE} (key String, value String) ENGINE = MergeTree ORDER BY key"
RECORDED_RUNS_CH_DDL = (f"CREATE TABLE IF NOT EXISTS {RECORDED_RUNS_TABLE} (run_id String) ENGINE = MergeTree "
                        "ORDER BY run_id")

_CREATE = re.compile(r"CREATE TABLE IF NOT EXISTS (\w+)\s*\((.*)\)\s*$", re.S)


def derived_columns(table: str) -> list[tuple[str, str]]:
    """(column, DuckDB type) of a derived table, read from its DuckDB DDL."""
    ddl = derived.DDL[derived.TABLES.index(table)]
    match = _CREATE.match(ddl.strip())
    assert match is not None, ddl
    return [tuple(part.split(None, 1)) for part in _split_args(match.group(2))]  # type: ignore[misc]


def derived_ddl(table: str) -> str:
    cols = ",\n    ".join(f"`{c}` {column_type(c, t)}" for c, t in derived_columns(table))
    return f"CREATE TABLE IF NOT EXISTS {table} (\n    {cols}\n) ENGINE = MergeTree ORDER BY run_id"


def store_ddl() -> list[str]:
    """Every CREATE of a kvtrace store in ClickHouse, in order."""
    return [META_DDL, runs_ddl(), curves_ddl(), RECORDED_RUNS_CH_DDL, *(span_table_ddl(t) for t in SPAN_TABLES),
            *(derived_ddl(t) for t in derived.TABLES), *span_views_ddl()]


def store_tables() -> tuple[str, ...]:
    """The tables (not views) ``store_ddl`` creates."""
    return tuple(m.group(1) for m in map(_TABLE_NAME.match, store_ddl()) if m is not None)


_TABLE_NAME = re.compile(r"CREATE TABLE IF NOT EXISTS (\w+)")
