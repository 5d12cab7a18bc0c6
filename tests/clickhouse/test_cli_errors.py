"""A ClickHouse --db a user gets wrong: one ``kvtrace: error:`` line naming it, exit 2."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.test_bad_input import assert_one_line, run


@pytest.mark.parametrize(("argv", "needles"), [
    (["runs", "--db", "chdb:{tmp}/missing"], ["missing", "no such chdb directory"]),
    (["export", "--db", "chdb:{tmp}/missing", "--run", "r1", "--parquet", "{tmp}/out"], ["no such chdb directory"]),
    (["runs", "--db", "clickhouse://kv:pw@127.0.0.1:1/otel"], ["clickhouse://kv@127.0.0.1:1/otel",
                                                                 "cannot connect to ClickHouse"]),
    (["runs", "--db", "clickhouse://127.0.0.1/otel?ttl=3"], ["--db", "unknown option"]),
    (["diff", "r1", "r2", "--db", "chdb:"], ["--db", "chdb:PATH"]),
    # port 0 was read as no port, and 8123 dialled; the last of two otel_tables was taken unsaid
    (["runs", "--db", "clickhouse://kv:pw@127.0.0.1:0/otel"], ["--db", "the port must be a number from 1 to 65535"]),
    (["runs", "--db", "clickhouse://kv@127.0.0.1:99999/otel"], ["--db", "the port must be a number from 1 to 65535"]),
    (["runs", "--db", "clickhouse://127.0.0.1:1/otel?otel_table="], ["otel_table must be a table name"]),
    (["runs", "--db", "chdb:{tmp}/s?otel_table="], ["--db", "otel_table must be a table name"]),
    (["runs", "--db", "chdb:{tmp}/s?otel_table=a&otel_table=b"], ["--db", "otel_table is given 2 times"]),
    (["runs", "--db", "clickhouse://127.0.0.1:1/otel?otel_table=a&otel_table=b"], ["otel_table is given 2 times"]),
    # an IPv6 host is named as a URL writes it (clickhouse://kv@::1:1/otel read as port 1 of host ::1:1?)
    (["runs", "--db", "clickhouse://kv:pw@[::1]:1/otel"], ["clickhouse://kv@[::1]:1/otel: cannot connect"]),
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


def test_a_read_of_a_plain_directory_leaves_it_as_it_was(tmp_path):
    """``runs`` and ``export`` on a directory that is no chdb store (empty, or a Parquet
    export) refused it, but chdb had made its tmp/ there first."""
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "runs.parquet").write_bytes(b"PAR1")
    for argv in (["runs", "--db", f"chdb:{plain}"],
                 ["export", "--run", "r1", "--db", f"chdb:{plain}", "--parquet", str(tmp_path / "x")]):
        done = _kvtrace(*argv)
        assert done.returncode == 2 and "not a kvtrace store" in done.stderr, done.stderr
    assert sorted(p.name for p in plain.iterdir()) == ["runs.parquet"]


def _kvtrace(*argv: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtrace.cli", *argv], capture_output=True, text=True,
                          timeout=180, check=False, **kwargs)


def _chdb(path, *queries: str) -> None:
    """``queries`` on the chdb directory, in a process of their own (chdb: one directory a process)."""
    code = ("import sys\nfrom chdb import session as chs\ns = chs.Session(sys.argv[1])\n"
            "for q in sys.argv[2:]:\n    s.query(q, 'CSV')\ns.close()\n")
    subprocess.run([sys.executable, "-c", code, str(path), *queries], check=True, timeout=120)


@pytest.fixture(scope="module")
def _chat_chdb(tmp_path_factory) -> Path:
    """A chdb store holding one finished run r1 (``kvtrace replay gen:chat --mode cache-only
    --limit 5``), recorded once for the module by a real process; never written to (a case
    takes its own copy, ``_chat_store``)."""
    store = tmp_path_factory.mktemp("chat") / "made"
    made = _kvtrace("replay", "gen:chat", "--mode", "cache-only", "--limit", "5", "--db", f"chdb:{store}")
    assert made.returncode == 0, made.stderr
    return store


def _chat_store(made: Path, to: Path) -> Path:
    """A copy of the module's recorded store at ``to``, the case's own (chdb's table links
    in the directory are relative: the copy opens as a store of its own)."""
    shutil.copytree(made, to, symlinks=True)
    return to


def test_a_schema_version_that_is_no_integer_is_a_damaged_store(tmp_path):
    _chdb(tmp_path / "m", "CREATE TABLE kvtrace_meta (key String, value String) ENGINE = MergeTree ORDER BY key",
          "INSERT INTO kvtrace_meta VALUES ('magic', 'kvtrace-store'), ('schema_version', 'abc')")
    proc = _kvtrace("runs", "--db", f"chdb:{tmp_path}/m")
    assert_one_line(proc.returncode, proc.stderr, "damaged kvtrace store",
                    "schema_version is 'abc', not a version number")


def test_a_directory_chdb_cannot_start_on_is_its_cause_not_busy(tmp_path):
    # chdb's own error names no cause; a damaged metadata file was retried for 30 s as a
    # directory another process holds, printing chdb's lines from every try
    _chdb(tmp_path / "s", "CREATE TABLE runs (x Int64) ENGINE = MergeTree ORDER BY x")
    (sql,) = [p for p in (tmp_path / "s").rglob("runs.sql")]
    sql.write_text("")
    proc = _kvtrace("runs", "--db", f"chdb:{tmp_path}/s")
    assert_one_line(proc.returncode, proc.stderr, "cannot open as a chdb store", "Empty query")
    assert "another process" not in proc.stderr


def test_an_opener_waiting_for_a_held_directory_prints_nothing_of_chdbs(tmp_path, _chat_chdb):
    store = f"chdb:{_chat_store(_chat_chdb, tmp_path / 'w')}"
    hold = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom chdb import session as chs\n"
                             "s = chs.Session(sys.argv[1])\nprint('held', flush=True)\ntime.sleep(3)\ns.close()\n",
                             str(tmp_path / "w")], stdout=subprocess.PIPE, text=True)
    try:
        assert hold.stdout.readline().strip() == "held"
        proc = _kvtrace("runs", "--db", store, "--json")  # waits for the holder, then reads
    finally:
        hold.wait(timeout=60)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert '"run_id": "r1"' in proc.stdout


@pytest.mark.parametrize("inside", ["", "metadata/default"])
def test_an_export_into_a_chdb_stores_own_directory_is_refused(tmp_path, inside, _chat_chdb):
    store = _chat_store(_chat_chdb, tmp_path / "e")
    proc = _kvtrace("export", "--db", f"chdb:{store}", "--run", "r1", "--parquet", str(store / inside))
    assert_one_line(proc.returncode, proc.stderr, "is the store", "export somewhere else")
    assert not list(store.rglob("*.parquet"))
    assert _kvtrace("runs", "--db", f"chdb:{store}").returncode == 0  # (it opens as before)


def test_data_parts_chdb_sets_aside_as_broken_make_a_damaged_store(tmp_path, _chat_chdb):
    # truncated data.bin files: chdb detached the parts on open and every read came up short
    # (an export of a third of the spans, exit 0)
    store = _chat_store(_chat_chdb, tmp_path / "t")
    assert list(store.rglob("data.bin"))  # (there are parts to damage)
    for data in store.rglob("data.bin"):
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    for argv in (["runs"], ["export", "--run", "r1", "--parquet", str(tmp_path / "out")]):
        proc = _kvtrace(*argv, "--db", f"chdb:{store}")
        assert_one_line(proc.returncode, proc.stderr, "damaged kvtrace store", "set them aside as broken")
    assert not (tmp_path / "out").exists()


def test_a_dropped_column_or_table_is_a_damaged_store_before_an_export_writes(tmp_path, _chat_chdb):
    """As DuckDB's layout check: a chdb store without runs.name was exported as if whole (a
    runs.parquet without it, exit 0), while `runs` failed on ClickHouse's own SQL error."""
    store = f"chdb:{_chat_store(_chat_chdb, tmp_path / 's')}"
    _chdb(tmp_path / "s", "ALTER TABLE runs DROP COLUMN name", "DROP TABLE span_stats")
    out = tmp_path / "out"
    for argv in (["runs"], ["export", "--run", "r1", "--parquet", str(out)]):
        proc = _kvtrace(*argv, "--db", store)
        assert_one_line(proc.returncode, proc.stderr, "damaged kvtrace store: column runs.name is missing; "
                                                      "table span_stats is missing")
    assert not out.exists()


def test_the_layout_check_is_kept_per_catalog_state_and_sees_later_damage(tmp_path, _chat_chdb):
    """Checked once per state of the store's catalog (a check costs about 25 ms, and every
    dashboard query opens the store), yet a column dropped after it is still found. In a
    process of its own: chdb opens one directory a process."""
    store = f"chdb:{_chat_store(_chat_chdb, tmp_path / 's')}"
    script = f"""
import subprocess, sys
from kvtrace.store import read
from kvtrace.store.clickhouse import client, tables
from kvtrace.store.errors import StoreError
checks, real = [], tables._check_columns
tables._check_columns = lambda *a: (checks.append(1), real(*a))[1]
assert read.runs({store!r}).height == 1 and read.runs({store!r}).height == 1
assert len(checks) == 1, checks
client._close_idle()
subprocess.run([sys.executable, "-c", "from chdb import session as c; s = c.Session({str(tmp_path / 's')!r}); "
                "s.query('ALTER TABLE runs DROP COLUMN name'); s.close()"], check=True)
try:
    read.runs({store!r})
except StoreError as err:
    print(err)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "damaged kvtrace store: column runs.name is missing" in proc.stdout, proc.stdout


def test_a_chdb_stores_content_state_changes_with_its_rows(tmp_path, _chat_chdb):
    """``content_state`` (the dashboard's cache key) of a chdb store: equal while nothing is
    written, different after another run is recorded (new parts, no new table)."""
    from kvtrace.store.state import content_state

    store = f"chdb:{_chat_store(_chat_chdb, tmp_path / 's')}"  # (one run recorded)
    replay = ("replay", "gen:chat", "--limit", "3", "--mode", "cache-only", "--db", store)
    before = content_state(store)
    assert before is not None and before == content_state(store)
    assert _kvtrace(*replay).returncode == 0
    assert content_state(store) not in (None, before)
    assert content_state(f"chdb:{tmp_path}/missing") is None
    assert content_state("clickhouse://127.0.0.1:1/db") is None  # a server: not told by files


def test_the_dashboard_never_makes_a_chdb_store(tmp_path):
    """As ``kvtrace runs``: a missing chdb directory, or one that holds no store, is one
    line, and nothing is written beside the user's own files (a server was started on a
    new store there)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    for target, needle in ((tmp_path / "missing", "no such chdb directory"), (mine, "not a kvtrace store")):
        proc = _kvtrace("dashboard", "--db", f"chdb:{target}", "--port", port)
        assert_one_line(proc.returncode, proc.stderr, needle)
    assert not (tmp_path / "missing").exists()
    assert not {"data", "metadata", "store"} & {p.name for p in mine.iterdir()}
