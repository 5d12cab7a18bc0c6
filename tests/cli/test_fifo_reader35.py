"""``-o FIFO`` with no process reading it (probe 35): ``generate``, ``convert`` and
``calibrate`` blocked in the open for good, as a shell's ``> FIFO`` does, but without a word.
The open now waits for a reader for ``FIFO_READER_WAIT_S`` at most, then is one line, exit 2;
with a reader it is written as before (tests/cli/test_bad_input.py)."""

from __future__ import annotations

import os
import stat
import threading
import time

import pytest

from kvtrace.workload import lines
from tests.cli.support import assert_one_line, run

CALIBRATION = os.path.join(os.path.dirname(__file__), "..", "data", "calibration", "aic-h200-llama-3.1-8b-tp1.csv")


@pytest.mark.parametrize("argv", [["generate", "chat", "--requests", "2"],
                                  ["calibrate", "--from", CALIBRATION]], ids=["generate", "calibrate"])
def test_a_fifo_nobody_reads_is_one_line_not_a_hang(tmp_path, capsys, monkeypatch, argv):
    monkeypatch.setattr(lines, "FIFO_READER_WAIT_S", 0.3)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    done = threading.Event()

    def late_reader() -> None:  # (the old open blocked for good: a reader, much later, ends the test)
        if not done.wait(30):
            with open(fifo, "rb") as f:
                f.read()

    threading.Thread(target=late_reader, daemon=True).start()
    t = time.monotonic()
    try:
        code, _, err = run([*argv, "-o", str(fifo)], capsys)
    finally:
        done.set()
    assert time.monotonic() - t < 20
    assert_one_line(code, err, str(fifo), "is a FIFO that no process opened to read within 0.3 s",
                    "nothing was written")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
