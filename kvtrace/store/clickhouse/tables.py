"""A ClickHouse kvtrace store's bookkeeping: is it one (``check_meta``), and a run's
derived tables, rebuilt server-side from the SQL the DuckDB store runs (``materialise``)."""

from __future__ import annotations

from kvtrace.store import derived, dialect
from kvtrace.store.clickhouse import client
from kvtrace.store.clickhouse.schema import collector_relation, derived_columns, store_tables
from kvtrace.store.errors import DAMAGED, StoreError
from kvtrace.store.schema import META_TABLE, SCHEMA_VERSION, SPAN_TABLES, TIME_OFFSET_COLUMN, meta_rows, meta_version
from kvtrace.store.state import chdb_catalog_state


def check_meta(con: client.ClickHouseConnection, label: str) -> int | None:
    """The store's schema version, None for a database without kvtrace's tables; StoreError
    for one that is another program's or too new."""
    if META_TABLE not in con.table_names():
        return None
    _check_no_broken_parts(con, label)  # (first: a broken part of the meta table reads as no magic)
    meta = meta_rows(con.ch_frame(f"SELECT key, value FROM {META_TABLE}").rows(), label)
    if not meta:  # (its rows are a store's creation's last step: a creation cut short, see init_schema)
        return None
    version = meta_version(meta, label)
    state = chdb_catalog_state(con.target)
    if state is None or (state, version) not in _CHECKED:  # (about 25 ms a check on chdb)
        _check_columns(con, label, version)
        if state is not None:
            if len(_CHECKED) >= 256:
                _CHECKED.clear()
            _CHECKED.add((state, version))
    _check_unique_runs(con, label)  # (rows, not catalog: every open; about 1 ms on chdb)
    return version


def _check_unique_runs(con: client.ClickHouseConnection, label: str) -> None:
    """StoreError when ``runs`` holds a run id twice: ClickHouse keeps no primary key (two
    writers on a server took the same next id), and each reader took whichever row came
    first (``runs`` listed it twice, an export wrote both). DuckDB's layout check refuses a
    runs table that could (one that lost its primary key) the same way."""
    twice = con.ch_frame("SELECT run_id, count() AS n FROM runs GROUP BY run_id HAVING n > 1 "
                         "ORDER BY run_id LIMIT 3")
    if twice.height:
        each = "; ".join(f"run {r} is recorded {n} times in runs" for r, n in twice.rows())
        raise StoreError(label, f"{DAMAGED}: {each} (each reader would take whichever record came first)")


_OTEL_COLUMNS = frozenset({"TraceId", "SpanId", "SpanName", "SpanAttributes"})  # the exporter's table, by its columns
_CHECKED: set[tuple] = set()  # (catalog state, version) of chdb stores found whole in this process


def check_creatable(con: client.ClickHouseConnection, label: str) -> None:
    """StoreError unless a new store may be made in a database without kvtrace_meta rows:
    a table of the store's names that holds rows is a store whose meta is lost, or another
    program's table (DuckDB's writer refuses a file with tables and no meta). Empty ones
    are a creation killed before its meta rows (no transaction), which the writer finishes:
    such a store was refused by every command for good."""
    have = con.table_names() & set(store_tables())
    if not have:
        return
    counts = con.ch_frame(" UNION ALL ".join(f"SELECT '{t}' AS t, count() AS n FROM {t}" for t in sorted(have)))
    full = sorted((t for t, n in counts.rows() if n), key=lambda t: (t != "runs", t))
    if full:
        raise StoreError(label, f"not a kvtrace store, or one whose {META_TABLE} is lost: no {META_TABLE} rows, "
                                f"yet {', '.join(full[:4])}{' and more' if len(full) > 4 else ''} hold rows; "
                                "write to a new database")


def _check_columns(con: client.ClickHouseConnection, label: str, version: int) -> None:
    """StoreError naming what is missing when a relation or a column the declarations name
    is not there (by name: ClickHouse's types are its own). DuckDB's ``layout.check_layout``
    for a ClickHouse store: a dropped ``runs.name`` was exported as if whole."""
    from kvtrace.store.layout import ADDED_COLUMNS, ADDED_TABLES, damaged, expected

    have: dict[str, set[str]] = {}
    for table, column in con.ch_frame("SELECT table, name FROM system.columns "
                                      "WHERE database = currentDatabase()").rows():
        have.setdefault(table, set()).add(column)
    wrong = []
    for name, relation in expected(version).items():
        if name == "otel_traces":  # here the OTel Collector exporter's table (?otel_table=), its columns its own
            if con.target.otel_table not in have:
                others = sorted(t for t, cols in have.items() if cols >= _OTEL_COLUMNS and not collector_relation(t))
                if others:  # (a whole store written with another ?otel_table=: not "damaged")
                    named = others[0] if len(others) == 1 else f"one of {', '.join(others)}"
                    raise StoreError(label, f"no table {con.target.otel_table}: this store's OTel table is "
                                            f"{named}; open it with ?otel_table=NAME")
                wrong.append(f"table {con.target.otel_table} is missing")
            continue
        if name not in have:
            if name not in ADDED_TABLES:
                wrong.append(f"{relation.kind} {name} is missing")
            continue
        wrong += [f"column {name}.{c} is missing" for c in relation.columns
                  if c not in have[name] and c not in ADDED_COLUMNS.get(name, ())]
    if version >= SCHEMA_VERSION:  # the span tables' own column here (not DuckDB's): every view reads it
        wrong += [f"column {t}.{TIME_OFFSET_COLUMN} is missing" for t in SPAN_TABLES
                  if t in have and TIME_OFFSET_COLUMN not in have[t]]
    if wrong:
        raise damaged(label, wrong)


def _check_no_broken_parts(con: client.ClickHouseConnection, label: str) -> None:
    """StoreError when ClickHouse set data parts of the store aside as broken (a truncated
    or damaged ``data.bin``: it detaches them when it starts, and every read after comes up
    short, silently)."""
    try:
        broken = con.ch_frame("SELECT table, count() AS n FROM system.detached_parts "
                              "WHERE database = currentDatabase() AND startsWith(reason, 'broken') "
                              "GROUP BY table ORDER BY table")
    except StoreError:  # (a server that does not show its system tables to this user: not checked)
        return
    if broken.height:
        tables = ", ".join(broken["table"].to_list())
        raise StoreError(label, f"{DAMAGED}: {int(broken['n'].sum())} data part(s) of {tables} could not be read "
                                "(ClickHouse set them aside as broken, in detached/); its runs would read short")


def materialise(con: client.ClickHouseConnection, run_id: str) -> None:
    """(Re)build one run's derived rows server-side, from the SQL the DuckDB store runs."""
    params = {"run_id": run_id}
    for table in derived.TABLES:
        # only where rows are (a run materialised again): a delete is a mutation, written to
        # disk and waited for, and on a full disk it never finished (nor let SIGTERM in)
        if con.ch_frame(f"SELECT count() AS n FROM {table} WHERE run_id = {{run_id:String}}", params)["n"][0]:
            con.command(f"DELETE FROM {table} WHERE run_id = {{run_id:String}}", params)
    own = "(SELECT * FROM evicted_blocks WHERE run_id = $run_id)"
    selects = {
        "evicted_blocks": derived.EVICTED_BLOCKS_SELECT,
        "miss_attribution": derived.MISS_ATTRIBUTION_TEMPLATE.format(evicted_blocks=own),
        "block_values": derived.BLOCK_VALUES_TEMPLATE.format(evicted_blocks=own),
        "evict_counts": derived.EVICT_COUNTS_TEMPLATE.format(evicted_blocks=own),
        "span_stats": derived.SPAN_STATS_SELECT,
        "stale_chain": derived.STALE_CHAIN_SELECT,
    }
    for table in derived.TABLES:  # evicted_blocks first: the others read it
        if table == "latency_cdf":  # percentiles by kvtrace.numeric, the one definition: in Python
            samples = derived.samples_by_metric(con.query_arrow(derived.ALL_LATENCY_SAMPLES_SQL, params))
            con.insert_arrow(table, derived.latency_cdf_table(run_id, samples))
            continue
        cols = ", ".join(c for c, _ in derived_columns(table))
        sql, bound = dialect.to_clickhouse(f"SELECT {cols} FROM ({selects[table]})", params)
        con.command(f"INSERT INTO {table} ({cols}) {sql}", bound)
