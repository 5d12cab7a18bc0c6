"""kvtrace.dashboard: the Streamlit app over a kvtrace store.

``launch(db)`` runs the real Streamlit server on ``app.py``; the CLI's
``kvtrace dashboard --db PATH`` calls it. The app reads only through ``kvtrace.store``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable
from pathlib import Path

from kvtrace.errors import ConfigError, KVTraceError
from kvtrace.process import bracketed, free_port, probe_address, signals_held, unbracketed

APP_PATH = Path(__file__).with_name("app.py")
DB_ENV = "KVTRACE_DB"


def server_command(db: str | os.PathLike, host: str = "127.0.0.1", port: int = 8501) -> list[str]:
    """The argv that serves the dashboard for ``db`` (``streamlit run app.py -- --db PATH``),
    headless: the server opens no browser."""
    return [
        sys.executable, "-P", "-m", "streamlit", "run", str(APP_PATH),  # (-P: never a module of the cwd)
        "--server.address", host,
        "--server.port", str(int(port)),
        "--server.headless", "true",
        "--browser.gatherUsageStats", "false",
        "--server.fileWatcherType", "none",
        "--client.toolbarMode", "viewer",
        "--logger.level", "warning",  # (its info lines, 'Uvicorn server started on ...', beside kvtrace's own)
        "--server.baseUrlPath", "",  # (the address printed is served at /, whatever a config.toml says)
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
    return f"http://{bracketed(host)}:{int(port)}/{page}" + (f"?{urlencode(params)}" if params else "")


def check_address(host: str, port: int) -> None:
    """KVTraceError when the server could not listen at ``host:port``: a port out of range,
    one in use, an address not here. Told before the store is opened and before a server
    starts (that could only print Streamlit's own text)."""
    if not 0 <= int(port) < 65536:
        raise ConfigError("--port", str(port), "expected 0..65535 (0: a free one)")
    try:
        probe_address(unbracketed(host), int(port), "dashboard")
    except OSError as err:
        raise KVTraceError(str(err)) from None


def launch(db: str | os.PathLike, host: str = "127.0.0.1", port: int = 8501, run: str | None = None,
           compare: str | None = None) -> int:
    """Serve the dashboard until interrupted. Prints the address to open (with
    ``run``/``compare`` as query parameters when given).

    Binds to loopback unless ``host`` says otherwise. A database that is missing or is no
    kvtrace store (the check ``kvtrace runs`` makes) and a port that cannot be bound
    (``check_address``, first) are one-line errors here, before a server starts that could
    only show an error (or Streamlit's own text).

    The server is a child process, run in kvtrace's folder (a ``.streamlit`` config of the
    user's folder is not read), waited for: 0 is returned when it ends well; one that ends
    otherwise (a start that failed: a module on PYTHONPATH that breaks its imports) is a
    KVTraceError naming its status and its last exception, its traceback not shown. Ctrl-C or
    SIGTERM (as ``kvtrace.process.Terminated``, inside ``sigterm_as_interrupt``) is how a
    server is stopped, as ``kvtrace collect`` is: it is passed on (then a kill if the server
    is not gone within ``STOP_TIMEOUT_S``), a ``stopped`` line is printed and 0 returned. The
    child is in a process group of its own (a Ctrl-C at the terminal reaches it once,
    through this process) and, on Linux, is killed with this process however that one
    dies (``PR_SET_PDEATHSIG``): no server is left serving.
    """
    from kvtrace.store.backend import is_clickhouse

    host = unbracketed(host)  # ([::1], a URL's spelling, as collect --host takes it)
    check_address(host, port)
    check_streamlit_home()
    if not port:  # a free one, chosen here: the address printed below is the one served
        try:
            port = free_port(host)
        except OSError as err:
            raise KVTraceError(str(err)) from None
    path = Path(db)
    if not is_clickhouse(db):
        if not path.exists():
            from kvtrace.names import shell_path

            raise ConfigError("kvtrace dashboard", "--db", f"{path}: no such database file (fill one with `kvtrace "
                                                           f"demo` or `kvtrace replay TRACE --db "
                                                           f"{shell_path(path)}`)")
        from kvtrace.store import read

        # what `kvtrace runs` reads, read here: a store whose layout is whole but whose run
        # statistics are damaged (a block's checksum) was served, each page one error
        read.runs(path)
    # (no STREAMLIT_* variable: the server's settings are its flags, as no config.toml of the
    # current folder reaches it; a bad one printed Streamlit's usage text or a traceback, or
    # failed after the address was printed, and an SSL certificate made it serve https where
    # the address printed says http)
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMLIT_")}
    env[DB_ENV] = _resolved(db)
    if env.get("PYTHONPATH"):  # (the server runs in kvtrace's folder: a relative entry read from the user's)
        env["PYTHONPATH"] = os.pathsep.join(str(Path(p).resolve()) if p else p
                                            for p in env["PYTHONPATH"].split(os.pathsep))
    server: subprocess.Popen | None = None
    relay: _Relay | None = None
    try:
        with signals_held():  # (a stop between the start and here would leave the server unknown)
            sys.stdout.flush()
            try:
                server = _start(server_command(db, host, port), env)
            except OSError as err:  # (a process limit reached, an interpreter this user may not run)
                raise KVTraceError(_not_started(err)) from None
            print(f"kvtrace dashboard: open {page_url(host, port, run, compare)}", file=sys.stderr, flush=True)
            relay = _Relay(server)
        code = server.wait()
        relay.join()
        if code:  # (a server that died: one line, not its traceback)
            raise KVTraceError(_died(code, relay.failure))
        return code
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM raised as Terminated: a server's way to stop
        # SIGTERM either way: a SIGINT passed on while the server still imports printed its
        # KeyboardInterrupt traceback (Streamlit stops as cleanly for SIGTERM once it runs)
        if server is not None:
            _stop(server, signal.SIGTERM)
        if relay is not None:  # (the server's last words before this line)
            relay.join()
        print("kvtrace dashboard: stopped", file=sys.stderr, flush=True)
        return 0


def _not_started(err: OSError) -> str:
    """The one line of a server process that could not be started (fork or exec refused)."""
    from kvtrace.names import printable

    what = f" ({printable(err.filename)})" if err.filename else ""
    return f"cannot start the dashboard server (streamlit): {err.strerror or err}{what}"


def check_streamlit_home() -> None:
    """KVTraceError where the server (Streamlit) would fail on, or print a traceback for, its
    user settings in ``~/.streamlit`` (HOME, or the password database's home without it):
    a HOME that is a file (``HOME=/dev/null``: the server exited at start, its one line
    naming Streamlit's ``secrets.py``), a settings file it may not read, or a ``config.toml``
    that is no TOML (Streamlit printed its parser's traceback and went on without any of it).
    Told before anything starts, naming the file (and its line and column)."""
    import tomllib

    from kvtrace.names import printable

    home = os.path.expanduser("~")  # (Streamlit's Path.home())
    if home == "~":
        return  # (no HOME and no home in the password database: Streamlit reads no settings)
    for name in ("config.toml", "secrets.toml", "credentials.toml"):
        path = os.path.join(home, ".streamlit", name)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            continue
        except OSError as err:
            raise KVTraceError(f"{printable(path)}: cannot read ({err.strerror or err}): the dashboard server "
                               f"(Streamlit) reads its settings there, in HOME ({printable(home)}); set HOME to a "
                               "folder of yours") from None
        if name == "config.toml":
            try:
                tomllib.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
                raise KVTraceError(f"{printable(path)}: not TOML ({err}): Streamlit's settings, which the dashboard "
                                   "server reads; fix or move the file") from None
        elif name == "credentials.toml":
            problem = _credentials_problem(raw)
            if problem is not None:
                raise KVTraceError(f"{printable(path)}: {problem}: Streamlit's credentials, which the dashboard server "
                                   "could not load (it deletes such a file, or stops at its email prompt); fix or move "
                                   "the file")


def _credentials_problem(raw: bytes) -> str | None:
    """Why Streamlit's ``Credentials.load`` would not take a ``credentials.toml`` (it then
    removes the file, prints its email prompt and, with no stdin, exits: a user's file lost
    and the server's start one meaningless line); None where it would."""
    import tomllib

    from kvtrace.names import printable

    try:
        general = tomllib.loads(raw.decode("utf-8")).get("general")
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        return f"not TOML ({err})"
    if not isinstance(general, dict):
        return "expected a [general] table"
    email = general.get("email")
    if not isinstance(email, str):
        return "expected email = \"...\" in [general]"
    if email.strip() and email.strip().count("@") != 1:
        return f"email {printable(repr(email))} is no email address (one '@') or empty"
    return None


# How long a stopped server may take to shut down before it is killed.
STOP_TIMEOUT_S = 10.0
# Run first in the child on Linux: die with the parent (PR_SET_PDEATHSIG = 1, kept across
# exec), or at once if the parent is already gone, then exec the server's argv.
_WITH_PARENT = ("import ctypes, os, signal, sys; ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM); "
                "os.getppid() == int(sys.argv[1]) or os._exit(1); os.execv(sys.argv[2], sys.argv[2:])")


def _start(command: list[str], env: dict[str, str]) -> subprocess.Popen:
    # run in kvtrace's own folder, not the user's: Streamlit reads ``.streamlit/config.toml``
    # (and secrets) from its working directory, and a user's (baseUrlPath "foo") served the
    # dashboard where the address printed 404s. The --db path is absolute already.
    # The server reads no stdin and writes nothing kvtrace does not say better: its stdout
    # holds Streamlit's banner ("You can now view your Streamlit app in your browser", the
    # URL, "Stopping..."), beside kvtrace's own address and `stopped` lines. Both are the null
    # device, never a closed descriptor (`<&-`, `>&-`): a server that inherited none there (or
    # the read end of its own stderr pipe) opened its event loop's at 0 or 1, and libuv
    # aborted it as it stopped ("uv__close: Assertion `fd > STDERR_FILENO' failed", SIGABRT).
    where = str(APP_PATH.parent)
    stdout = subprocess.DEVNULL
    if os.name != "posix":
        return subprocess.Popen(command, env=env, cwd=where, stdin=subprocess.DEVNULL, stdout=stdout,
                                stderr=subprocess.PIPE)
    if sys.platform.startswith("linux"):
        command = [sys.executable, "-S", "-P", "-c", _WITH_PARENT, str(os.getpid()), *command]
    return subprocess.Popen(command, env=env, cwd=where, stdin=subprocess.DEVNULL, stdout=stdout,
                            stderr=subprocess.PIPE, process_group=0)


def _died(code: int, failure: str | None) -> str:
    """The one line a server that ended by itself leaves: its status and what failed."""
    how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
    return f"the dashboard server (streamlit) {how}" + (f": {failure}" if failure else "")


# Lines between a traceback's exception and the next traceback of a chain.
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")


class _Relay:
    """The server's stderr, passed on line by line, but for a traceback: held back until the
    server says more (a logged error it lives on, then shown) or ends (a start that failed:
    its last exception line becomes ``failure``, for the one error line ``launch`` gives)."""

    def __init__(self, server: subprocess.Popen):
        self.failure: str | None = None
        self._last: str | None = None
        self._thread = threading.Thread(target=self._run, args=(server.stderr,), daemon=True)
        self._thread.start()

    def join(self) -> None:
        self._thread.join(STOP_TIMEOUT_S)

    def _run(self, stream: Iterable[bytes] | None) -> None:
        held: list[str] = []
        try:
            for raw in stream or ():
                line = raw.decode("utf-8", "replace")
                if line.startswith("Traceback (most recent call last):") or (held and (
                        line[:1] in (" ", "\t") or not line.strip() or line.startswith(_CHAINED))):
                    held.append(line)
                    continue
                if held and held[-1][:1] in (" ", "\t"):  # the exception line that ends a traceback
                    held.append(line)
                    continue
                self._emit(held)
                held = []
                self._emit([line])
        except (OSError, ValueError):  # (our stderr gone: nothing to tell)
            return
        ending = [line.strip() for line in held if line.strip()]
        where = [line for line in ending if line.startswith('File "')]  # (the frame that raised it)
        self.failure = (ending[-1] + (f" ({where[-1]})" if where else "")) if ending else self._last

    def _emit(self, lines: list[str]) -> None:
        for line in lines:
            if line.strip():
                self._last = line.strip()
            sys.stderr.write(line)
        sys.stderr.flush()


def _stop(server: subprocess.Popen, sig: int) -> None:
    """Pass ``sig`` on to the server and wait for it; kill it when it takes longer than
    ``STOP_TIMEOUT_S`` or when a second interrupt comes meanwhile."""
    try:
        if server.poll() is None:
            server.send_signal(sig)
        server.wait(STOP_TIMEOUT_S)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        server.kill()
        server.wait()
