"""A chdb store's flush is one insert per span family, without a transaction: one that failed
after its first insert (a full disk) kept that family's rows, and `kvtrace collect`, which
answered the request 503, stored them again when the sender retried it: two spans at one seq of
the run. The rows of a failed flush are taken back now."""

from __future__ import annotations

import time

import pytest

from kvtrace.instrument.otlp import OTLPCollector
from kvtrace.store.backend import clickhouse_target
from kvtrace.store.clickhouse import client
from kvtrace.store.errors import StoreError
from tests.instrument.helpers import post_otlp_json
from tests.instrument.test_collect_records_rec32 import _named, _span

pytest.importorskip("chdb")


def test_a_request_whose_flush_failed_part_way_is_stored_once_when_sent_again(tmp_path, monkeypatch):
    db = f"chdb:{tmp_path / 'ch'}"
    collector = OTLPCollector(db, port=0).start()
    insert = client.ClickHouseConnection.insert_arrow
    families: list[str] = []

    def second_fails(self, table, rows):
        if table.startswith("spans_"):
            families.append(table)
            if len(families) == 2:
                raise StoreError(db, "ClickHouse refused an insert into spans_request: No space left on device")
        return insert(self, table, rows)

    monkeypatch.setattr(client.ClickHouseConnection, "insert_arrow", second_fails)
    doc = _named("r", [_span(0), ("kvtrace.cache.publish", {"kvtrace.seq": 1, "kvtrace.block.ids": [1]})], 1)
    try:
        assert post_otlp_json(collector.url, doc)[0] == 503
        assert post_otlp_json(collector.url, doc)[0] == 200
    finally:
        collector.stop()
    assert len(families) == 4  # (the first try's two inserts, the first of them kept, and the retry's two)
    with client.connect(clickhouse_target(db)) as con:
        deadline = time.monotonic() + 30  # (the take-back's delete is not waited for: a full disk never ends one)
        while con.ch_frame("SELECT count() AS n FROM system.mutations WHERE database = currentDatabase() "
                           "AND NOT is_done")["n"][0] and time.monotonic() < deadline:
            time.sleep(0.05)
        held = con.ch_frame("SELECT seq, name FROM spans WHERE run_id = 'r' ORDER BY seq").rows()
    assert held == [(0, "kvtrace.request"), (1, "kvtrace.cache.publish")]
