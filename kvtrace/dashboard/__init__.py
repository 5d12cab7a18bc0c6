"""kvtrace.dashboard: the Streamlit app over a kvtrace store.

``launch(db)`` runs the real Streamlit server on ``app.py``; the CLI's
``kvtrace dashboard --db PATH`` calls it. The app reads only through ``kvtrace.store``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvtrace.errors import ConfigError, KVTraceError
from kvtrace.process import probe_address

APP_PATH = Path(__file__).with_name("app.py")
DB_ENV = "KVTRACE_DB"


def server_command(db: str | os.PathLike, host: str = "127.0.0.1", port: int = 8501) -> list[str]:
    """The argv that serves the dashboard for ``db`` (``streamlit run app.py -- --db PATH``),
    headless: the server opens no browser."""
    return [
        sys.executable, "-m", "streamlit", "run", str(APP_PATH),
        "--server.address", host,
        "--server.port", str(int(port)),
        "--server.headless", "true",
        "--browser.gatherUsageStats", "false",
        "--server.fileWatcherType", "none",
        "--client.toolbarMode", "viewer",
        "--", "--db", _resolved(db),
    ]


def _resolved(db: str | os.PathLike) -> str:
    """A DuckDB path made absolute (the server runs elsewhere); a ClickHouse --db as given
    (``chdb:`` paths are resolved when parsed)."""
    from kvtrace.store.backend import is_clickhouse

    return str(db) if is_clickhouse(db) else str(Path(db).resolve())


def page_url(host: str, port: int, run: str | None = None, compare: str | None = None) -> str:
    """The address that opens the dashboard on ``run`` (and the Compare page against
    ``compare``): the app reads these query parameters."""
    from urllib.parse import urlencode

    params = {k: v for k, v in (("run", run), ("b", compare)) if v is not None}
    page = "compare" if compare is not None else ""
    return f"http://{host}:{int(port)}/{page}" + (f"?{urlencode(params)}" if params else "")


def launch(db: str | os.PathLike, host: str = "127.0.0.1", port: int = 8501, run: str | None = None,
           compare: str | None = None) -> int:
    """Serve the dashboard until interrupted. Prints the address to open (with
    ``run``/``compare`` as query parameters when given).

    Binds to loopback unless ``host`` says otherwise. A missing database and a port that
    cannot be bound are one-line errors here, before a server starts that could only
    show an error (or Streamlit's own text). On POSIX this process then becomes the
    Streamlit server (exec): a signal that stops ``kvtrace dashboard`` stops the server,
    and no child is left serving. Elsewhere the server is a child, waited for (its exit
    status is returned).
    """
    from kvtrace.store.backend import is_clickhouse

    path = Path(db)
    if not is_clickhouse(db) and not path.is_file():
        raise ConfigError("kvtrace dashboard", "--db", f"{path}: no such database file (fill one with `kvtrace demo` "
                                                       f"or `kvtrace replay TRACE --db {path}`)")
    if not 0 < int(port) < 65536:
        raise ConfigError("kvtrace dashboard", "--port", f"expected 1..65535, got {port}")
    try:
        probe_address(host, int(port), "dashboard")
    except OSError as err:
        raise KVTraceError(str(err)) from None
    env = dict(os.environ, **{DB_ENV: _resolved(db)})
    print(f"kvtrace dashboard: open {page_url(host, port, run, compare)}", file=sys.stderr, flush=True)
    command = server_command(db, host, port)
    if os.name == "posix":
        sys.stdout.flush()
        os.execve(command[0], command, env)  # does not return
    try:
        return subprocess.call(command, env=env)
    except KeyboardInterrupt:
        return 130
