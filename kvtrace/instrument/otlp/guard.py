"""What OTLP/HTTP clients may hold of the receiver: connections (a thread each), time and
buffered request bodies.

A socket's timeout ends a read only when the client goes quiet; one that trickles a byte
every few seconds (slowloris) would hold its thread for good. So every connection also has
a deadline for what it is sending now, kept by one watchdog thread that shuts down the
sockets past theirs: the handler's read then ends as if the client had closed.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class ConnectionGuard:
    """Connection slots, per-connection deadlines and a budget of buffered body bytes."""

    def __init__(self, max_connections: int, buffered_bytes: int, watch_interval_s: float = 1.0):
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Lock()
        self._deadlines: dict[socket.socket, float] = {}  # (under _lock) monotonic seconds
        self._budget = buffered_bytes
        self._buffered = 0  # (under _lock)
        self._interval = watch_interval_s
        self._stopped = threading.Event()
        self._watchdog: threading.Thread | None = None

    # -- connections -----------------------------------------------------------------------
    def admit(self) -> bool:
        """Take a connection slot; False when all are held (the caller refuses it at once)."""
        return self._slots.acquire(blocking=False)

    def leave(self, sock: socket.socket) -> None:
        """Give back an admitted connection's slot."""
        with self._lock:
            self._deadlines.pop(sock, None)
        self._slots.release()

    def deadline(self, sock: socket.socket, seconds: float | None) -> None:
        """``sock`` must send what it is sending now within ``seconds`` (None: no deadline,
        while the receiver itself works on the request)."""
        with self._lock:
            if seconds is None:
                self._deadlines.pop(sock, None)
                return
            self._deadlines[sock] = time.monotonic() + seconds
            if self._watchdog is None and not self._stopped.is_set():
                self._watchdog = threading.Thread(target=self._watch, name="kvtrace-otlp-deadlines", daemon=True)
                self._watchdog.start()

    def _watch(self) -> None:
        while not self._stopped.wait(self._interval):
            now = time.monotonic()
            with self._lock:
                late = [s for s, due in self._deadlines.items() if due <= now]
                for s in late:
                    del self._deadlines[s]
            for s in late:
                with contextlib.suppress(OSError):  # (already closed by its handler)
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._stopped.set()

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
