"""chdb stores probed by hand (session 21): what a user's or another tool's edit leaves,
given to the real CLI."""

from __future__ import annotations

from kvtrace.store import Store
from kvtrace.store.backend import clickhouse_target
from kvtrace.store.clickhouse import client
from tests.cli.support import assert_one_line
from tests.cli.support import run as kvtrace


def _store(tmp_path) -> str:
    db = f"chdb:{tmp_path / 'ch'}"
    with Store.open(db) as store:
        run_id = store.create_run("one", run_id="r1", trace_source="hand-built", mode="engine")
        store.finish_run(run_id, digest="d", summary={"requests": 0})
    return db


def test_a_meta_key_given_twice_with_two_values_is_a_damaged_store(tmp_path, capsys):
    """ClickHouse keeps no key: a second schema_version row (2 beside 3) was read as
    whichever came last, and a replay appended to the store either way."""
    db = _store(tmp_path)
    with client.connect(clickhouse_target(db)) as con:
        con.command("INSERT INTO kvtrace_meta VALUES ('schema_version', '2')")
    code, _, err = kvtrace(["runs", "--db", db], capsys)
    assert_one_line(code, err, db, "damaged kvtrace store", "schema_version is given twice", "'2'", "'3'")


def test_meta_rows_given_twice_alike_are_read(tmp_path, capsys):
    """Two writers that made one store at once each insert the same meta rows: one store."""
    db = _store(tmp_path)
    with client.connect(clickhouse_target(db)) as con:
        con.command("INSERT INTO kvtrace_meta VALUES ('magic', 'kvtrace-store'), ('schema_version', '3')")
    code, out, err = kvtrace(["runs", "--db", db, "--json"], capsys)
    assert code == 0, err
    assert '"run_id": "r1"' in out


def test_a_chdb_path_with_a_newline_is_named_as_typed(tmp_path, capsys):
    """A DuckDB path's newline is shown as \\n; a chdb one's was joined into a space by the
    one-line error ("chdb:.../ch 1": a directory that does not exist either)."""
    db = f"chdb:{tmp_path}/ch\n1"
    code, _, err = kvtrace(["runs", "--db", db], capsys)
    assert_one_line(code, err, f"chdb:{tmp_path}/ch\\n1: no such chdb directory")
