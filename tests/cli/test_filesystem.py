"""The command line against the file system and the process's surroundings: outputs a user
may not write (a read-only file, a folder without write permission), a trace directory that
cannot be listed or searched, a path longer than an error line, a stdout or stderr whose
reader went away, memory running out. Each is one line and exit 2 (a closed stdout: 141,
silently), and nothing already written is lost.

Permissions are the kernel's for an unprivileged user; as root (who may write anything),
``os.access`` and the listing are made to answer as they would for one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.support import assert_one_line, run
from tests.support.permissions import read_only

DATA = Path(__file__).resolve().parents[1] / "data"
TRACE = str(DATA / "mooncake_synthetic_trace.jsonl")
STEPS = str(DATA / "calibration" / "aic-h200-llama-3.1-8b-tp1.csv")
KVTRACE = [sys.executable, "-m", "kvtrace.cli"]


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name or p.name.endswith(".duckdb"))


@pytest.mark.parametrize("argv", [
    ["convert", TRACE, "--limit", "2"],
    ["generate", "chat", "--requests", "3"],
    ["calibrate", "--from", STEPS],
])
def test_a_read_only_output_is_refused_not_replaced(tmp_path, capsys, monkeypatch, argv):
    """-o wrote a temporary file and renamed it over the file: a 0444 file (or one in a
    0555 folder) the user could not write was replaced all the same."""
    out = tmp_path / "out.txt"
    out.write_text("keep me\n")
    with read_only(monkeypatch, out):
        code, _, err = run([*argv, "-o", str(out)], capsys)
    assert_one_line(code, err, str(out), "Permission denied", "read-only")
    assert out.read_text() == "keep me\n" and _leftovers(tmp_path) == []

    folder = tmp_path / "ro"
    folder.mkdir()
    with read_only(monkeypatch, folder):
        code, _, err = run([*argv, "-o", str(folder / "new.txt")], capsys)
    assert_one_line(code, err, str(folder / "new.txt"), "Permission denied")
    assert list(folder.iterdir()) == []


def test_capture_refuses_a_trace_out_it_cannot_write_before_it_records(tmp_path, capsys, monkeypatch):
    """--trace-out in a folder without write permission was found out only when the capture
    ended, after a store and a run were made for it."""
    folder = tmp_path / "ro"
    folder.mkdir()
    db = tmp_path / "cap.duckdb"
    with read_only(monkeypatch, folder):
        code, _, err = run(["capture", "vllm", "--endpoint", "tcp://127.0.0.1:9", "--db", str(db), "--duration", "1",
                            "--trace-out", str(folder / "t.jsonl")], capsys)
    assert_one_line(code, err, str(folder / "t.jsonl"), "Permission denied")
    assert not db.exists()


def _weka_copy(tmp_path: Path) -> Path:
    folder = tmp_path / "wk"
    shutil.copytree(DATA / "weka_sample", folder)
    return folder


@pytest.mark.parametrize("command", [["replay", "--mode", "cache-only"], ["convert", "-o", "OUT"]])
def test_a_trace_directory_that_cannot_be_listed_is_one_line(tmp_path, capsys, monkeypatch, command):
    """(glob found nothing in it, then os.listdir raised PermissionError: a traceback)"""
    folder = _weka_copy(tmp_path)
    real = os.listdir

    def listdir(path="."):
        if os.fspath(path) == str(folder):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real(path)

    monkeypatch.setattr(os, "listdir", listdir)
    argv = [command[0], str(folder), *(str(tmp_path / "o.jsonl") if a == "OUT" else a for a in command[1:])]
    code, _, err = run(argv, capsys)
    assert_one_line(code, err, str(folder), "cannot list the directory", "Permission denied")
    assert not (tmp_path / "o.jsonl").exists()


def test_convert_of_a_directory_whose_files_cannot_be_reached_is_one_line(tmp_path, capsys, monkeypatch):
    """A folder readable but not searchable (mode 0644): convert's own look at its files
    (Path.is_file) raised PermissionError, a traceback."""
    folder = _weka_copy(tmp_path)
    real = os.stat

    def stat_(path, *args, **kwargs):
        if os.path.dirname(os.fspath(path)) == str(folder):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat_)
    code, _, err = run(["convert", str(folder), "-o", str(tmp_path / "o.jsonl")], capsys)
    assert_one_line(code, err, "trace_0211.json", "Permission denied")
    assert not (tmp_path / "o.jsonl").exists()


def test_an_error_quoting_a_long_path_keeps_what_is_wrong(capsys):
    """A line over 1,000 characters was cut at its start: a 4,000-byte path's error showed the
    path's first 1,000 bytes and never said what was wrong with it."""
    long = "/x" * 4000
    for argv in (["runs", "--db", long], ["convert", TRACE, "-o", long]):
        code, _, err = run(argv, capsys)
        line = assert_one_line(code, err, "File name too long", "characters left out")
        assert line.startswith("kvtrace: error: /x/x/x") and len(line) < 1100


@pytest.mark.parametrize("refused", ["MemoryError", "duckdb"])
def test_running_out_of_memory_is_one_line(tmp_path, capsys, monkeypatch, refused):
    """Python's MemoryError (`ulimit -v`, a container's limit), and DuckDB's own for a query's
    block (`runs` under `ulimit -v 1000000`), were tracebacks."""
    import duckdb

    import kvtrace.replay.readers as readers

    def exhausted(*args, **kwargs):
        if refused == "duckdb":
            raise duckdb.OutOfMemoryException("Out of Memory Error: Failed to allocate block of 2097152 bytes")
        raise MemoryError

    monkeypatch.setattr(readers, "open_trace", exhausted)
    code, _, err = run(["convert", TRACE, "-o", str(tmp_path / "o.jsonl")], capsys)
    assert_one_line(code, err, "out of memory")


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    db = str(tmp_path_factory.mktemp("fs") / "s.duckdb")
    proc = subprocess.run([*KVTRACE, "replay", TRACE, "--limit", "3", "--mode", "cache-only", "--db", db],
                          capture_output=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return db


def _with_closed_pipe(argv: list[str], stream: str, cwd: Path | None = None) -> subprocess.Popen:
    """``kvtrace ARGV`` with ``stream``'s reader gone before anything is written (the command
    takes a quarter second to load): every write to it fails with EPIPE."""
    pipes = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, stream: subprocess.PIPE}
    proc = subprocess.Popen([*KVTRACE, *argv], cwd=cwd, **pipes)
    getattr(proc, stream).close()
    return proc


def test_export_refuses_to_replace_a_read_only_file(tmp_path, capsys, monkeypatch, store):
    """Each Parquet file is renamed into place: a 0444 runs.parquet was replaced all the same."""
    out = tmp_path / "out"
    out.mkdir()
    kept = out / "runs.parquet"
    kept.write_text("keep me\n")
    with read_only(monkeypatch, kept):
        code, _, err = run(["export", "--db", store, "--run", "r1", "--parquet", str(out)], capsys)
    assert_one_line(code, err, str(kept), "Permission denied", "read-only")
    assert kept.read_text() == "keep me\n" and sorted(p.name for p in out.iterdir()) == ["runs.parquet"]


def test_demo_refuses_to_replace_a_read_only_store(tmp_path, capsys, monkeypatch, store):
    """The demo's new store is renamed over --db: a 0444 one was replaced all the same. (The
    read-only file is refused before what it holds is looked at: any store will do here.)"""
    db = tmp_path / "d.duckdb"
    shutil.copy(store, db)
    before = db.read_bytes()
    with read_only(monkeypatch, db):
        code, _, err = run(["demo", "--db", str(db)], capsys)
    assert_one_line(code, err, str(db), "Permission denied", "read-only")
    assert db.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.duckdb"]


@pytest.mark.parametrize("argv", [["--help"], ["runs", "--db", "STORE"], ["diff", "r1", "r1", "--db", "STORE"]])
def test_a_stdout_whose_reader_went_exits_141(store, argv):
    """(`| head`: typer took the closed pipe for one of its own and exited 1, silently: the
    status of a failed `diff --fail-if` gate)"""
    proc = subprocess.Popen([*KVTRACE, *(store if a == "STORE" else a for a in argv)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and err == b"", err


def test_a_stderr_whose_reader_went_keeps_the_commands_exit_status(tmp_path):
    """(`2>&1 | head`: the status or error line failed, and typer exited 1 for both a
    command that failed and one that did its work)"""
    proc = _with_closed_pipe(["replay", str(tmp_path / "missing.jsonl")], "stderr")
    assert proc.wait(timeout=120) == 2
    out = tmp_path / "o.jsonl"
    proc = _with_closed_pipe(["convert", TRACE, "--limit", "2", "-o", str(out)], "stderr")
    assert proc.wait(timeout=120) == 0
    assert out.read_text().count("\n") == 3  # header + 2 requests


@pytest.mark.parametrize("argv", [
    ["generate", "chat", "--requests", "2", "-o"],
    ["demo", "--db"],
])
def test_a_file_nobody_may_write_is_refused_for_root_too(tmp_path, capsys, argv):
    """0444 with no stand-in for the kernel's answer: root (CI's user) may write anything,
    so access() said yes and the rename replaced a store or output made read-only on purpose."""
    kept = tmp_path / "kept.duckdb"
    kept.write_text("keep me\n")
    kept.chmod(0o444)
    try:
        code, _, err = run([*argv, str(kept)], capsys)
    finally:
        kept.chmod(0o644)
    assert_one_line(code, err, str(kept), "read-only")
    assert kept.read_text() == "keep me\n" and sorted(p.name for p in tmp_path.iterdir()) == ["kept.duckdb"]


def _as_on_a_read_only_mount(monkeypatch):
    """What a read-only mount looks like from here (no mount in a test): statvfs says
    ST_RDONLY, and os.access says no write, for root too."""
    import kvtrace.errors as errors

    real_statvfs, real_access = os.statvfs, os.access

    class _ReadOnly:
        def __init__(self, st):
            self.f_flag = st.f_flag | os.ST_RDONLY

    monkeypatch.setattr(os, "statvfs", lambda path: _ReadOnly(real_statvfs(path)))
    monkeypatch.setattr(os, "access", lambda path, mode, *a, **k: False if mode & os.W_OK else real_access(path, mode))
    return errors


def test_outputs_on_a_read_only_mount_say_so_not_permission_denied(tmp_path, capsys, monkeypatch):
    """convert -o, demo --db and export onto a 0644 file on a read-only mount said 'Permission
    denied (a read-only file, not replaced)', and generate -o into such a folder 'Permission
    denied (directory ...)': the file's mode allowed writing (the reD re-probe, on a bind mount)."""
    from tests.conftest import MOONCAKE

    existing = tmp_path / "t.jsonl"
    existing.write_text("")
    errors = _as_on_a_read_only_mount(monkeypatch)
    assert errors.read_only_problem(existing) == "cannot write: Read-only file system (a read-only mount, not replaced)"
    code, _, err = run(["convert", str(MOONCAKE), "-o", str(existing), "--limit", "2"], capsys)
    assert_one_line(code, err, f"{existing}: cannot write: Read-only file system")
    code, _, err = run(["generate", "chat", "-o", str(tmp_path / "new.jsonl")], capsys)
    assert_one_line(code, err, f"{tmp_path / 'new.jsonl'}: cannot write: Read-only file system (directory {tmp_path})")
    monkeypatch.undo()
    assert errors.read_only_problem(existing) is None  # (a writable file on a writable mount)
