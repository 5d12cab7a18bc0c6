"""Ctrl-C or SIGTERM whose KeyboardInterrupt a finalizer swallowed still stops the command.

Python runs a signal's handler wherever the main thread is; inside a finalizer (a
``__del__``, a weakref callback, a generator the GC closes) the handler's exception is
reported ("Exception ignored in ...") and dropped, and a replay went on to finish with exit
0 and its run ``complete`` (about 2 Ctrl-Cs in 20 on the whole Mooncake trace). Here the
signal is raised inside a ``__del__`` at a chosen point, which makes that case certain."""

from __future__ import annotations

import json
import signal
import sys

import duckdb
import pytest

from kvtrace.process import sigterm_as_interrupt, stop_pending, stop_swallowed
from kvtrace.replay.digest import Digest
from kvtrace.store.writer import Store
from tests.cli.support import run

LINES = {signal.SIGINT: (130, "kvtrace: error: interrupted; what was recorded is kept"),
         signal.SIGTERM: (143, "kvtrace: error: terminated (SIGTERM); what was recorded is kept")}


class _SignalOnCollection:
    """An object whose finalizer signals this process (the handler runs inside it)."""

    def __init__(self, signum: int):
        self.signum = signum

    def __del__(self):
        signal.raise_signal(self.signum)


def _swallow_at(calls: int, signum: int, original):
    """``original`` (a method), signalling inside a finalizer on its ``calls``-th call."""
    count = [0]

    def method(self, *args, **kwargs):
        count[0] += 1
        if count[0] == calls:
            dropped = _SignalOnCollection(signum)
            del dropped  # (its __del__ runs here: the handler's KeyboardInterrupt is dropped)
        return original(self, *args, **kwargs)

    return method


def _runs(db, capsys) -> list[dict]:
    code, out, err = run(["runs", "--db", str(db), "--json"], capsys)
    assert code == 0, err
    return json.loads(out)["runs"]


def _error_of(db, run_id: str) -> str:
    with duckdb.connect(str(db), read_only=True) as con:
        (summary,) = con.execute("SELECT summary FROM runs WHERE run_id = ?", [run_id]).fetchone() or (None,)
    return json.loads(summary)["error"]


def _stored_steps(db, stopped: str, complete: str) -> int:
    """The last step the stopped run stored: its seq contiguous from 0, and its rows the
    complete run's of the same steps (span ids and seq aside: both are given per hand-over
    batch of steps, and the stop cut its last batch short)."""
    with duckdb.connect(str(db), read_only=True) as con:
        seq, last = con.execute("SELECT list(seq ORDER BY seq), max(step) FROM spans WHERE run_id = ?",
                                [stopped]).fetchone() or (None, None)
        assert seq == list(range(len(seq))) and seq

        def rows(run_id):
            return con.execute("SELECT * EXCLUDE (run_id, span_id, parent_span_id, seq) FROM spans "
                               "WHERE run_id = ? AND step <= ? ORDER BY ALL", [run_id, last]).fetchall()

        assert rows(stopped) == rows(complete)
    return last


def _stopped(code: int, err: str, signum: signal.Signals) -> None:
    want_code, want_line = LINES[signum]
    assert code == want_code, err
    assert err.strip().splitlines()[-1] == want_line, err
    assert "Traceback" not in err and "Exception ignored" not in err, err


@pytest.mark.parametrize(("mode", "listener", "signum"), [
    (["--mode", "engine"], "on_step", signal.SIGINT),
    (["--mode", "engine", "--no-content"], "on_step", signal.SIGTERM),
    (["--mode", "cache-only"], "on_cache_events", signal.SIGINT),
    (["--mode", "cache-only", "--policy", "belady"], "on_cache_events", signal.SIGTERM),
])
def test_a_swallowed_stop_ends_the_replay_at_its_next_step(tmp_path, capsys, monkeypatch, mode, listener, signum):
    db = tmp_path / "s.duckdb"
    monkeypatch.setattr(Digest, listener, _swallow_at(5, signum, getattr(Digest, listener)))
    code, out, err = run(["replay", "gen:chat", "--limit", "40", *mode, "--db", str(db), "--json"], capsys)
    _stopped(code, err, signum)
    assert out == ""  # no summary of a run that did not finish
    monkeypatch.undo()
    (stopped,) = _runs(db, capsys)
    # marked as a Ctrl-C that reached the replay marks it (README: SIGTERM, the run `failed`)
    assert stopped["status"] == "failed", stopped
    assert _error_of(db, stopped["run_id"]).startswith("KeyboardInterrupt" if signum == signal.SIGINT else "Terminated")
    # and the store takes the next replay, whole
    code, out, err = run(["replay", "gen:chat", "--limit", "40", *mode, "--db", str(db), "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["requests"] == 40
    assert [r["status"] for r in _runs(db, capsys)] == ["complete", "failed"]  # (newest first)
    last = _stored_steps(db, "r1", "r2")  # stopped at the step after the finalizer's, not at the end:
    assert last == 4, last  # (steps counted from 0 in either mode, as the cache counts them)


def test_a_swallowed_stop_ends_a_sweep_before_it_stores_another_run(tmp_path, capsys, monkeypatch):
    """The sweep's parent (SIGTERM to it alone: `kill PID`) stored every later run and exited 0."""
    db = tmp_path / "s.duckdb"
    monkeypatch.setattr(Store, "finish_run", _swallow_at(1, signal.SIGTERM, Store.finish_run))
    code, _, err = run(["sweep", "gen:chat", "--limit", "10", "--mode", "cache-only", "--param",
                        "capacity_blocks=50,60,70,80", "--workers", "2", "--db", str(db)], capsys)
    _stopped(code, err, signal.SIGTERM)
    monkeypatch.undo()
    assert [(r["run_id"], r["status"]) for r in _runs(db, capsys)] == [("r1", "complete")]


def test_a_stop_swallowed_after_the_last_step_still_says_so(tmp_path, capsys, monkeypatch):
    """A finalizer in the store's close, after the run was finished: the command said nothing
    and exited 0, though it was asked to stop (the run is whole, and stays complete)."""
    db = tmp_path / "s.duckdb"
    monkeypatch.setattr(Store, "close", _swallow_at(1, signal.SIGINT, Store.close))
    code, _, err = run(["replay", "gen:chat", "--limit", "5", "--mode", "cache-only", "--db", str(db)], capsys)
    _stopped(code, err, signal.SIGINT)
    monkeypatch.undo()
    assert [r["status"] for r in _runs(db, capsys)] == ["complete"]


def test_a_swallowed_stop_is_remembered_not_printed_and_forgotten_with_its_command():
    calls: list = []
    hook, record = sys.unraisablehook, calls.append
    sys.unraisablehook = record
    try:
        with sigterm_as_interrupt():
            dropped = _SignalOnCollection(signal.SIGINT)
            del dropped
            assert stop_pending() and stop_swallowed()
            other = ValueError("not a stop")  # any other unraisable is reported as before
            sys.unraisablehook(type("U", (), {"exc_value": other})())
        assert sys.unraisablehook is record
        assert [u.exc_value for u in calls] == [other]
        assert not stop_pending()  # a later replay in this process (a test's, a notebook's) runs whole
        with sigterm_as_interrupt():
            assert not stop_swallowed()
    finally:
        sys.unraisablehook = hook
