"""SIGHUP (the terminal or the ssh session closed) stops a replay as SIGTERM does: what it
recorded is flushed and its run marked, where the hang-up killed it mid-second before and
left the run 'running'; under ``nohup`` it is ignored, as the user asked."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time

import duckdb

from kvtrace.store import read
from tests.replay.test_kill import LIMIT, TRACE


def _driver(marker, after: str, db) -> list[str]:
    return [sys.executable, "-m", "tests.replay.sigterm_driver", str(marker), after, "--",
            "replay", TRACE, "--limit", str(LIMIT), "--db", str(db)]


def _seqs(db) -> list[int]:
    with duckdb.connect(str(db), read_only=True) as con:
        return [s for (s,) in con.execute("SELECT seq FROM spans WHERE run_id = 'r1' ORDER BY seq").fetchall()]


def _stopped_by_hangup(db, marker) -> None:
    committed = int(marker.read_text())
    run = read.run(db, "r1")
    assert run["status"] == "failed" and "SIGHUP" in run["summary"]["error"], run
    seqs = _seqs(db)
    assert committed > 0 and len(seqs) >= committed and seqs == list(range(len(seqs)))


def test_sighup_stops_a_replay_as_sigterm_does(tmp_path):
    db, marker = tmp_path / "hup.duckdb", tmp_path / "committed"
    proc = subprocess.run(_driver(marker, "2:SIGHUP", db), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 129, proc.stderr  # (128 + 1, as a process killed by it)
    assert proc.stderr.strip().splitlines() == ["kvtrace: error: terminated (SIGHUP); what was recorded is kept"]
    _stopped_by_hangup(db, marker)


def test_a_replay_started_under_nohup_ignores_sighup(tmp_path):
    """``nohup kvtrace replay ... &``: the hang-up is ignored and the replay finishes."""
    db, marker = tmp_path / "nohup.duckdb", tmp_path / "committed"
    proc = subprocess.run(["nohup", *_driver(marker, "2:SIGHUP", db)], capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    assert marker.exists()  # (the SIGHUP was sent, and ignored)
    assert read.run(db, "r1")["status"] == "complete"


def test_a_closed_terminal_stops_a_replay_and_keeps_what_it_recorded(tmp_path):
    """A real hang-up: the replay runs on a pseudo-terminal as its controlling terminal, whose
    other end is closed mid-run (as an ssh session that drops), so the kernel sends SIGHUP;
    the error line is lost with the terminal, the store keeps the run, marked."""
    db, marker = tmp_path / "tty.duckdb", tmp_path / "committed"
    master, slave = os.openpty()
    # (after setsid, the new session takes the terminal on its stdin, then runs the replay)
    take = "import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); os.execv(sys.argv[1], sys.argv[1:])"
    proc = subprocess.Popen([sys.executable, "-c", take, *_driver(marker, "2:wait", db)], stdin=slave, stdout=slave,
                            stderr=slave, start_new_session=True)
    os.close(slave)
    poller = select.poll()  # (not select: a worker may hold descriptors past 1,024)
    poller.register(master, select.POLLIN)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            if poller.poll(50):  # (the terminal drained, so no write blocks)
                try:
                    os.read(master, 65536)
                except OSError:
                    break
        assert marker.exists(), f"no commit seen (exit {proc.poll()})"
    finally:
        os.close(master)  # the hang-up
    try:
        assert proc.wait(timeout=120) == 129
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _stopped_by_hangup(db, marker)
