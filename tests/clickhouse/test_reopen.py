"""A chdb store opened again by the process that laid it out, its catalog unchanged, runs none
of the layout's statements (about 0.4 s an open); any change to its catalog in between (a
column dropped) is seen, as on a first open."""

from __future__ import annotations

import pytest

from kvtrace.store import Store
from kvtrace.store.backend import clickhouse_target
from kvtrace.store.clickhouse import client
from kvtrace.store.errors import StoreError


@pytest.fixture
def statements(monkeypatch) -> list[str]:
    seen: list[str] = []
    command = client.ClickHouseConnection.command

    def counted(self, sql, params=None):
        seen.append(sql)
        return command(self, sql, params)

    monkeypatch.setattr(client.ClickHouseConnection, "command", counted)
    return seen


def _layout_statements(seen: list[str]) -> list[str]:
    """CREATE and ALTER ... ADD (an ALTER ... UPDATE is a row's change, not the layout's)."""
    return [s for s in seen if s.lstrip().upper().startswith("CREATE") or " ADD COLUMN " in s.upper()]


def test_an_unchanged_store_is_not_laid_out_again(tmp_path, statements):
    db = f"chdb:{tmp_path / 'ch'}"
    Store.open(db).close()
    assert len(_layout_statements(statements)) > 20  # (the first open made it)
    statements.clear()
    with Store.open(db) as store:
        run = store.create_run("again")
        store.finish_run(run, status="complete")
    assert _layout_statements(statements) == []


def test_a_column_dropped_between_two_opens_is_damage(tmp_path, statements):
    db = f"chdb:{tmp_path / 'ch'}"
    Store.open(db).close()
    with client.connect(clickhouse_target(db)) as con:
        con.command("ALTER TABLE spans_lookup DROP COLUMN time_offset_ns")
    with pytest.raises(StoreError, match=r"column spans_lookup\.time_offset_ns is missing"):
        Store.open(db)
