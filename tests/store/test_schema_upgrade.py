"""A writer's open of an existing store runs the schema's DDL only where the store lacks what
it makes: views stamped by another kvtrace's DDL (or replaced by hand) are made again, and
the tables and columns added since a store was written are added; a store of today's
schema is left as it is (re-binding its views took 35 ms of every writer's open)."""

from __future__ import annotations

import duckdb
import pytest

from kvtrace.store import Store
from kvtrace.store.writer import _VIEWS, _schema_stamp


def _stamps(db) -> dict[str, str | None]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        return dict(con.execute("SELECT view_name, comment FROM duckdb_views() WHERE NOT internal").fetchall())
    finally:
        con.close()


def _rows(db, view: str) -> int:
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute(f"SELECT count(*) FROM {view}").fetchone()[0]
    finally:
        con.close()


def _emptied(db, view: str, stamp: str | None) -> None:
    """``view`` replaced by one of the same columns that shows no row, stamped ``stamp``."""
    con = duckdb.connect(str(db))
    try:
        (sql,) = con.execute(f"SELECT sql FROM duckdb_views() WHERE view_name = '{view}'").fetchone()
        con.execute(sql.replace("CREATE VIEW", "CREATE OR REPLACE VIEW").rstrip().rstrip(";") + " LIMIT 0")
        if stamp is not None:
            con.execute(f"COMMENT ON VIEW {view} IS '{stamp}'")
    finally:
        con.close()


@pytest.fixture
def store(tmp_path):
    from kvtrace.replay.run import RunSpec, run_replay

    db = tmp_path / "s.duckdb"
    run_replay(RunSpec("gen:mixed", limit=3, content=False), db=db)
    assert _rows(db, "cache_spans") > 0 and _rows(db, "lookup_spans") > 0
    return db


def test_every_view_of_a_new_store_carries_the_stamp_of_the_ddl_that_made_it(store):
    assert _stamps(store) == dict.fromkeys(_VIEWS, _schema_stamp())


def test_a_store_whose_views_carry_todays_stamp_has_none_made_again(store):
    """(shown by a view changed by hand and stamped: it stays as it was)"""
    _emptied(store, "lookup_spans", _schema_stamp())
    Store.open(store).close()
    assert _rows(store, "lookup_spans") == 0


def test_views_another_kvtrace_made_are_all_made_again_by_todays_definitions(store):
    """An older kvtrace replaces every view at each open, unstamped: here the cache spans
    view by one that shows no row. One view unstamped, and every view is made again, in the
    DDL's one transaction (the lookup view, emptied and stamped by hand, too)."""
    cache, lookups = _rows(store, "cache_spans"), _rows(store, "lookup_spans")
    _emptied(store, "lookup_spans", _schema_stamp())
    _emptied(store, "cache_spans", None)
    assert _stamps(store)["cache_spans"] is None
    Store.open(store).close()
    assert _stamps(store) == dict.fromkeys(_VIEWS, _schema_stamp())
    assert (_rows(store, "cache_spans"), _rows(store, "lookup_spans")) == (cache, lookups)
