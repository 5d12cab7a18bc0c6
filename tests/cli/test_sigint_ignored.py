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



def test_a_sweep_that_ignores_sigint_keeps_its_workers_through_a_ctrl_c_to_its_group(tmp_path):
    """The pool's workers reset SIGINT to its default, ignored or not: a Ctrl-C to the group
    of a `kvtrace sweep ... &` killed every worker, and the sweep that went on failed ("a worker
    process died"). Its workers now ignore what it ignores."""
    import os

    db = str(tmp_path / "s.duckdb")
    argv = ["sweep", "tests/data/mooncake_synthetic_trace.jsonl", "--mode", "cache-only", "--limit", "400",
            "--param", "capacity_blocks=100,200,300,400,500,600", "--workers", "2", "--db", db]
    start = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); print('ready', flush=True); "
             f"os.execv(sys.executable, [sys.executable, '-c', 'from kvtrace.cli import main; main()', *{argv!r}])")
    proc = subprocess.Popen([sys.executable, "-c", start], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    sent = 0
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:  # Ctrl-C to the whole group, workers included
        try:
            os.killpg(proc.pid, signal.SIGINT)
        except ProcessLookupError:
            break
        sent += 1
        time.sleep(0.05)
    out, err = proc.communicate(timeout=60)
    assert sent > 5, sent
    assert proc.returncode == 0, (proc.returncode, err[-2000:])
    assert "died" not in err and out.count("capacity_blocks") >= 1, (out[-2000:], err[-2000:])
