"""``kvtrace export``: a failed export is one line naming the store or the output path, and
leaves no file or folder it created; the files of a good one appear whole."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import polars as pl
import pytest

from tests.cli.support import assert_one_line
from tests.cli.support import run as _cli

ROOT = Path(__file__).resolve().parents[2]


def _one_line(code: int, err: str, *needles: str) -> str:
    line = assert_one_line(code, err, *needles)
    assert "errno" not in line and "{" not in line  # (no DuckDB JSON debris)
    return line


@pytest.fixture()
def work(tmp_path, monkeypatch, replayed_store):
    """A folder holding only a copy of a real store (so a stray file is seen), as the cwd."""
    db = tmp_path / "s.duckdb"
    shutil.copy(replayed_store.path, db)
    monkeypatch.chdir(tmp_path)
    return tmp_path, db, replayed_store.run_on


def _entries(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize("run", ["r1' OR '1'='1", "", "no-such-run"])
def test_an_unknown_run_leaves_no_folder(work, capsys, run):
    tmp, db, _ = work
    code, _, err = _cli(["export", "--db", str(db), "--run", run, "--parquet", "exps1/deeper"], capsys)
    _one_line(code, err, str(db), "no run with id")
    assert _entries(tmp) == ["s.duckdb"]


@pytest.mark.parametrize("content", ["text", "foreign"])
def test_a_file_that_is_no_store_leaves_no_folder(tmp_path, monkeypatch, capsys, content):
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "x.duckdb"
    if content == "text":
        db.write_text("hello\n")
    else:
        con = duckdb.connect(str(db))
        con.execute("CREATE TABLE unrelated (a INTEGER)")
        con.close()
    code, _, err = _cli(["export", "--db", str(db), "--run", "r1", "--parquet", "exps"], capsys)
    _one_line(code, err, str(db))
    assert _entries(tmp_path) == ["x.duckdb"]


@pytest.mark.parametrize("path", ["", " "])
def test_an_empty_output_path_is_refused(work, capsys, path):
    tmp, db, run = work
    code, _, err = _cli(["export", "--db", str(db), "--run", run, "--parquet", path], capsys)
    _one_line(code, err, "--parquet", "empty path")
    assert _entries(tmp) == ["s.duckdb"]  # nothing exported into the current directory


def test_an_output_path_that_is_a_file_is_refused(work, capsys):
    tmp, db, run = work
    (tmp / "taken").write_text("mine\n")
    code, _, err = _cli(["export", "--db", str(db), "--run", run, "--parquet", "taken"], capsys)
    _one_line(code, err, "taken", "not a directory")
    assert (tmp / "taken").read_text() == "mine\n"


def test_a_good_export_prints_the_files_and_leaves_no_temporary_file(work, capsys, replayed_store):
    tmp, db, run = work
    code, out, err = _cli(["export", "--db", str(db), "--run", run, "--parquet", "a/b"], capsys)
    assert code == 0, err
    names = ["spans.parquet", "runs.parquet", "evicted_blocks.parquet"]
    assert out.split() == [str(Path("a/b") / n) for n in names]
    assert sorted(os.listdir(tmp / "a" / "b")) == sorted(names)
    assert pl.read_parquet(tmp / "a" / "b" / "spans.parquet").height == replayed_store.summary_on["spans"]
    assert oct((tmp / "a" / "b" / "spans.parquet").stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_an_earlier_export_is_replaced_only_by_a_whole_one(work, monkeypatch):
    from kvtrace.store import export as export_module
    from kvtrace.store import export_parquet

    tmp, db, run = work
    out = tmp / "out"
    export_parquet(db, run, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def full(table: str, target: Path) -> None:  # the second table meets a full disk
        if table == "runs":
            raise OSError(28, os.strerror(28))
        target.write_bytes(b"partial")

    monkeypatch.setattr(export_module, "_write_all", _failing_writer(export_module._write_all, full))
    with pytest.raises(Exception, match=f"{out}: cannot write the export: No space left on device"):
        export_parquet(db, run, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the earlier files, untouched


_STOPS_AFTER_ONE_TABLE = """
import sys, time
from pathlib import Path
from kvtrace.store import export as export_module
from kvtrace.store import export_parquet

write_all = export_module._write_all

def stalled(out_dir, write):
    def first_then_wait(table, target):
        write(table, target)
        Path(sys.argv[4]).write_text(str(target))
        time.sleep(600)  # the test kills us here
    return write_all(out_dir, first_then_wait)

export_module._write_all = stalled
export_parquet(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
"""


def test_an_export_killed_9_leaves_no_hidden_file_once_exported_again(work, capsys):
    """kill -9 mid-export left its hidden ``.TABLE....parquet.tmp`` files for good (nothing
    cleans up after a kill, and each export picked new names). The next export into the
    folder removes a dead export's."""
    import signal

    from tests.support.processes import reaped, wait_until

    tmp, db, run = work
    out, marker = tmp / "out", tmp / "written"
    proc = subprocess.Popen([sys.executable, "-c", _STOPS_AFTER_ONE_TABLE, str(db), run, str(out), str(marker)],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)
    with reaped(proc):
        wait_until(proc, marker.exists, "the export never wrote its first table")
        os.kill(proc.pid, signal.SIGKILL)
    assert Path(marker.read_text()).exists()  # what the kill left
    code, _, err = _cli(["export", "--db", str(db), "--run", run, "--parquet", str(out)], capsys)
    assert code == 0, err
    assert sorted(os.listdir(out)) == ["evicted_blocks.parquet", "runs.parquet", "spans.parquet"]


def _failing_writer(write_all, write):
    return lambda out_dir, _: write_all(out_dir, write)


def _can_mount_tmpfs(tmp_path: Path) -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {tmp_path}"],
                           capture_output=True, check=False)
    return probe.returncode == 0


@pytest.mark.skipif(sys.platform != "linux", reason="a full file system through a tmpfs in a mount namespace")
def test_a_full_disk_names_the_output_path_in_one_clean_line(tmp_path, replayed_store):
    full = tmp_path / "full"
    full.mkdir()
    if not _can_mount_tmpfs(full):
        pytest.skip("cannot mount a tmpfs here (unshare -rm)")
    db = tmp_path / "s.duckdb"
    shutil.copy(replayed_store.path, db)
    script = (f"mount -t tmpfs -o size=64k tmpfs {full} && dd if=/dev/zero of={full}/fill bs=4k 2>/dev/null; "
              f"{sys.executable} -m kvtrace.cli export --db {db} --run {replayed_store.run_on} "
              f"--parquet {full}/out/deeper; echo rc=$? >&2; ls -A {full}")
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, check=False)
    err = proc.stderr.strip().splitlines()
    assert err[-1] == "rc=2", proc.stderr
    line = _one_line(2, "\n".join(err[:-1]), f"{full}/out/deeper", "No space left on device")
    assert str(db) not in line
    assert proc.stdout.split() == ["fill"]  # no out/ folder, no partial file


def test_a_rename_that_fails_midway_puts_the_earlier_export_back(work, monkeypatch):
    """The third of three renames failing left two files of the new run beside one of the
    old (any target a rename cannot replace)."""
    from kvtrace.store import export as export_module
    from kvtrace.store import export_parquet

    tmp, db, run = work
    out = tmp / "out"
    export_parquet(db, run, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real_replace, renames = os.replace, []

    def third_fails(src, dst):
        if str(dst).endswith(".parquet"):  # a new file into place
            renames.append(dst)
            if len(renames) == 3:
                raise OSError(16, os.strerror(16))
        return real_replace(src, dst)

    monkeypatch.setattr(export_module.os, "replace", third_fails)
    with pytest.raises(Exception, match=f"{out}: cannot write the export: Device or resource busy"):
        export_parquet(db, "r1" if run != "r1" else "r2", out)
    monkeypatch.setattr(export_module.os, "replace", real_replace)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the earlier export whole, nothing else


def test_a_target_that_is_a_directory_is_refused_before_any_file_is_replaced(work, capsys):
    tmp, db, run = work
    out = tmp / "out"
    assert _cli(["export", "--db", str(db), "--run", run, "--parquet", str(out)], capsys)[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (out / "spans.parquet").unlink()
    (out / "spans.parquet").mkdir()
    code, _, err = _cli(["export", "--db", str(db), "--run", run, "--parquet", str(out)], capsys)
    _one_line(code, err, "spans.parquet: is a directory; the export would not replace it")
    del before["spans.parquet"]
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_an_export_path_too_long_to_name_is_one_line(work, capsys):
    tmp, db, run = work
    code, _, err = _cli(["export", "--db", str(db), "--run", run, "--parquet", "a" * 300], capsys)
    _one_line(code, err, "cannot use as export directory: File name too long")


def test_an_export_renaming_its_files_holds_off_another_exports_renames(work, monkeypatch):
    """Two exports into one folder could interleave their renames: one run's spans.parquet beside
    another run's runs.parquet. While one export is between its renames, another cannot begin its
    own (an exclusive flock on the folder, which this test tries without waiting)."""
    import fcntl
    import threading

    import pyarrow.parquet as pq

    from kvtrace.store import export as export_module
    from kvtrace.store import export_parquet

    tmp, db, run = work
    other = "r1" if run != "r1" else "r2"
    out = tmp / "out"
    out.mkdir()
    real_replace, midway, go = os.replace, threading.Event(), threading.Event()

    def paused_after_the_first(src, dst):
        real_replace(src, dst)
        if str(dst).endswith("spans.parquet"):
            midway.set()
            go.wait(60)

    monkeypatch.setattr(export_module.os, "replace", paused_after_the_first)
    first = threading.Thread(target=export_parquet, args=(db, other, out))
    first.start()
    try:
        assert midway.wait(120), "the first export never renamed its spans"
        fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with pytest.raises(BlockingIOError):  # another export's renames would wait here
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    finally:
        go.set()
        first.join()
    monkeypatch.setattr(export_module.os, "replace", real_replace)
    export_parquet(db, run, out)  # (the lock was let go: the next export is not held off)
    assert {pq.read_table(out / f"{t}.parquet").column("run_id").to_pylist()[0] for t in ("spans", "runs")} == {run}


def test_a_folder_locked_past_the_timeout_is_one_line_and_nothing_replaced(work, capsys, monkeypatch):
    """A stopped export, or another program's flock on the folder, held every later export
    without end and without a word."""
    import fcntl

    from kvtrace.store import export as export_module

    tmp, db, run = work
    out = tmp / "out"
    out.mkdir()
    (out / "runs.parquet").write_bytes(b"PAR1 an earlier export")
    monkeypatch.setattr(export_module, "RENAME_LOCK_TIMEOUT_S", 0.3)
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        code, _, err = _cli(["export", "--db", str(db), "--run", run, "--parquet", str(out)], capsys)
    finally:
        os.close(fd)
    _one_line(code, err, str(out), "another process has held its lock for 0.3 s")
    assert _entries(out) == ["runs.parquet"] and (out / "runs.parquet").read_bytes() == b"PAR1 an earlier export"


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs util-linux's setpriv to drop root")
def test_a_folder_its_user_may_write_but_not_read_takes_the_export():
    """A folder of mode 0300 (write and search, no read) cannot be opened to lock: the export
    was refused ('Permission denied') where it wrote its files before the lock."""
    import tempfile

    with tempfile.TemporaryDirectory(dir="/tmp") as base:  # (pytest's tmp_path is root's alone)
        home = Path(base) / "home"
        home.mkdir()
        os.chmod(base, 0o755)
        _export_as_nobody(home)


def _export_as_nobody(home: Path) -> None:
    import pyarrow.parquet as pq

    from kvtrace.replay.run import RunSpec, run_replay

    db = home / "s.duckdb"
    run = run_replay(RunSpec("gen:chat", limit=2, mode="cache-only"), db=str(db)).run_id
    out = home / "wx"
    out.mkdir()
    for p in (home, db, out):
        os.chown(p, 65534, 65534)
    out.chmod(0o300)
    kvtrace = str(Path(sys.executable).with_name("kvtrace"))
    done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", kvtrace, "export",
                           "--db", str(db), "--run", str(run), "--parquet", str(out)],
                          check=False, capture_output=True, text=True, timeout=120, cwd=home)
    assert done.returncode == 0, done.stderr
    out.chmod(0o700)
    assert pq.read_table(out / "runs.parquet").column("run_id").to_pylist() == [run]
