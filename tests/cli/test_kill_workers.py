"""Ctrl-C to a sweep's process group: its forked workers die of it without a word."""

from __future__ import annotations

import multiprocessing
import os
import signal
from concurrent.futures import ProcessPoolExecutor

from kvtrace.process import sigterm_as_interrupt, sigterm_blocked, worker_start


def test_an_idle_worker_dies_of_ctrl_c_without_a_traceback(capfd):
    """An idle pool worker (its replay done, the parent still storing) had the parent's
    KeyboardInterrupt raised in it, and multiprocessing printed "Process ForkProcess-1:" and
    its traceback on the command's stderr."""
    with sigterm_as_interrupt():  # (the command's handlers, which the workers inherit)
        with sigterm_blocked():
            pool = ProcessPoolExecutor(max_workers=1, initializer=worker_start, initargs=(os.getpid(),),
                                       mp_context=multiprocessing.get_context("fork"))
            first = pool.submit(os.getpid)
        worker = first.result(timeout=60)  # now idle, waiting for work
        (process,) = pool._processes.values()
        os.kill(worker, signal.SIGINT)
        process.join(timeout=60)
        pool.shutdown()
    assert process.exitcode == -signal.SIGINT  # died of it, as a process without handlers does
    err = capfd.readouterr().err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
