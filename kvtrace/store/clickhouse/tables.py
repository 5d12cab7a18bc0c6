"""A ClickHouse kvtrace store's bookkeeping: is it one (``check_meta``), and a run's
derived tables, rebuilt server-side from the SQL the DuckDB store runs (``materialise``)."""

from __future__ import annotations

from kvtrace.store import derived, dialect
from kvtrace.store.clickhouse import client
from kvtrace.store.clickhouse.schema import derived_columns
from kvtrace.store.errors import DAMAGED, StoreError
from kvtrace.store.schema import META_TABLE, meta_version
from kvtrace.store.state import chdb_catalog_state


def check_meta(con: client.ClickHouseConnection, label: str) -> int | None:
    """The store's schema version, None for a database without kvtrace's tables; StoreError
    for one that is another program's or too new."""
    if META_TABLE not in con.table_names():
        return None
    _check_no_broken_parts(con, label)  # (first: a broken part of the meta table reads as no magic)
    version = meta_version(dict(con.ch_frame(f"SELECT key, value FROM {META_TABLE}").rows()), label)
    state = chdb_catalog_state(con.target)
    if state is None or (state, version) not in _CHECKED:  # (about 25 ms a check on chdb)
        _check_columns(con, label, version)
        if state is not None:
            if len(_CHECKED) >= 256:
                _CHECKED.clear()
            _CHECKED.add((state, version))
    return version


_OTEL_COLUMNS = frozenset({"TraceId", "SpanId", "SpanName", "SpanAttributes"})  # the exporter's table, by its columns
_CHECKED: set[tuple] = set()  # (catalog state, version) of chdb stores found whole in this process


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
                others = sorted(t for t, cols in have.items() if cols >= _OTEL_COLUMNS)
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
            samples = {m: con.query_arrow(derived.latency_samples_sql(m), params).column("v").to_numpy()
                       for m in derived.LATENCY_VALUES}
            con.insert_arrow(table, derived.latency_cdf_table(run_id, samples))
            continue
        cols = ", ".join(c for c, _ in derived_columns(table))
        sql, bound = dialect.to_clickhouse(f"SELECT {cols} FROM ({selects[table]})", params)
        con.command(f"INSERT INTO {table} ({cols}) {sql}", bound)
