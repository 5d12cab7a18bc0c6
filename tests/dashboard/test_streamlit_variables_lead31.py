"""``kvtrace dashboard`` serves whatever STREAMLIT_* variables say: its server's settings are
its flags (as no config.toml of the current folder reaches it). A bad one printed Streamlit's
usage text before the kvtrace line, an SSL certificate path that does not exist a traceback,
and a development mode or theme failed after the address was printed (re-probe reenv31)."""

from __future__ import annotations

import sys

import pytest

from kvtrace.store.writer import Store
from tests.dashboard.support import free_port, served_then_stopped


@pytest.mark.parametrize("variables", [
    {"STREAMLIT_SERVER_MAX_UPLOAD_SIZE": "abc", "STREAMLIT_SERVER_SSL_CERT_FILE": "/nonexistent",
     "STREAMLIT_GLOBAL_DEVELOPMENT_MODE": "true", "STREAMLIT_THEME_BASE": "purple"},
    {},
], ids=["four hostile settings", "none"])
def test_streamlit_variables_do_not_reach_the_server(tmp_path, monkeypatch, variables) -> None:
    db = tmp_path / "d.duckdb"
    Store.open(db).close()
    port = free_port()
    for key, value in variables.items():
        monkeypatch.setenv(key, value)
    code, err = served_then_stopped(
        [sys.executable, "-m", "kvtrace.cli", "dashboard", "--db", str(db), "--port", str(port)], port)
    assert code == 0, err
    assert err.strip().splitlines() == [f"kvtrace dashboard: open http://127.0.0.1:{port}/",
                                        "kvtrace dashboard: stopped"], err
