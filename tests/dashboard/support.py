"""What the dashboard's launch tests share: a free port, whether Streamlit serves on it, and a
server started, stopped with SIGTERM, and its stderr."""

from __future__ import annotations

import socket
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serving(port: int) -> bool:
    """Whether a Streamlit server answers its health check on ``port``."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def served_then_stopped(argv: list[str], port: int) -> tuple[int, str]:
    """Start ``argv`` (a ``kvtrace dashboard ... --port PORT`` command), wait until it serves,
    SIGTERM it; its exit status and stderr."""
    import signal
    import subprocess

    from tests.support.processes import reaped, wait_until

    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    with reaped(proc):
        wait_until(proc, lambda: serving(port), "the dashboard never served")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    return proc.returncode, err
