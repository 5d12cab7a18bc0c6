"""A kvtrace started with SIGINT ignored (``kvtrace ... &`` in a script) ignores it while its
commands load too: the loading handler took it as a Ctrl-C (exit 130) for the first quarter
second, and ignored it after, as Python leaves an inherited SIG_IGN."""

from __future__ import annotations

import signal
import subprocess
import sys
import time


def test_an_inherited_ignored_sigint_is_ignored_while_the_commands_load():
    # SIGINT ignored, then kvtrace exec'd in its place (an ignored signal stays ignored across exec)
    start = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); print('ready', flush=True); "
             "os.execv(sys.executable, [sys.executable, '-c', 'from kvtrace.cli import main; main()', '--version'])")
    proc = subprocess.Popen([sys.executable, "-c", start], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    sent = 0
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:  # Ctrl-C all through its start
        proc.send_signal(signal.SIGINT)
        sent += 1
        time.sleep(0.005)
    out, err = proc.communicate(timeout=60)
    assert sent > 5, sent
    assert proc.returncode == 0 and "kvtrace" in out and "interrupted" not in err, (proc.returncode, out, err)

