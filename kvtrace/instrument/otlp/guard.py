"""What OTLP/HTTP clients may hold of the receiver: connections (a thread each), time and
buffered request bodies.

A socket's timeout ends a read only when the client goes quiet; one that trickles a byte
every few seconds (slowloris) would hold its thread for good. So every connection also has
a deadline for what it is sending now, kept by one watchdog thread that shuts down the
sockets past theirs: the handler's read then ends as if the client had closed.
``Deadlines`` is that watchdog; the gRPC receiver uses it too, to cancel a call whose
request message has not come in time (it held one of gRPC's worker threads meanwhile).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Hashable


class Deadlines:
    """One watchdog thread (started on first use) that calls a key's ``on_late`` once its
    deadline passes, unless the deadline was cleared first."""

    def __init__(self, watch_interval_s: float = 1.0, name: str = "kvtrace-otlp-deadlines"):
        self._lock = threading.Lock()
        self._due: dict[Hashable, tuple[float, Callable[[], object]]] = {}  # (under _lock) monotonic s
        self._interval = watch_interval_s
        self._name = name
        self._stopped = threading.Event()
        self._watchdog: threading.Thread | None = None

    def set(self, key: Hashable, seconds: float, on_late: Callable[[], object]) -> None:
        """``on_late()`` in ``seconds`` (on the watchdog's thread), unless ``clear(key)`` comes first."""
        with self._lock:
            self._due[key] = (time.monotonic() + seconds, on_late)
            if self._watchdog is None and not self._stopped.is_set():
                self._watchdog = threading.Thread(target=self._watch, name=self._name, daemon=True)
                self._watchdog.start()

    def clear(self, key: Hashable) -> None:
        with self._lock:
            self._due.pop(key, None)

    def _watch(self) -> None:
        while not self._stopped.wait(self._interval):
            now = time.monotonic()
            with self._lock:
                late = [(k, f) for k, (due, f) in self._due.items() if due <= now]
                for k, _ in late:
                    del self._due[k]
            for _, on_late in late:
                with contextlib.suppress(Exception):  # (a socket already closed, a call already ended)
                    on_late()

    def close(self) -> None:
        """Stop the watchdog and wait for it (it wakes at once: a stopped collector left
        it running for up to its interval)."""
        self._stopped.set()
        with self._lock:
            watchdog = self._watchdog
        if watchdog is not None and watchdog is not threading.current_thread():
            watchdog.join()


def _shut(sock: socket.socket) -> None:
    sock.shutdown(socket.SHUT_RDWR)


class ConnectionGuard:
    """Connection slots, per-connection deadlines and a budget of buffered body bytes."""

    def __init__(self, max_connections: int, buffered_bytes: int, watch_interval_s: float = 1.0):
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Lock()
        self.deadlines = Deadlines(watch_interval_s)  # (the gRPC receiver's calls' too)
        self._budget = buffered_bytes
        self._buffered = 0  # (under _lock)

    # -- connections -----------------------------------------------------------------------
    def admit(self) -> bool:
        """Take a connection slot; False when all are held (the caller refuses it at once)."""
        return self._slots.acquire(blocking=False)

    def leave(self, sock: socket.socket) -> None:
        """Give back an admitted connection's slot."""
        self.deadlines.clear(sock)
        self._slots.release()

    def deadline(self, sock: socket.socket, seconds: float | None) -> None:
        """``sock`` must send what it is sending now within ``seconds`` (None: no deadline,
        while the receiver itself works on the request)."""
        if seconds is None:
            self.deadlines.clear(sock)
        else:
            self.deadlines.set(sock, seconds, lambda: _shut(sock))

    def close(self) -> None:
        self.deadlines.close()

    # -- buffered bodies -------------------------------------------------------------------
    def reserve(self, nbytes: int) -> bool:
        """Count ``nbytes`` of a body about to be read against the budget; False (nothing
        counted) when it would pass it. Give them back with ``release``."""
        with self._lock:
            if self._buffered + nbytes > self._budget:
                return False
            self._buffered += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self._buffered -= nbytes
