"""``kvtrace demo --db PATH``: what is at PATH before the demo, and what is there after it.

Anything that is not an earlier demo store (a FIFO, a device, a socket, a directory) is
refused with one line before any replay; a symbolic link is written through and stays a
link; an earlier demo store stays exactly as it was until the new demo has finished, and
an interrupted or failed demo leaves nothing of its own behind.
"""

from __future__ import annotations

import hashlib
import io
import os
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from kvtrace.compare import demo
from kvtrace.compare.demo import run_demo
from kvtrace.errors import KVTraceError
from kvtrace.store import read
from tests.cli.support import run

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 8  # requests per replay: a demo in seconds


def _demo(db, **kwargs) -> demo.DemoResult:
    return run_demo(db, progress=False, console=Console(file=io.StringIO()), limit=LIMIT, **kwargs)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _no_replay(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a replay ran before --db was checked")

    monkeypatch.setattr(demo, "run_replay", refuse)


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    code, _, err = run(argv, capsys)
    return code, err


@pytest.fixture(scope="module")
def earlier_demo(tmp_path_factory) -> Path:
    """A complete demo store (four runs), copied by each test that replaces one."""
    db = tmp_path_factory.mktemp("earlier") / "demo.duckdb"
    _demo(db)
    return db


def _copy(src: Path, dst: Path) -> Path:
    dst.write_bytes(src.read_bytes())
    return dst


def _special(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / f"the-{kind}"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()
    elif kind == "device":
        try:
            os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # the numbers of /dev/null
        except PermissionError:
            pytest.skip("creating a character device needs privileges")
    return path


@pytest.mark.parametrize(("kind", "what"), [("fifo", "is a FIFO"), ("device", "is a character device"),
                                            ("socket", "is a socket"), ("directory", "is a directory")])
def test_what_is_not_a_file_is_refused_before_any_replay(tmp_path, monkeypatch, capsys, kind, what):
    path = _special(tmp_path, kind)
    mode = path.lstat().st_mode
    _no_replay(monkeypatch)
    code, err = _cli(["demo", "--db", str(path)], capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvtrace: error: {path}: {what}"), err
    assert "Traceback" not in err
    assert path.lstat().st_mode == mode  # still what it was
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # nothing of the demo's


def test_a_link_to_a_device_is_refused(tmp_path, monkeypatch):
    device = _special(tmp_path, "fifo")
    link = tmp_path / "link.duckdb"
    link.symlink_to(device)
    _no_replay(monkeypatch)
    with pytest.raises(KVTraceError, match="is a FIFO"):
        _demo(link)
    assert link.is_symlink() and stat.S_ISFIFO(device.stat().st_mode)


def test_a_link_to_an_earlier_demo_store_is_written_through(tmp_path, earlier_demo):
    target = _copy(earlier_demo, tmp_path / "target.duckdb")
    target.chmod(0o640)
    link = tmp_path / "link.duckdb"
    link.symlink_to(target.name)
    res = _demo(link, seed=1)  # another seed: another store
    assert link.is_symlink() and os.readlink(link) == target.name  # the link stays a link
    assert _digest(target) != _digest(earlier_demo)  # ... to the new store
    runs = read.runs(link)
    assert runs.height == 4 and set(runs["status"]) == {"complete"}
    assert stat.S_IMODE(target.stat().st_mode) == 0o640  # the replaced file's permissions
    assert res.dashboard_command == f"kvtrace dashboard --db {link}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.duckdb", "target.duckdb"]


def test_a_dangling_link_is_written_through_when_its_folder_exists(tmp_path, monkeypatch):
    link = tmp_path / "link.duckdb"
    link.symlink_to("new.duckdb")
    _demo(link)
    assert link.is_symlink() and read.runs(tmp_path / "new.duckdb").height == 4

    nowhere = tmp_path / "nowhere.duckdb"
    nowhere.symlink_to(tmp_path / "missing" / "x.duckdb")
    _no_replay(monkeypatch)
    with pytest.raises(KVTraceError, match="whose folder does not exist"):
        _demo(nowhere)
    assert nowhere.is_symlink() and not (tmp_path / "missing").exists()


def test_a_missing_folder_is_refused_before_any_replay(tmp_path, monkeypatch):
    _no_replay(monkeypatch)
    with pytest.raises(KVTraceError, match="does not exist"):
        _demo(tmp_path / "missing" / "demo.duckdb")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_demo_leaves_the_earlier_store_and_nothing_else(tmp_path, monkeypatch, earlier_demo):
    db = _copy(earlier_demo, tmp_path / "demo.duckdb")
    before = _digest(db)
    replay, calls = demo.run_replay, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KVTraceError("the third replay failed")
        return replay(*args, **kwargs)

    monkeypatch.setattr(demo, "run_replay", failing)
    with pytest.raises(KVTraceError, match="third replay"):
        _demo(db)
    assert _digest(db) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo.duckdb"]
    # neither signal the demo holds is left held (SIGPIPE may be, by a library an earlier test loaded)
    assert not signal.pthread_sigmask(signal.SIG_BLOCK, set()) & {signal.SIGINT, signal.SIGTERM}


@pytest.mark.parametrize(("sig", "when", "code", "line"), [
    ("TERM", "run", 143, "terminated (SIGTERM)"),  # after the first run is recorded whole
    ("TERM", "commit", 143, "terminated (SIGTERM)"),  # in the middle of the second run
    ("INT", "commit", 130, "interrupted"),
])
def test_an_interrupted_demo_leaves_the_earlier_store_as_it_was(tmp_path, earlier_demo, sig, when, code, line):
    db = _copy(earlier_demo, tmp_path / "demo.duckdb")
    before = _digest(db)
    marker = tmp_path.parent / f"{tmp_path.name}.signalled"
    n = "1" if when == "run" else "4"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.compare.demo_signal_driver", sig, when, n, str(LIMIT), "--",
         "demo", "--db", str(db)],
        check=False, capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, "DEMO_DRIVER_MARKER": str(marker)})
    assert marker.read_text() == "signalled", proc.stderr  # the signal came at its point, not after the demo
    assert proc.returncode == code, proc.stderr
    errors = [x for x in proc.stderr.splitlines() if x.startswith("kvtrace: error:")]
    assert errors == [proc.stderr.strip().splitlines()[-1]] == [f"kvtrace: error: {line}"], proc.stderr
    assert "Traceback" not in proc.stderr
    assert _digest(db) == before  # not one byte of the earlier store changed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo.duckdb"]  # no temporary file left


def test_the_demo_cli_still_replaces_an_earlier_demo(tmp_path, earlier_demo):
    db = _copy(earlier_demo, tmp_path / "demo.duckdb")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.compare.demo_signal_driver", "TERM", "run", "99", str(LIMIT), "--",
         "demo", "--db", str(db)],
        check=False, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    # one line, whole, however long the path (a piped console is 80 columns): copy-pastable
    assert proc.stdout.rstrip().splitlines()[-1] == f"kvtrace dashboard --db {db}", proc.stdout
    assert "…" not in proc.stdout  # piped, the tables are laid out wide: no metric or run name cut
    runs = read.runs(db)
    assert runs.height == 4 and set(runs["status"]) == {"complete"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo.duckdb"]



def test_a_run_another_command_records_while_the_demo_runs_is_kept(tmp_path, monkeypatch, earlier_demo, capsys):
    """The demo checked the store only before its replays, then renamed its new store over
    it: a run another command recorded meanwhile was gone, after that command said
    'recorded'."""
    db = _copy(earlier_demo, tmp_path / "demo.duckdb")
    replay, calls = demo.run_replay, []

    def with_another_writer(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # meanwhile, another command records a run in the same store
            code, err = _cli(["replay", "gen:chat", "--limit", "2", "--mode", "cache-only", "--db", str(db)], capsys)
            assert code == 0, err
        return replay(*args, **kwargs)

    monkeypatch.setattr(demo, "run_replay", with_another_writer)
    with pytest.raises(KVTraceError, match="that are not the demo's"):
        _demo(db)
    names = read.runs(db)["name"].to_list()
    assert len(names) == 5 and sum(not n.startswith("demo: ") for n in names) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo.duckdb"]


def test_a_store_with_curves_is_refused_before_any_replay(tmp_path, monkeypatch):
    # an empty run list made a store of curves pass for a demo store: they were dropped
    from kvtrace.replay.curve import run_curve
    from kvtrace.replay.run import RunSpec

    db = tmp_path / "curves.duckdb"
    run_curve(RunSpec(str(ROOT / "tests" / "data" / "mooncake_synthetic_trace.jsonl"), mode="cache-only", limit=20),
              "10,inf", db=db)
    before = _digest(db)
    _no_replay(monkeypatch)
    with pytest.raises(KVTraceError, match="holds 1 capacity curve"):
        _demo(db)
    assert _digest(db) == before


@pytest.mark.parametrize("ddl", ["CREATE TABLE mynotes (t VARCHAR)",
                                 "CREATE SCHEMA mine; CREATE VIEW mine.v AS SELECT 1",
                                 "CREATE VIEW last_runs AS SELECT * FROM runs"])
def test_a_demo_store_holding_a_users_own_tables_is_refused(tmp_path, monkeypatch, earlier_demo, ddl):
    """An earlier demo store where the user added a table or view of their own: the demo
    replaced the file and dropped it."""
    import duckdb

    db = _copy(earlier_demo, tmp_path / "demo.duckdb")
    with duckdb.connect(str(db)) as con:
        con.execute(ddl)
    before = _digest(db)
    _no_replay(monkeypatch)
    with pytest.raises(KVTraceError, match="that are not kvtrace's"):
        _demo(db)
    assert _digest(db) == before


def test_a_demo_store_of_an_older_schema_is_replaced(tmp_path, earlier_demo):
    """A demo store from the previous release (schema version 2): its derived tables were
    called a user's own ("holds 8 table(s) or view(s) that are not kvtrace's (e.g.
    'main.block_values')") and the demo refused to replace it."""
    import duckdb

    from kvtrace.store.schema import META_TABLE, SCHEMA_VERSION

    db = _copy(earlier_demo, tmp_path / "demo.duckdb")
    with duckdb.connect(str(db)) as con:
        con.execute(f"UPDATE {META_TABLE} SET value = '2' WHERE key = 'schema_version'")
    _demo(db)
    assert read.runs(db).height == 4
    with duckdb.connect(str(db), read_only=True) as con:
        version = con.execute(f"SELECT value FROM {META_TABLE} WHERE key = 'schema_version'").fetchone()
    assert version == (str(SCHEMA_VERSION),)


def test_a_run_named_like_the_demos_on_another_trace_is_not_the_demos(tmp_path, monkeypatch):
    from kvtrace.replay.run import RunSpec, run_replay

    db = tmp_path / "mine.duckdb"
    run_replay(RunSpec("gen:chat", limit=3, name="demo: my important baseline"), db=db)
    _no_replay(monkeypatch)
    with pytest.raises(KVTraceError, match=r"not the demo's .*my important baseline"):
        _demo(db)
    assert read.runs(db)["name"].to_list() == ["demo: my important baseline"]


def test_a_url_like_path_is_refused_as_every_store_command_refuses_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, err = _cli(["demo", "--db", "md:foo"], capsys)
    assert code == 2 and "DuckDB would read this as a URL" in err and not list(tmp_path.iterdir())
    assert "or chdb:DIR" in err and "expected a DuckDB file path" not in err  # (the demo takes chdb: too)


def test_scratch_left_by_a_killed_demo_is_removed_and_a_live_ones_kept(tmp_path):
    # a demo killed with -9 cleans nothing up: the next one removes what a dead process left
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    dead = tmp_path / f".kvtrace-demo-{gone}-abcd"
    (dead / "sub").mkdir(parents=True)
    live = tmp_path / f".kvtrace-demo-{os.getppid()}-efgh"
    live.mkdir()
    db = tmp_path / ("d" * 240 + ".duckdb")  # (a long name: the scratch folder's is its own, not longer)
    _demo(db)
    assert not dead.exists() and live.exists()
    assert read.runs(db).height == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, db.name])
