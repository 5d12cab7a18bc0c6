"""Ctrl-C, SIGTERM and SIGHUP end a command with its one line and exit status, whatever a library
raised instead of the KeyboardInterrupt; a library that installs its own handlers does
not keep them."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from kvtrace.process import sigterm_as_interrupt, stop_handlers_kept, stop_signalled


@pytest.mark.parametrize(("signame", "code", "line"), [
    # (a recording command says so of either signal: SIGINT's line did not)
    ("SIGINT", 130, "kvtrace: error: interrupted; what was recorded is kept"),
    ("SIGTERM", 143, "kvtrace: error: terminated (SIGTERM); what was recorded is kept"),
    ("SIGHUP", 129, "kvtrace: error: terminated (SIGHUP); what was recorded is kept"),  # (the terminal closed)
])
def test_a_signal_a_library_swallowed_is_still_the_signal(tmp_path, signame, code, line):
    """A sweep stopped while its store wrote (DuckDB turned the interrupt into "Query
    interrupted" or an aborted transaction): a traceback and exit 1 before."""
    db = tmp_path / "s.duckdb"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.cli.swallowed_signal_driver", signame, "--", "sweep", "gen:chat", "--limit",
         "5", "--mode", "cache-only", "--param", "capacity_blocks=50,60", "--workers", "1", "--db", str(db)],
        capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == code, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(line), proc.stderr
    assert "Traceback" not in proc.stderr
    runs = subprocess.run([sys.executable, "-m", "kvtrace.cli", "runs", "--db", str(db), "--json"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert runs.returncode == 0 and '"incomplete"' in runs.stdout, runs.stderr  # the store whole, the run marked


def test_ctrl_c_is_remembered_and_the_handlers_restored():
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt), sigterm_as_interrupt():
        assert not stop_signalled()
        signal.raise_signal(signal.SIGINT)
    assert stop_signalled()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with sigterm_as_interrupt():  # a new command starts with none seen
        assert not stop_signalled()


def test_handlers_a_library_installs_are_replaced_by_the_commands_own():
    def library(signum, frame):  # e.g. ray.init's SIGTERM handler: sys.exit
        raise SystemExit(signum)

    with sigterm_as_interrupt():
        ours = signal.getsignal(signal.SIGTERM)
        with stop_handlers_kept():
            signal.signal(signal.SIGTERM, library)
            signal.signal(signal.SIGINT, library)
        assert signal.getsignal(signal.SIGTERM) is ours
        assert signal.getsignal(signal.SIGINT) is not library


def test_signals_held_hold_a_signal_the_kernel_gives_another_thread():
    """The block held SIGINT with the calling thread's mask: the kernel gave it to another
    thread (DuckDB's, chdb's), and the main thread raised inside the block all the same (a
    chdb flush cut between its inserts, its rows then inserted twice)."""
    import os
    import threading
    import time

    from kvtrace.process import signals_held

    library = threading.Thread(target=time.sleep, args=(2,), daemon=True)  # its mask: nothing blocked
    library.start()
    finished = []
    with pytest.raises(KeyboardInterrupt), signals_held():
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(200):
            time.sleep(0.001)  # (the handler's exception is raised here, were the signal let in)
        finished.append(True)
    assert finished == [True]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_only_a_command_given_a_store_says_what_it_recorded_is_kept(tmp_path):
    """`replay` or `curve` without --db, stopped, said "what was recorded is kept" of nothing,
    and so did a replay stopped before it made its store's file."""
    from kvtrace.cli.commands import _recording

    db = tmp_path / "s.duckdb"
    assert not _recording(["replay", "gen:chat"]) and not _recording(["curve", "t.jsonl", "--mode", "engine"])
    assert not _recording(["replay", "gen:chat", "--db", str(db)])  # (not made yet: nothing kept)
    db.write_bytes(b"")
    assert _recording(["replay", "gen:chat", "--db", str(db)]) and _recording(["sweep", "t", "--db=chdb:d"])
    assert _recording(["replay", "gen:chat", f"--db={db}"])
    assert not _recording(["dashboard", "--db", str(db)])  # (it records nothing: nothing to keep)


def test_a_hangup_is_a_stop_unless_ignored():
    """SIGHUP raises Terminated as SIGTERM does, named; a SIGHUP the process ignores (nohup)
    stays ignored inside the block, and both handlers are put back after it."""
    from kvtrace.process import Terminated, terminated

    before = signal.getsignal(signal.SIGHUP)
    with pytest.raises(Terminated, match="SIGHUP"), sigterm_as_interrupt():
        signal.raise_signal(signal.SIGHUP)
    assert terminated() == signal.SIGHUP and signal.getsignal(signal.SIGHUP) is before
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with sigterm_as_interrupt():
            signal.raise_signal(signal.SIGHUP)
            assert not stop_signalled() and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)
