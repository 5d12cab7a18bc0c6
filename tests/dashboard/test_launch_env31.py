"""``kvtrace dashboard`` and what surrounds it (probe env31): the server's user settings in
``~/.streamlit`` (a HOME that is no folder, a settings file it may not read, a config.toml
that is no TOML) and a server process that cannot be started. Each is one line and exit 2,
before any address is printed or anything serves."""

from __future__ import annotations

import sys

import pytest

from kvtrace.store.writer import Store
from tests.cli.support import assert_one_line, run


@pytest.fixture()
def store(tmp_path):
    db = tmp_path / "d.duckdb"
    Store.open(db).close()
    return str(db)


def test_a_home_that_is_a_file_is_one_line_naming_it(store, monkeypatch, capsys):
    """HOME=/dev/null (a service user's): the server exited at start, 'exited with status 1:
    NotADirectoryError: ... /dev/null/.streamlit/secrets.toml (File ".../streamlit/runtime/secrets.py"...)',
    after the address to open was printed."""
    monkeypatch.setenv("HOME", "/dev/null")
    code, out, err = run(["dashboard", "--db", store, "--port", "0"], capsys)
    assert_one_line(code, err, "/dev/null/.streamlit/config.toml", "HOME (/dev/null)", "Not a directory")
    assert not out and "open http" not in err


def test_a_config_toml_that_is_no_toml_is_one_line_naming_its_line(store, tmp_path, monkeypatch, capsys):
    """Streamlit printed its TOML parser's traceback (passed on by the relay: the server
    went on, without the user's settings)."""
    home = tmp_path / "home"
    (home / ".streamlit").mkdir(parents=True)
    config = home / ".streamlit" / "config.toml"
    config.write_text("[server\nport = 1\n")
    monkeypatch.setenv("HOME", str(home))
    code, _, err = run(["dashboard", "--db", store, "--port", "0"], capsys)
    assert_one_line(code, err, str(config), "not TOML", "line 1, column 8")


def test_a_server_that_cannot_be_started_is_one_line(store, tmp_path, monkeypatch, capsys):
    """subprocess.Popen's OSError (a process limit reached, an interpreter this user may not
    execute) was a traceback after the address to open."""
    not_executable = tmp_path / "python"
    not_executable.write_text("")
    monkeypatch.setattr(sys, "executable", str(not_executable))
    code, out, err = run(["dashboard", "--db", store, "--port", "0"], capsys)
    assert_one_line(code, err, "cannot start the dashboard server (streamlit): Permission denied", str(not_executable))
    assert not out and "open http" not in err


@pytest.mark.parametrize("closed", ["<&-", ">&-", "<&- >&-"])
def test_a_closed_stdin_or_stdout_leaves_the_server_whole(tmp_path, closed):
    """`kvtrace dashboard ... <&-` or `>&-`: the server inherited no descriptor 0 or 1 (Python's
    null device for a closed stdout is close-on-exec), opened its event loop's there, and
    libuv aborted it as it stopped: "uv__close: Assertion `fd > STDERR_FILENO' failed"."""
    from tests.dashboard.support import free_port, served_then_stopped

    db = tmp_path / "d.duckdb"
    Store.open(db).close()
    port = free_port()
    command = [sys.executable, "-m", "kvtrace.cli", "dashboard", "--db", str(db), "--port", str(port)]
    code, err = served_then_stopped(["bash", "-c", f'exec "$@" {closed}', "bash", *command], port)
    assert code == 0, err
    assert "Assertion" not in err and "uv__close" not in err, err
    assert err.strip().splitlines()[-1] == "kvtrace dashboard: stopped", err
