"""A ClickHouse --db a user gets wrong: one ``kvtrace: error:`` line naming it, exit 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.cli.test_bad_input import assert_one_line, run


@pytest.mark.parametrize(("argv", "needles"), [
    (["runs", "--db", "chdb:{tmp}/missing"], ["missing", "no such chdb directory"]),
    (["export", "--db", "chdb:{tmp}/missing", "--run", "r1", "--parquet", "{tmp}/out"], ["no such chdb directory"]),
    (["runs", "--db", "clickhouse://kv:pw@127.0.0.1:1/otel"], ["clickhouse://kv@127.0.0.1:1/otel",
                                                                 "cannot connect to ClickHouse"]),
    (["runs", "--db", "clickhouse://127.0.0.1/otel?ttl=3"], ["--db", "unknown option"]),
    (["diff", "r1", "r2", "--db", "chdb:"], ["--db", "chdb:PATH"]),
])
def test_clickhouse_db_errors_are_one_line(tmp_path, capsys, argv, needles):
    code, _, err = run([a.replace("{tmp}", str(tmp_path)) for a in argv], capsys)
    assert_one_line(code, err, *needles)
    assert "pw" not in err  # the password is never printed


def test_an_unresolvable_host_is_one_line_from_a_real_process():
    """The driver logs its own line before raising; pytest's log capture would hide it, so
    a real process: stderr is kvtrace's one line."""
    proc = subprocess.run([sys.executable, "-m", "kvtrace.cli", "runs", "--db", "clickhouse://kv:pw@nohost.invalid/otel"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert_one_line(proc.returncode, proc.stderr, "nohost.invalid", "cannot connect to ClickHouse")
    assert "pw" not in proc.stderr


def test_a_chdb_directory_that_is_not_a_store(tmp_path, capsys):
    from kvtrace.store.backend import clickhouse_target
    from kvtrace.store.clickhouse import client

    with client.connect(clickhouse_target(f"chdb:{tmp_path}/other")) as con:
        con.command("CREATE TABLE t (x Int64) ENGINE = MergeTree ORDER BY x")
    code, _, err = run(["runs", "--db", f"chdb:{tmp_path}/other"], capsys)
    assert_one_line(code, err, "not a kvtrace store")
