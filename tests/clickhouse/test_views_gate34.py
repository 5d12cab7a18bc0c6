"""The ClickHouse path's views read every rule once per inserted block: a gate view fills
``otel_checked`` (a Null table) with each span's typed values and why `kvtrace collect` would
refuse it, and the views filling kvtrace's tables read that. (Each view had read every rule of
the exporter's strings itself: ClickHouse planned about 0.3 MB of SQL per insert.) A store whose
views an earlier kvtrace made gets this kvtrace's views in place at its next writer's open, and
stores what a new store stores from then on."""

from __future__ import annotations

import pytest

from kvtrace.store import Store
from kvtrace.store.backend import clickhouse_target
from kvtrace.store.clickhouse import client, collector
from kvtrace.store.schema import META_TABLE
from tests.clickhouse.test_opening_record_start33 import _req, _span
from tests.instrument.test_otlp_fix27 import _protobuf
from tests.support.collector_rows import collector_rows

pytest.importorskip("chdb")

_TABLES = ("spans_request", "spans_lookup", "spans_other", "otel_refused_spans", "otel_collected_runs")
_REASONS = ("TraceId: not a trace id", "hits are counted within it", "a run of this store that no collector made")


def _batch(run_id: str, first: int) -> dict:
    """Spans of three tables, one refused for a rule across its fields (hits past its prompt)."""
    return _req([_span(first), _span(first + 1),
                 ("kvtrace.cache.lookup", {"kvtrace.lookup.query_tokens": 32, "kvtrace.hit_tokens": 16,
                                           "kvtrace.seq": first + 2}),
                 ("llm_request", {"gen_ai.request.model": "m", "kvtrace.seq": first + 3}),
                 ("kvtrace.request", {"kvtrace.request.id": "bad", "gen_ai.usage.input_tokens": 3,
                                      "kvtrace.hit_tokens": 9, "kvtrace.seq": first + 4})], first, run_id)


def _insert(db: str, doc: dict) -> None:
    with client.connect(clickhouse_target(db)) as con:
        con.insert_arrow("otel_traces", collector_rows([_protobuf(doc)]))


def _contents(db: str) -> dict[str, list]:
    with client.connect(clickhouse_target(db)) as con:
        got = {t: sorted(map(repr, con.ch_frame(f"SELECT * EXCEPT (start_ns) FROM {t}").rows())) for t in _TABLES}
        got["digest"] = con.ch_frame(f"SELECT value FROM {META_TABLE} WHERE key = "
                                     f"'{collector.VIEWS_VERSION_KEY}'")["value"].to_list()
    return got


def _views(con) -> dict[str, str]:
    return dict(con.ch_frame("SELECT name, create_table_query FROM system.tables WHERE database = currentDatabase() "
                             "AND engine = 'MaterializedView'").rows())


def _as_an_earlier_kvtrace_left_it(db: str) -> None:
    """Each view reading the exporter's table with every rule in its own query (the SQL is this
    kvtrace's gate inlined: what the earlier views stored), no gate, no otel_checked, no digest."""
    src = "`otel_traces`"
    rows = f"({collector.checked_select(src)})"
    with client.connect(clickhouse_target(db)) as con:
        for view, table, _, _ in collector._views(src)[1:]:
            if table == collector.RUN_RECORDS:
                continue
            select = (collector._family_select(table, rows)[1] if table.startswith("spans_") else
                      next(s for t, _, _, s in collector._side_tables(src, rows) if t == table))
            con.command(f"ALTER TABLE {view} MODIFY QUERY {select}")
        con.command(f"DROP TABLE {collector.VIEW_PREFIX}{collector.CHECKED_TABLE} SYNC")
        con.command(f"DROP TABLE {collector.CHECKED_TABLE} SYNC")
        con.command(f"DELETE FROM {META_TABLE} WHERE key = '{collector.VIEWS_VERSION_KEY}'")
        assert collector.CHECKED_TABLE not in con.table_names()


def test_every_rule_is_read_by_the_gate_alone(chdb_store):
    with client.connect(clickhouse_target(chdb_store)) as con:
        views = _views(con)
        readers = con.ch_frame("SELECT dependencies_table FROM system.tables WHERE database = currentDatabase() "
                               f"AND name = '{collector.CHECKED_TABLE}'")["dependencies_table"][0].to_list()
    gate = f"{collector.VIEW_PREFIX}{collector.CHECKED_TABLE}"
    assert all(r in views[gate] for r in _REASONS)
    for view, sql in views.items():
        if view != gate:
            assert not any(r in sql for r in _REASONS), view
    assert sorted(readers) == sorted(v for v in views if v not in (gate, f"{collector.VIEW_PREFIX}otel_run_records"))


def test_views_an_earlier_kvtrace_made_are_replaced_in_place_and_store_alike(_held_chdb):
    from tests.clickhouse.conftest import empty_chdb_store

    db = _held_chdb[0]
    empty_chdb_store(*_held_chdb)  # a new store's: the two batches as it stores them
    for doc in (_batch("a", 1), _batch("b", 11)):
        _insert(db, doc)
    Store.open(db).close()
    new = _contents(db)
    assert len(new["spans_request"]) == 4 and len(new["otel_refused_spans"]) == 2  # (each span once)
    empty_chdb_store(*_held_chdb)
    _as_an_earlier_kvtrace_left_it(db)
    _insert(db, _batch("a", 1))  # (through the earlier views)
    Store.open(db).close()  # (a writer's open: the views replaced)
    with client.connect(clickhouse_target(db)) as con:
        assert collector.CHECKED_TABLE in con.table_names()
        assert not any(r in sql for v, sql in _views(con).items() if not v.endswith(collector.CHECKED_TABLE)
                       for r in _REASONS)
    _insert(db, _batch("b", 11))  # (through this kvtrace's)
    Store.open(db).close()
    assert _contents(db) == new


def test_a_view_changed_since_is_given_back_and_the_digest_kept_once(chdb_store):
    with client.connect(clickhouse_target(chdb_store)) as con:
        view = f"{collector.VIEW_PREFIX}spans_request"
        con.command(f"ALTER TABLE {view} MODIFY QUERY {collector._family_select('spans_request', 'otel_checked')[1]} "
                    "AND 0")
        con.command(f"ALTER TABLE {META_TABLE} UPDATE value = 'earlier' WHERE key = '{collector.VIEWS_VERSION_KEY}' "
                    "SETTINGS mutations_sync = 2")
    Store.open(chdb_store).close()
    _insert(chdb_store, _batch("a", 1))
    Store.open(chdb_store).close()
    got = _contents(chdb_store)
    assert len(got["spans_request"]) == 2 and len(got["digest"]) == 1 and got["digest"] != ["earlier"]
