"""A store file is attached to a kept DuckDB instance, not opened in a new one
(``kvtrace.store.instances``): what an open did before, it still does."""

from __future__ import annotations

import os
import subprocess
import sys

import duckdb
import pytest

from kvtrace.store import Store, instances, read
from kvtrace.store.connection import read_connection, write_connection


def _settings(con) -> dict[str, str]:
    names = ("threads", "memory_limit", "checkpoint_threshold", "temp_directory")
    return {n: con.execute(f"SELECT current_setting('{n}')").fetchone()[0] for n in names}


def _databases(con) -> list[str]:
    return [r[0] for r in con.execute("SELECT database_name FROM duckdb_databases() WHERE NOT internal "
                                      "ORDER BY 1").fetchall()]


@pytest.fixture()
def two_stores(tmp_path):
    a, b = str(tmp_path / "a.duckdb"), str(tmp_path / "b.duckdb")
    for path in (a, b):
        Store.open(path).close()
    return a, b


def test_a_file_open_twice_in_one_mode_is_one_instance_and_the_other_mode_is_refused_as_duckdb_does(two_stores):
    a, _ = two_stores
    with read_connection(a) as first, read_connection(a) as second:
        first.execute("CREATE TEMP TABLE mine AS SELECT 1 AS x")  # (a connection's own temp objects stay its own)
        assert second.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'mine'").fetchone() == (0,)
        assert first.execute("SELECT current_database()").fetchone() == second.execute(
            "SELECT current_database()").fetchone()
        with pytest.raises(duckdb.ConnectionException) as refused:
            instances.attach(a, read_only=False)
    duckdb.connect(a).close()  # (DuckDB's own: the same refusal, the other way round)
    held = duckdb.connect(a)
    try:
        with pytest.raises(duckdb.ConnectionException) as theirs:
            duckdb.connect(a, read_only=True)
    finally:
        held.close()
    assert str(refused.value) == str(theirs.value)


def test_a_file_let_go_is_whole_and_free_for_another_process(two_stores):
    a, _ = two_stores
    with write_connection(a) as con:
        con.execute("CREATE TABLE extra AS SELECT range AS x FROM range(1000)")
        assert os.path.exists(f"{a}.wal")
        other = subprocess.run([sys.executable, "-c", f"import duckdb; duckdb.connect({a!r}, read_only=True)"],
                               capture_output=True, text=True, timeout=60, check=False)
        assert other.returncode != 0 and "lock" in other.stderr  # held while attached
    assert not os.path.exists(f"{a}.wal")  # checkpointed as the last connection closed
    script = f"import duckdb; print(duckdb.connect({a!r}).execute('SELECT sum(x) FROM extra').fetchone())"
    other = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert other.stdout.strip() == "(499500,)", other.stderr


def test_an_instance_serves_the_next_file_with_none_of_the_last_ones_settings_or_tables(two_stores):
    a, b = two_stores
    with read_connection(a) as con:
        defaults = _settings(con)
    assert defaults["temp_directory"] == os.path.realpath(a) + ".tmp"  # DuckDB's own, for a file it opens
    with write_connection(a) as con:
        con.execute("SET threads = 1")
        con.execute("SET memory_limit = '123MB'")
        con.execute("SET checkpoint_threshold = '99MB'")
        changed = _settings(con)
        seen_a = _databases(con)
    assert changed != defaults
    with read_connection(b) as con:
        after = _settings(con)
        seen_b = _databases(con)
        assert con.execute("SELECT count(*) FROM runs").fetchone() == (0,)
    assert after == {**defaults, "temp_directory": os.path.realpath(b) + ".tmp"}
    assert len(seen_a) == len(seen_b) == 2 and seen_a != seen_b  # (the store's and DuckDB's own "memory")


def test_a_failed_open_leaves_nothing_attached_and_the_next_open_works(tmp_path, two_stores):
    a, _ = two_stores
    with pytest.raises(duckdb.IOException, match="does not exist"):
        instances.attach(str(tmp_path / "missing.duckdb"), read_only=True)
    assert not (tmp_path / "missing.duckdb").exists()
    with write_connection(a) as con:
        assert _databases(con) == sorted([con.execute("SELECT current_database()").fetchone()[0], "memory"])
    assert read.runs(a).height == 0


def test_a_forked_child_is_refused_the_file_its_parent_holds_not_handed_the_parents_instance(two_stores):
    """``duckdb.connect`` in a child forked while the parent held the file handed the child
    the parent's instance (DuckDB's instance cache is copied with the process): its writes
    went nowhere the parent could see, unchecked by any lock. Attached, the child is refused."""
    a, _ = two_stores
    with write_connection(a):
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                instances.attach(a, read_only=False).execute("CREATE TABLE childs AS SELECT 1 AS x")
            except duckdb.Error as err:
                code = 0 if str(err) == instances.HELD_BY_PARENT else 4
            except BaseException:
                code = 5
            os._exit(code)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    with read_connection(a) as con:
        assert con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'childs'").fetchone() == (0,)



def test_a_file_this_process_opened_with_duckdb_connect_is_reached_through_that_instance(two_stores):
    """A notebook's own ``duckdb.connect`` beside kvtrace's reads: the read shares its instance
    in the same mode and is refused in the other, in DuckDB's words each time, as before (the
    attach's refusal named a new internal database at each try: a collector telling each
    reason once told it at every request)."""
    a, b = two_stores
    theirs = duckdb.connect(a, read_only=True)
    try:
        assert read.runs(a).height == 0
        with read_connection(a) as con:
            assert con.execute("SELECT count(*) FROM runs").fetchone() == (0,)
    finally:
        theirs.close()
    theirs = duckdb.connect(b)
    try:
        refusals = set()
        for _ in range(2):
            with pytest.raises(duckdb.ConnectionException) as refused:
                instances.attach(b, read_only=True)
            refusals.add(str(refused.value))
    finally:
        theirs.close()
    assert refusals == {instances.SAME_FILE_OTHER_MODE}
    with read_connection(b) as con:  # (and nothing was left attached by the refusals)
        assert con.execute("SELECT count(*) FROM runs").fetchone() == (0,)
