"""DuckDB database instances, kept and reused: a store file is attached to one, not opened.

``duckdb.connect(path)`` builds a new database instance each time a file is opened anew,
and most of an open's cost is the instance's catalog of built-in functions: an open and
close took 16.5 ms (its connect alone 198 s over ``make test``'s 12,470 opens), where attaching the
file to an instance already built and detaching it takes 4.7 ms (``bench/store_open.py``).
So ``attach`` takes an idle in-memory instance, ``ATTACH``es the file to it and hands back
a connection that ``USE``s it; ``detach`` lets go of the file (DuckDB checkpoints it then,
as it does when a file's last connection closes) and keeps the instance for the next open.

What an open did before, it still does:
- **One instance a file.** A file already attached in this process is shared, as
  DuckDB's own instance cache shares one for ``duckdb.connect``: a second connection in
  the same mode joins it, one in the other mode is refused with DuckDB's own error. No
  other file is ever attached to that instance, so its settings (``threads``,
  ``memory_limit``, ``checkpoint_threshold``: global to an instance) reach that file's
  connections only, and they are reset before the instance serves another file.
- **The same files beside it.** Its spill folder is ``<real path>.tmp``, DuckDB's default
  for a file it opens, and the locks are DuckDB's (held from attach to detach).
- **The same errors.** ``ATTACH`` reads a file as ``connect`` does: a missing file, a
  directory, a truncated or foreign file, a held lock give the same exceptions.
- **A file this process opened with ``duckdb.connect``** (a notebook's own connection) is
  reached through that instance, as before: DuckDB's instance cache shares it in the same
  mode and refuses the other.

A child made by ``fork`` starts afresh: the parent's instances are kept, never used and
never destroyed there (destroying one would checkpoint the parent's file), and a file the
parent held is refused (``duckdb.connect`` handed the child the parent's instance: its
writes went nowhere the parent could see, under no lock).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import duckdb

_KEEP_IDLE = 4  # instances kept for later opens (one a file open at once in practice)
# the settings kvtrace changes on an instance (see module docstring), reset between files where
# changed (a RESET costs about as much as a query: all four were half of a detach); the
# temporary folder always, which DuckDB refuses for an instance that spilled there
_SETTINGS = ("threads", "memory_limit", "checkpoint_threshold")
_SETTINGS_NOW = "SELECT " + ", ".join(f"current_setting('{name}')" for name in _SETTINGS)
SAME_FILE_OTHER_MODE = ("Connection Error: Can't open a connection to same database file with a different "
                        "configuration than existing connections")
HELD_BY_PARENT = ("Connection Error: the file was open in this process's parent when it forked this one, and "
                  "DuckDB's copy of it here is not this process's to use; open it in the parent, or after it lets go")


@dataclass
class _Attached:
    instance: duckdb.DuckDBPyConnection
    alias: str
    read_only: bool
    users: int = 0  # connections handed out and not yet detached (state.users names them)


class _Instances:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.lock = threading.Lock()
        self.idle: list[duckdb.DuckDBPyConnection] = []
        self.files: dict[str, _Attached] = {}  # real path -> its attachment
        self.users: dict[int, str] = {}  # id() of a connection handed out -> real path
        self.made = 0
        self.defaults: tuple | None = None  # _SETTINGS of a new instance (the same for every one)


_state = _Instances()
# what a parent process had (kept alive: see the module docstring): its idle instances, its files
_forked_away: list[tuple[list[duckdb.DuckDBPyConnection], dict[str, _Attached]]] = []


def _start_afresh() -> None:
    _forked_away.append((_state.idle, _state.files))
    _state.reset()


os.register_at_fork(after_in_child=_start_afresh)


def attach(path: str, read_only: bool) -> duckdb.DuckDBPyConnection:
    """A connection to the store file at ``path``, as ``duckdb.connect(path, read_only=...)``
    gives; let it go with ``detach`` (never ``close`` alone: the file stays attached)."""
    real = os.path.realpath(path)
    state = _state
    with state.lock:
        held = state.files.get(real)
        if held is not None:
            if held.read_only != read_only:
                raise duckdb.ConnectionException(SAME_FILE_OTHER_MODE)
            return _hand_out(state, held, real)
        instance = state.idle.pop() if state.idle else _new_instance(state)
        state.made += 1
        alias = f"kvtrace_store_{state.made}"
        try:
            instance.execute(f"SET temp_directory = {_literal(real + '.tmp')}")
            instance.execute(f"ATTACH {_literal(path)} AS {alias} ({'READ_ONLY' if read_only else 'READ_WRITE'})")
        except duckdb.Error as err:
            _retire(state, instance)  # (nothing attached)
            if "Unique file handle conflict" not in str(err):
                raise
            if any(real in files for _, files in _forked_away):
                raise duckdb.ConnectionException(HELD_BY_PARENT) from None
        except BaseException:  # (a stop signal: attached or not, the instance goes)
            instance.close()
            raise
        else:
            held = state.files[real] = _Attached(instance, alias, read_only)
            return _hand_out(state, held, real)
    # Another instance of this process holds the file (a user's own duckdb.connect in a
    # notebook): DuckDB's instance cache hands out a connection to it, in the same mode, as
    # it did before; in another mode it refuses, as it did before.
    return duckdb.connect(path, read_only=read_only)


def _new_instance(state: _Instances) -> duckdb.DuckDBPyConnection:
    instance = duckdb.connect(":memory:")
    if state.defaults is None:
        state.defaults = instance.execute(_SETTINGS_NOW).fetchone()
    return instance


def _hand_out(state: _Instances, held: _Attached, real: str) -> duckdb.DuckDBPyConnection:
    con = held.instance.cursor()
    try:
        con.execute(f"USE {held.alias}")
    except BaseException:
        con.close()
        if not held.users:
            _let_go(state, real, held)
        raise
    held.users += 1
    state.users[id(con)] = real
    return con


def detach(con: duckdb.DuckDBPyConnection) -> None:
    """Close ``con``; the file is detached once its last connection is closed (DuckDB
    checkpoints it there). Closing again is nothing."""
    state = _state
    with state.lock:
        real = state.users.pop(id(con), None)
        con.close()
        if real is None:
            return
        held = state.files[real]
        held.users -= 1
        if not held.users:
            _let_go(state, real, held)


def _let_go(state: _Instances, real: str, held: _Attached) -> None:
    del state.files[real]
    try:
        held.instance.execute(f"DETACH {held.alias}")
    except duckdb.Error:
        # (a checkpoint the disk refused, say): the instance goes, as a connection's close
        # did, which keeps the file as it is (its log is replayed at the next open)
        held.instance.close()
        return
    _retire(state, held.instance)


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _retire(state: _Instances, instance: duckdb.DuckDBPyConnection) -> None:
    """Back to the idle instances, its settings DuckDB's defaults again, or closed (one
    that spilled to its temporary folder cannot be given another: DuckDB refuses)."""
    if len(state.idle) >= _KEEP_IDLE:
        instance.close()
        return
    try:
        now, defaults = instance.execute(_SETTINGS_NOW).fetchone(), state.defaults
        changed = _SETTINGS if now is None or defaults is None else [
            name for name, value, default in zip(_SETTINGS, now, defaults, strict=True) if value != default]
        for setting in (*changed, "temp_directory"):
            instance.execute(f"RESET {setting}")
    except duckdb.Error:
        instance.close()
        return
    state.idle.append(instance)
