"""The ``chdb_store`` fixture's store is a new one whatever the module's last case left in it:
rows (its tables emptied) or a changed layout (made again)."""

from __future__ import annotations

from kvtrace.replay.run import RunSpec, run_replay
from kvtrace.store import Store
from kvtrace.store.backend import clickhouse_target
from kvtrace.store.clickhouse import client
from tests.clickhouse.conftest import _LAYOUT, empty_chdb_store, new_store_state


def _contents(con) -> dict[str, list]:
    """Every table's rows (views left out: they read the tables) and the layout."""
    tables = con.ch_frame("SELECT name FROM system.tables WHERE database = currentDatabase() "
                          "AND engine NOT LIKE '%View' ORDER BY name").rows()
    rows = {name: sorted(map(repr, con.ch_frame(f"SELECT * FROM `{name}`").rows())) for (name,) in tables}
    return {"layout": con.ch_frame(_LAYOUT).rows(), **rows}


def test_an_emptied_store_is_a_new_one_after_rows_and_after_damage(tmp_path):
    db = f"chdb:{tmp_path / 'ch'}"
    Store.open(db).close()
    with client.connect(clickhouse_target(db)) as con:
        made, new = new_store_state(con), _contents(con)
        run_replay(RunSpec("gen:chat", limit=4, mode="cache-only"), db=db)
        assert _contents(con) != new  # (the replay wrote rows)
        empty_chdb_store(db, made)
        assert _contents(con) == new
        con.command("ALTER TABLE spans_lookup DROP COLUMN time_offset_ns")
        assert con.ch_frame(_LAYOUT).rows() != made[0]
        empty_chdb_store(db, made)
        assert _contents(con) == new
