"""A ClickHouse store records which definitions built its derived rows, as a DuckDB one does."""

from __future__ import annotations


def test_a_new_clickhouse_store_says_its_derived_rows_follow_todays_definitions(ch_stores):
    """(A chdb store of 2026-12-04 read its evictions paired by seq where DuckDB's read them from
    the spans: both backends now record the version and read an older store's rows alike.)"""
    from kvtrace.store.clickhouse.reader import read_connection
    from kvtrace.store.read._sql import derived_status

    with read_connection(ch_stores.direct) as con:
        assert derived_status(con, "complete") == "complete"
