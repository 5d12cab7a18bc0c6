"""Process plumbing the long-running commands share (ground floor: nothing of kvtrace).

- ``is_ipv6``, ``bracketed``, ``unbracketed``: a host as a socket takes it and as a URL shows it
- ``probe_address``: can this process listen on ``host:port``? Asked before a server
  library tries, so a busy port is one ``kvtrace: error:`` line, not the library's text;
- ``sigterm_as_interrupt``: SIGTERM (``kill``, ``timeout``, a container stop, systemd) and
  SIGHUP (the terminal or the ssh session gone; left ignored under ``nohup``) stop a
  command the way Ctrl-C does, so it flushes, prints its summary and marks its run;
  ``stop_signalled`` says one of them came (whatever a library raised instead), and
  ``stop_handlers_kept`` puts them back after a library that replaces them;
  ``stop_pending``/``raise_stop``: a loop's check, once a step, for a stop whose
  KeyboardInterrupt a finalizer swallowed;
  ``sigterm_blocked``/``sigterm_default``: around a fork, and in the forked worker, so a
  worker dies of SIGTERM or SIGINT rather than take the parent's interrupt for a failure of
  its own (or print its traceback);
  ``worker_start``: that, and the worker dies with its parent, even a parent killed -9;
- ``collector_paused``: the cyclic garbage collector off around a hot loop that makes
  no reference cycles (a cache-only replay, an engine run);
- ``pyarrow_without_pandas``: a recording command's spans built without pyarrow
  importing pandas (0.3 s a process).
"""

from __future__ import annotations

import contextlib
import errno
import gc
import ipaddress
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any


def port_in_use(flag: str) -> str:
    """What a busy port's error line adds: the way out."""
    return f"; choose another with {flag} N, or {flag} 0 for a free one"


def unbracketed(host: str) -> str:
    """``--host`` as the socket takes it: ``[::1]`` (a URL's spelling) is ``::1``."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_ipv6(host: str) -> bool:
    """``host`` is an IPv6 address (served on an IPv6 socket; a name is looked up as IPv4)."""
    try:
        return ipaddress.ip_address(unbracketed(host).split("%", 1)[0]).version == 6
    except ValueError:
        return False


def bracketed(host: str) -> str:
    """``host`` as a URL or gRPC target spells it: an IPv6 address in brackets."""
    return f"[{host}]" if is_ipv6(host) and not host.startswith("[") else host


def probe_address(host: str, port: int, what: str, flag: str = "--port") -> None:
    """Raise OSError ``cannot listen on HOST:PORT (WHAT): why`` when ``host:port`` cannot
    be bound (in use, or not an address here); a port in use names ``flag``'s way out.

    Binds and closes a plain TCP socket on every address ``host`` resolves to, with
    SO_REUSEADDR as servers set it (a port in TIME_WAIT is fine, one with a listener is
    not). Port 0 (any free port) always can be bound.
    """
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as err:
        raise OSError(f"cannot listen on {bracketed(host)}:{port} ({what}): {getattr(err, 'strerror', None) or err}"
                      ) from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(address)
            except OSError as err:
                hint = port_in_use(flag) if err.errno == errno.EADDRINUSE else ""
                raise OSError(f"cannot listen on {bracketed(host)}:{port} ({what}): {err.strerror or err}{hint}"
                              ) from None


def free_port(host: str) -> int:
    """A port free on ``host`` now, picked by the kernel (a server's ``--port 0``, where the
    address must be printed before the server itself binds it)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as s:
            s.bind(address)
            return int(s.getsockname()[1])
    except (OSError, UnicodeError) as err:
        raise OSError(f"cannot listen on {bracketed(host)}:0: {getattr(err, 'strerror', None) or err}") from None


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (its name the exception's text), raised where Ctrl-C would be: every
    Ctrl-C path (flush, summary, the run marked) runs for it too; the CLI exits 128 + the
    signal's number for it (143, 129), as a process killed by it would."""


# What stops a command as Ctrl-C does, raised as Terminated: `kill`, `timeout`, a container
# stop; and the terminal or ssh session closing, which killed a replay mid-second before
TERMINATING = (signal.SIGTERM, signal.SIGHUP)
STOP_SIGNALS = (signal.SIGINT, *TERMINATING)

_terminated = threading.Event()
_terminated_by = [signal.SIGTERM]  # the latest of TERMINATING that set _terminated
_stopped = threading.Event()  # SIGINT, SIGTERM or SIGHUP arrived in a sigterm_as_interrupt block
# The same, cleared when the outermost block ends (a later replay in this process, a test's,
# does not stop for an earlier command's Ctrl-C)
_pending = threading.Event()
# A KeyboardInterrupt of the handlers' was raised inside a finalizer (a ``__del__``, a
# weakref callback, a generator closed by the GC), which Python reports and drops
_swallowed = threading.Event()


def terminated() -> signal.Signals | None:
    """Which of SIGTERM and SIGHUP arrived in a ``sigterm_as_interrupt`` block, if one did
    (a library between the raise and the caller, typer for one, may have turned the
    exception into an exit code)."""
    return _terminated_by[0] if _terminated.is_set() else None


def stop_exception() -> KeyboardInterrupt:
    """What the latest stop raised, to raise again where a library turned it into its own
    error: ``Terminated`` for SIGTERM or SIGHUP, else KeyboardInterrupt."""
    by = terminated()
    return stop_for(by) if by is not None else KeyboardInterrupt()


def stop_for(signum: int) -> KeyboardInterrupt:
    """What a stop signal raises: ``Terminated`` (named) for SIGTERM or SIGHUP, else KeyboardInterrupt."""
    return Terminated(signal.Signals(signum).name) if signum in TERMINATING else KeyboardInterrupt()


def _terminate(signum: int) -> None:
    _terminated_by[0] = signal.Signals(signum)
    _terminated.set()


def stop_signalled() -> bool:
    """Whether Ctrl-C or SIGTERM arrived in a ``sigterm_as_interrupt`` block. A library may
    catch the KeyboardInterrupt and raise its own error instead (DuckDB: "Query interrupted",
    an aborted transaction), with nothing in its context to tell it from a failure."""
    return _stopped.is_set()


# Whether a stop came in this command's block: a loop checks it once a step (a bound
# method: no lookup on the hot path) and then calls ``raise_stop``.
stop_pending: Callable[[], bool] = _pending.is_set


def raise_stop() -> None:
    """Raise what the handler raised: ``Terminated`` for SIGTERM or SIGHUP, else KeyboardInterrupt.

    Where the handler ran inside a finalizer, Python dropped its exception ("Exception
    ignored in ...") and the command went on, finishing with exit 0; a loop that finds
    ``stop_pending`` calls this, and stops as if the interrupt had reached it."""
    raise stop_exception()


def stop_swallowed() -> bool:
    """Whether a finalizer dropped the KeyboardInterrupt of the latest stop in this command's
    block (the command may have finished without any loop seeing it)."""
    return _swallowed.is_set()


def _hangup_ignored(sig: int) -> bool:
    """Whether ``sig`` is a SIGHUP this process ignores (started by ``nohup``, or after
    ``trap '' HUP``): the user asked to outlive the terminal, so it stays ignored."""
    return sig == signal.SIGHUP and signal.getsignal(sig) is signal.SIG_IGN


def handled_stop_signals() -> tuple[signal.Signals, ...]:
    """The stop signals a handler is installed for: ``STOP_SIGNALS`` but an ignored SIGHUP."""
    return tuple(sig for sig in STOP_SIGNALS if not _hangup_ignored(sig))


def _interrupt(signum, frame) -> None:
    _terminate(signum)
    _stop()
    raise stop_for(signum)


def _keyboard_interrupt(signum, frame) -> None:
    _stop()
    raise KeyboardInterrupt


def _stop() -> None:
    _stopped.set()
    _pending.set()
    # ``stop_swallowed`` is of the latest stop: a server whose first Ctrl-C a finalizer
    # dropped stops normally at the second
    _swallowed.clear()


def _unraisable(previous: Callable[[Any], Any]) -> Callable[[Any], None]:
    """``sys.unraisablehook`` for the block: a stop's KeyboardInterrupt dropped in a finalizer
    is remembered, not printed (its traceback was the only trace; the next step stops for it)."""

    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt) and _pending.is_set():
            _swallowed.set()
            return
        previous(unraisable)

    return hook


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise ``Terminated`` (a KeyboardInterrupt) in
    the main thread, as SIGINT does; the previous handlers are restored after. A SIGHUP the
    process was started ignoring (``nohup``) stays ignored. Off the main thread (where
    Python cannot install handlers) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    previous_hup = signal.getsignal(signal.SIGHUP)
    if not _hangup_ignored(signal.SIGHUP):
        signal.signal(signal.SIGHUP, _interrupt)
    outermost = previous is not _interrupt  # a new command, no SIGTERM seen yet
    previous_hook = sys.unraisablehook
    if outermost:
        _terminated.clear()
        _stopped.clear()
        _pending.clear()
        _swallowed.clear()
        sys.unraisablehook = _unraisable(previous_hook)
    # Ctrl-C as Python's own handler does it, remembered (another handler is left alone)
    previous_int = signal.getsignal(signal.SIGINT)
    if previous_int is signal.default_int_handler:
        signal.signal(signal.SIGINT, _keyboard_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if previous_hup is not signal.SIG_IGN:
            signal.signal(signal.SIGHUP, signal.SIG_DFL if previous_hup is None else previous_hup)
        if previous_int is signal.default_int_handler:
            signal.signal(signal.SIGINT, previous_int)
        if outermost:
            _pending.clear()
            sys.unraisablehook = previous_hook


@contextlib.contextmanager
def stop_handlers_kept() -> Iterator[None]:
    """The stop signals' handlers (SIGINT, SIGTERM, SIGHUP) as they were before the block, put
    back after it: a library whose set-up installs its own (``ray.init``: a ``sys.exit`` for
    SIGTERM, and a C handler that prints a crash dump) leaves the command's stop paths as they were."""
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        if threading.current_thread() is threading.main_thread():
            for sig, handler in handlers.items():
                if handler is not None:  # (set even when Python's table still names it: a C handler may sit below)
                    signal.signal(sig, handler)


@contextlib.contextmanager
def stop_requested() -> Iterator[threading.Event]:
    """An event set by Ctrl-C, SIGTERM or SIGHUP within the block, instead of an exception
    raised wherever the main thread happens to be: a loop that must not stop mid-item (a
    capture halfway through a batch) checks it between items. A second signal while stopping
    raises as usual (a stop that takes too long can still be forced). SIGTERM and SIGHUP are
    remembered for ``terminated``; an ignored SIGHUP (``nohup``) stays ignored. Off the main
    thread the event is never set."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def request(signum, frame) -> None:
        _stopped.set()
        if signum in TERMINATING:
            _terminate(signum)
        if stop.is_set():  # the second one: forced
            raise stop_for(signum)
        stop.set()

    previous = {sig: signal.signal(sig, request) for sig in handled_stop_signals()}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


_WORKER_DEFAULTS = set(STOP_SIGNALS)  # what kills a forked worker as it would kill any process


@contextlib.contextmanager
def sigterm_blocked() -> Iterator[None]:
    """SIGTERM, SIGINT and SIGHUP held (not lost) within the block: a child forked in it
    starts with them held; one that arrives meanwhile is delivered when the block ends."""
    signal.pthread_sigmask(signal.SIG_BLOCK, _WORKER_DEFAULTS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _WORKER_DEFAULTS)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP held within the block, delivered when it ends: the steps inside
    (renames that make a result appear whole, the removal of a half-written one, a commit
    and the buffer it empties) are not cut in half by an interrupt.

    Held by the handlers, not the signal mask: a mask is the calling thread's, and the
    kernel gave the signal to another thread (DuckDB's, chdb's), whose C handler had the
    main thread raise inside the block all the same. Off the main thread, where Python
    raises no signal's exception, nothing is needed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: arrived.append(signum))
                for sig in STOP_SIGNALS
                if signal.getsignal(sig) is not None}  # (a C handler, which could not be put back, left as it is)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for signum in dict.fromkeys(arrived):  # each once, in order, to the handler it was for
            signal.raise_signal(signum)


def remove_dead_leftovers(folder: str | os.PathLike[str], owner: Callable[[str], int | None],
                          remove: Callable[[str], object] = os.unlink) -> None:
    """Remove what writers killed with -9 left in ``folder`` (nothing else cleans up after a
    kill): each entry whose name ``owner`` reads a pid from, where no process has that pid
    any more. A live writer's entries stay, and so do this process's."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(os.fspath(folder)):
            pid = owner(entry.name)
            if pid is None or pid <= 0 or pid == os.getpid():
                continue
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                with contextlib.suppress(OSError):
                    remove(entry.path)
            except (PermissionError, OverflowError):
                continue  # (another user's live process; a pid no process can have)


def pid_after(prefix: str, name: str, end: str = "") -> int | None:
    """The decimal pid in ``name`` right after ``prefix`` (up to ``end``, when given), or None
    when the name is not of that shape."""
    if not name.startswith(prefix):
        return None
    pid = name[len(prefix):]
    if end:
        pid = pid.partition(end)[0]
    return int(pid) if pid.isascii() and pid.isdigit() else None


def sigterm_default() -> None:
    """In a child forked inside ``sigterm_blocked``: SIGTERM, SIGINT and SIGHUP kill it again (the
    parent's ``sigterm_as_interrupt`` handlers are dropped), then unheld. A Ctrl-C to the
    process group raised the parent's KeyboardInterrupt in an idle pool worker, which
    printed its traceback ("Process ForkProcess-1: ..."); the parent stops for it alone.
    A signal the command ignores (SIGINT of ``kvtrace ... &`` in a script) stays ignored: a
    Ctrl-C to the group killed every worker of a command that went on, which then failed."""
    for sig in _WORKER_DEFAULTS:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _WORKER_DEFAULTS)


def worker_start(parent_pid: int) -> None:
    """A pool worker's initializer (forked inside ``sigterm_blocked``): ``sigterm_default``,
    and on Linux the worker dies with its parent however the parent dies (a ``kill -9``
    left workers blocked on their result pipe for good): ``PR_SET_PDEATHSIG``, or at once
    when the parent is already gone."""
    sigterm_default()
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
        if os.getppid() != parent_pid:
            os._exit(1)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic garbage collection inside the block (as it was again after it).

    For a loop that makes many short-lived containers and no cycles: reference counting
    frees them at once, and the collector's passes over them are pure cost (about 6% of
    cache-only replay, 8% of an engine run). The switch is process-wide: cycles made meanwhile, by any thread,
    are collected after the block. No effect on results: the collector frees memory only.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def pyarrow_without_pandas() -> None:
    """Let pyarrow find pandas absent in this process (a recording command's).

    pyarrow checks each value it converts for a pandas object, importing pandas to do so
    the first time: 0.3 s of every ``replay --db`` (pandas is installed for the dashboard's
    Streamlit, which serves in a process of its own). kvtrace never hands pyarrow a pandas
    object, so the first check is made here with pandas hidden; pyarrow remembers the
    answer, so its own pandas conversions are off in this process, while ``import pandas``
    works as before. Nothing happens when pandas is already imported (the check is then free).
    """
    if "pandas" in sys.modules:
        return
    import pyarrow as pa

    hidden = _Hidden("pandas")
    sys.meta_path.insert(0, hidden)
    try:
        pa.array([0])
    finally:
        sys.meta_path.remove(hidden)


class _Hidden:
    """A meta path finder to which one top-level package is not installed."""

    def __init__(self, name: str):
        self.name = name

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname == self.name:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None
