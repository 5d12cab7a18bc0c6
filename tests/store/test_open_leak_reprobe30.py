"""A stop signal landing inside ``connection._open`` after DuckDB connected (while the new
connection is checked and quieted) left that connection open: the stop path's own open of
the same file (finish_run marking the run failed) was DuckDB's "Can't open a connection to
same database file with a different configuration", suppressed, and the SIGTERM'd replay's
run stayed 'running' (shown incomplete), not 'failed' (re-probe 30)."""

from __future__ import annotations

import pytest

from kvtrace.store import Store, connection


@pytest.mark.parametrize("read_only", [True, False])
def test_an_interrupt_inside_open_leaves_no_connection_open(tmp_path, monkeypatch, read_only):
    db = str(tmp_path / "s.duckdb")
    Store.open(db).close()
    quiet = connection._quiet

    def interrupted(con):
        raise KeyboardInterrupt  # (a SIGTERM's Terminated raised by its handler here)

    monkeypatch.setattr(connection, "_quiet", interrupted)
    opener = connection.read_connection if read_only else connection.write_connection
    with pytest.raises(KeyboardInterrupt) as stopped, opener(db):  # (held: the stop path runs while it is)
        pass
    monkeypatch.setattr(connection, "_quiet", quiet)
    for other in (connection.write_connection, connection.read_connection):  # the stop path's opens
        with other(db) as con:
            assert con.execute("SELECT 1").fetchone() == (1,)
    assert stopped.value is not None
