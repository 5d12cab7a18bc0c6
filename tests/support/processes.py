"""Tests that drive a real process: wait for it to get somewhere, and never leave it running."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable, Iterator


def wait_until(proc: subprocess.Popen, done: Callable[[], bool], what: str, timeout_s: float = 120) -> None:
    """Poll ``done()`` until it holds; fail with the process's stderr if it ended first, or
    saying ``what`` never happened after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else proc.returncode
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@contextlib.contextmanager
def reaped(proc: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """``proc``, killed (if still running) and waited for when the block ends, however it ends."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
