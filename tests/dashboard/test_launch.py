"""``kvtrace dashboard`` as a real process: SIGTERM leaves nothing serving; a busy port is
one error line, not Streamlit's text."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

from kvtrace.store.writer import Store
from tests.dashboard.support import free_port, serving
from tests.support.processes import reaped, wait_until


def _dashboard(db, port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvtrace.cli", "dashboard", "--db", str(db), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _serve_then_stop(proc: subprocess.Popen, port_of) -> int:
    """Wait for ``proc``'s server to answer on ``port_of(proc)``, then SIGTERM it and wait
    for the command to end; returns the port."""
    with reaped(proc):
        port = port_of(proc)
        wait_until(proc, lambda: serving(port), "the dashboard never served")
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    return port


def test_sigterm_stops_the_server_with_the_command(tmp_path):
    db = tmp_path / "d.duckdb"
    Store.open(db).close()
    port = free_port()
    _serve_then_stop(_dashboard(db, port), lambda _: port)
    assert not serving(port)  # nothing outlived the command: no child kept the port
    with socket.socket() as s:  # the port is free again
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_a_busy_port_is_one_error_line(tmp_path):
    db = tmp_path / "d.duckdb"
    Store.open(db).close()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = _dashboard(db, port)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"kvtrace: error: cannot listen on 127.0.0.1:{port} (dashboard)"), err
    assert lines[0].endswith("; choose another with --port N, or --port 0 for a free one"), err  # (the way out)


def test_a_port_out_of_range_names_the_flag_once(tmp_path, capsys):
    """--port 99999 said "kvtrace: error: kvtrace dashboard: --port: ...", the command twice."""
    from tests.cli.support import assert_one_line, run

    db = tmp_path / "d.duckdb"
    Store.open(db).close()
    code, _, err = run(["dashboard", "--db", str(db), "--port", "99999"], capsys)
    line = assert_one_line(code, err, "kvtrace: error: --port: 99999: expected 0..65535 (0: a free one)")
    assert "kvtrace dashboard" not in line


def test_the_address_printed_brackets_an_ipv6_host():
    # "open http://::1:8501/" was no URL a browser takes
    from kvtrace.dashboard import page_url

    assert page_url("::1", 8501) == "http://[::1]:8501/"
    assert page_url("127.0.0.1", 8501, run="r1", compare="r2") == "http://127.0.0.1:8501/compare?run=r1&b=r2"


def test_port_0_serves_on_a_free_port_it_prints(tmp_path):
    """--port 0 was refused ("expected 1..65535"); it now picks a free port and prints the
    address that serves."""
    import re

    db = tmp_path / "d.duckdb"
    Store.open(db).close()

    def printed(proc) -> int:
        line = proc.stderr.readline()
        found = re.fullmatch(r"kvtrace dashboard: open http://127\.0\.0\.1:(\d+)/\n", line)
        assert found, line
        return int(found.group(1))

    port = _serve_then_stop(_dashboard(db, 0), printed)
    assert port > 0 and not serving(port)


def test_modules_in_the_working_directory_never_shadow_the_servers(tmp_path):
    """The server and its launcher ran ``python -m streamlit`` and ``python -c`` in the user's
    folder, whose path Python puts first: an ``enum.py``, ``signal.py`` or ``streamlit.py``
    there was imported instead (the dashboard printed its address, then exited 1 with that
    file's output). They run with ``-P``, as the ``kvtrace`` script itself does."""
    import os
    from pathlib import Path

    db = tmp_path / "d.duckdb"
    Store.open(db).close()
    folder = tmp_path / "work"
    folder.mkdir()
    for name in ("enum", "signal", "streamlit", "ctypes"):
        (folder / f"{name}.py").write_text("raise SystemExit(7)\n")
    port = free_port()
    script = Path(sys.executable).with_name("kvtrace")  # (the console script: not run from its folder)
    proc = subprocess.Popen([str(script), "dashboard", "--db", str(db), "--port", str(port)], cwd=folder,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert _serve_then_stop(proc, lambda _: port) == port and proc.returncode == 0
