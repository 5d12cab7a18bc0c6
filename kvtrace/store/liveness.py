"""Is the process that opened a run still alive? (Used to mark orphaned runs incomplete.)"""

from __future__ import annotations

import os
import socket

from kvtrace.names import cut_middle
from kvtrace.store.errors import StoreError
from kvtrace.store.schema import RUN_STATUSES


def host_name() -> str:
    """Where a writer runs, as a run's ``writer_host`` records it: the host's name and the
    process's pid namespace (a container may share the host's name): a pid is a process there
    alone; the bare name where /proc tells none. A writer alive in such a container was read
    from outside it (or from another such container) as pid 1 or a pid no process of the
    reader's has, so `kvtrace runs` and the dashboard said its run was ``incomplete`` and the
    next writer outside marked it so, while it went on writing."""
    host = socket.gethostname()
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:  # (no /proc: one namespace as far as kvtrace can tell)
        return host
    # (the host's first namespace named too: a writer there recorded its bare name, which a reader
    # in a container of that name took for its own, its pid checked there: incomplete while it
    # went on writing, and marked so by the container's next writer)
    return f"{host} ({namespace})"


def _this_host(host: str | None) -> bool:
    """Whether a writer of ``host`` ran where this process's pids name its processes: this
    ``host_name()``, or the bare host name an earlier kvtrace recorded (in a container, as it
    read it before: its pid checked here)."""
    return host is not None and host in (host_name(), socket.gethostname())


def process_start_token(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (guards against pid reuse); None where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # Field 22 (starttime) counted after the parenthesised command name, which may hold spaces.
    fields = stat[stat.rfind(b")") + 2 :].split()
    return fields[19].decode() if len(fields) > 19 else None


# pid_t is a C int: a stored writer_pid outside 1..PID_MAX names no process (0 and -1 would
# make os.kill address a process group or every process; a larger one overflows it)
PID_MAX = 2**31 - 1


def shown_status(status: str, pid: int | None, host: str | None, start_token: str | None, *, db: str,
                 run_id: str) -> str:
    """The status every reader shows for a run's stored one: a ``running`` run whose writer
    is gone reads ``incomplete`` (until a writer recovers it and stores that)."""
    checked_status(status, db=db, run_id=run_id)
    if status == "running":
        if not writer_alive(pid, host, start_token, db=db, run_id=run_id):
            return "incomplete"
        _note_live_writer(db, run_id, pid, host, start_token)
    return status


# The writers this process found alive behind a ``running`` run, by store (``shown_status``):
# a writer killed with -9 changes nothing in the store's files, so a cache keyed on them alone
# (the dashboard's, ``state.content_state``) showed its run ``running`` for good where every
# other reader said ``incomplete``. ``live_writers_state`` tells the cache when one has died.
_LIVE_WRITERS: dict[str, dict[tuple[int | None, str | None, str | None], str]] = {}
_MAX_NOTED = 4096  # (per store: a store of more live writers than that is re-read as they change)


def _note_live_writer(db: str, run_id: str, pid: int | None, host: str | None, start_token: str | None) -> None:
    writers = _LIVE_WRITERS.setdefault(db, {})
    if len(writers) >= _MAX_NOTED:
        writers.clear()
    writers[(pid, host, start_token)] = run_id


def live_writers_state(db: str) -> tuple:
    """Whether each writer ``shown_status`` found alive behind a running run of ``db`` still
    is (empty where none was found): part of ``state.content_state``, so that it changes
    when such a writer dies (killed with -9), as its run then reads ``incomplete``."""
    writers = _LIVE_WRITERS.get(db)
    if not writers:
        return ()
    alive = []
    for (pid, host, start), run_id in sorted(writers.items(), key=lambda item: repr(item[0])):
        try:
            alive.append((pid, host, start, writer_alive(pid, host, start, db=db, run_id=run_id)))
        except StoreError:  # (noted alive: a valid pid)
            alive.append((pid, host, start, False))
    return tuple(alive)


def checked_status(status: object, *, db: str, run_id: str) -> str:
    """A stored status, checked to be one kvtrace writes (``RUN_STATUSES``): anything else,
    NULL included, is a damaged store, a StoreError naming ``db`` and the run (a reader
    would otherwise take it for finished and read derived tables never written)."""
    if status not in RUN_STATUSES:
        shown = cut_middle(repr(status), 80)
        raise StoreError(db, f"damaged kvtrace store: run {run_id}'s status {shown} is not one of "
                             f"{', '.join(RUN_STATUSES)}")
    return str(status)


def writer_alive(pid: int | None, host: str | None, start_token: str | None, *, db: str, run_id: str) -> bool:
    """False only when we can tell the writer is gone: same host, and the pid is dead or reused.

    The one place a run's ``writer_pid`` read back from a store is used: a value that cannot
    be a process id is a damaged store, a StoreError naming ``db`` and the run.
    """
    if pid is not None and (isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid <= PID_MAX):
        raise StoreError(db, f"damaged kvtrace store: run {run_id}'s writer_pid {pid!r} is not a process id")
    if pid is None or not _this_host(host):
        return host is not None and not _this_host(host)  # another machine or container: assume alive
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        # a process of another user holds the pid: the writer's own, or its pid reused (its
        # start time, readable by anyone, tells which; a reused one left the run running forever)
        pass
    if start_token is not None:
        current = process_start_token(pid)
        if current is not None and current != start_token:
            return False
    return True
