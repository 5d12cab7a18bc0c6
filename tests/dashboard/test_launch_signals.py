"""``kvtrace dashboard`` as a real process: a file that is no kvtrace store is refused as
``kvtrace runs`` refuses it, before anything serves; SIGTERM and Ctrl-C stop the server and
exit 143 and 130 with one line, and no server outlives the command, even a killed one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import duckdb
import pytest

from kvtrace.store.writer import Store
from tests.dashboard.support import free_port, serving


def _kvtrace(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvtrace.cli", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _not_a_store(tmp_path, kind: str):
    db = tmp_path / f"{kind}.duckdb"
    if kind == "text":
        db.write_text("a trace, say\n")
    elif kind == "empty":
        db.write_bytes(b"")
    elif kind == "directory":
        db.mkdir()
    else:
        con = duckdb.connect(str(db))
        con.execute("CREATE TABLE unrelated (a INTEGER)")
        con.close()
    return db


@pytest.mark.parametrize("kind", ["text", "empty", "unrelated-tables", "directory"])
def test_a_file_that_is_no_store_is_refused_as_runs_refuses_it(tmp_path, kind):
    db = _not_a_store(tmp_path, kind)
    port = free_port()
    runs = _kvtrace("runs", "--db", str(db))
    _, runs_err = runs.communicate(timeout=120)
    proc = _kvtrace("dashboard", "--db", str(db), "--port", str(port))
    try:
        _, err = proc.communicate(timeout=90)  # (a server would not return: the timeout fails the test)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert runs.returncode == 2 and proc.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines == runs_err.strip().splitlines()  # the same check, the same line
    assert lines[0].startswith(f"kvtrace: error: {db}: ")
    assert not serving(port)


def _startserving(db, port: int) -> subprocess.Popen:
    proc = _kvtrace("dashboard", "--db", str(db), "--port", str(port))
    deadline = time.monotonic() + 120
    while not serving(port):
        if proc.poll() is not None:
            raise AssertionError(proc.stderr.read() if proc.stderr else "")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("the dashboard never served")
        time.sleep(0.2)
    return proc


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc: Linux)."""
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(") ", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                found.append(int(entry))
    return found


def _gone(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a zombie of ours (not reaped by anyone yet) is gone too
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(") ", 1)[1].startswith("Z"):
                    return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_stops_the_server_as_collect_is_stopped(tmp_path, sig):
    """Ctrl-C is how a server is stopped: it said "kvtrace: error: interrupted" and exited
    130, where kvtrace collect prints its summary and exits 0. SIGHUP (the terminal closed)
    killed the command at once, its server left to die with it."""
    db = tmp_path / "d.duckdb"
    Store.open(db).close()
    port = free_port()
    proc = _startserving(db, port)
    try:
        servers = _children(proc.pid)
        assert servers, "the server is a child of the command"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert not [x for x in err.splitlines() if x.startswith("kvtrace: error:")], err
    assert err.strip().splitlines()[-1] == "kvtrace dashboard: stopped" and "Traceback" not in err, err
    assert all(_gone(s) for s in servers)
    assert not serving(port)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the server dies with its parent on Linux")
def test_a_killed_command_leaves_no_server(tmp_path):
    db = tmp_path / "d.duckdb"
    Store.open(db).close()
    port = free_port()
    proc = _startserving(db, port)
    servers = _children(proc.pid)
    proc.kill()
    proc.wait()
    assert servers, "the server is a child of the command"
    assert all(_gone(s) for s in servers), "a server outlived the killed command"
    deadline = time.monotonic() + 30
    while serving(port) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not serving(port)


def test_a_ctrl_c_while_the_server_starts_is_no_traceback(tmp_path):
    """Ctrl-C passed on as SIGINT while Streamlit still imported printed its 44-line
    KeyboardInterrupt traceback (or "Aborted!"); the server is now stopped with SIGTERM."""
    db = tmp_path / "d.duckdb"
    Store.open(db).close()
    proc = _kvtrace("dashboard", "--db", str(db), "--port", "0")
    assert proc.stderr is not None
    line = proc.stderr.readline()  # "kvtrace dashboard: open ...": the server is being started
    assert line.startswith("kvtrace dashboard: open"), line
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "Aborted" not in err, err
    assert err.strip().splitlines()[-1] == "kvtrace dashboard: stopped"
