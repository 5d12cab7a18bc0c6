"""User-facing errors: the CLI prints ``str(err)`` as one line and exits non-zero."""

import math
import os
import re
import stat

from kvtrace.names import printable, shown_value

# What str.splitlines splits at: each shown as its escape in an error's one line
_LINE_BREAKS = re.compile("[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")


def _escaped(found: re.Match) -> str:
    return found.group().encode("unicode_escape").decode("ascii")


class KVTraceError(Exception):
    """A user error (bad trace line, config key, database). Never shown with a traceback.

    The message is one line whatever it quotes: a line break in it (in a path or a key from
    a hostile file, in a library's multi-line text) is shown as its escape, ``\\n``, as typed
    (a space there named another file: ``no dir/x.toml`` for ``no\\ndir/x.toml``)."""

    def __init__(self, message: object = "", *args: object):
        text = str(message)
        super().__init__(_LINE_BREAKS.sub(_escaped, text) if text else text, *args)

    def __reduce__(self):
        # Rebuilt from its message and fields, not by calling __init__ again (a subclass's
        # takes other arguments): an error raised in a sweep's worker process reaches the
        # parent whole, as the one line it is, instead of breaking the process pool.
        return _rebuild, (type(self), self.args, self.__dict__)


def _rebuild(cls: type[KVTraceError], args: tuple, fields: dict) -> KVTraceError:
    err = Exception.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(fields)
    return err


class TraceFormatError(KVTraceError):
    def __init__(self, path: str, line: int | None, what: str):
        where = f"{printable(path)}:{line}" if line is not None else printable(path)  # (a newline in it: \n)
        super().__init__(f"{where}: {what}")
        self.path, self.line, self.what = path, line, what


class OutputClosed(KVTraceError):
    """An output's reader went away (a pipe closed: ``-o /dev/stdout | head``): no error of
    the user's, so the CLI exits 141 silently, as it does when stdout's reader goes."""


class ConfigError(KVTraceError):
    """``source: key: what``; ``key`` None for the source as a whole (a missing file)."""

    def __init__(self, source: str, key: str | None, what: str):
        shown = printable(source)  # (a path's newline shown as \n, not joined into a space)
        # (a key or value quoted from an API caller or a file: its escapes shown, never sent raw)
        super().__init__(f"{shown}: {what}" if key is None else f"{shown}: {printable(key)}: {what}")
        self.source, self.key, self.what = source, key, what


def check_option(option: str, value: int | float, minimum: int | float,
                 maximum: int | float | None = None) -> int | float:
    """``value`` of a command-line option, refused as one ConfigError naming the option
    unless it is a finite number in [minimum, maximum] (NaN and inf are refused)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or (isinstance(value, float) and not math.isfinite(value)):
        raise ConfigError(option, shown_value(value), "expected a finite number")
    if value < minimum:
        raise ConfigError(option, shown_value(value), f"expected >= {minimum:,}")
    if maximum is not None and value > maximum:
        raise ConfigError(option, shown_value(value), f"expected at most {maximum:,}")
    return value


MAX_SEED = 2**64 - 1  # numpy's PCG64 takes unsigned seeds; span ids key on 64 bits of it


def check_seed(seed: int, option: str = "--seed") -> int:
    """A seed for workloads, bootstrap resamples and span ids: an int in [0, MAX_SEED]."""
    return int(check_option(option, seed, 0, MAX_SEED))


def check_limit(limit: int | None, option: str = "--limit") -> int | None:
    """A number of requests to read (None: all), refused at its flag unless an int >= 1: a
    negative one reached the trace reader, which named its own parameter ``limit``, and 0
    recorded an empty run (where ``runs --limit 0`` means all: one flag, two meanings)."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ConfigError(option, shown_value(limit),
                          "expected a number of requests >= 1 (without it: the whole trace)")
    return limit


# What a path can be instead of a regular file, as a user is told it.
_NOT_A_FILE = ((stat.S_ISDIR, "is a directory"), (stat.S_ISFIFO, "is a FIFO (a named pipe: read once, never seekable)"),
               (stat.S_ISCHR, "is a character device"), (stat.S_ISBLK, "is a block device"),
               (stat.S_ISSOCK, "is a socket"))


DUCKDB_MAGIC = b"DUCK"  # bytes 8-11 of every DuckDB database file
# the files DuckDB and kvtrace keep beside a store file, by suffix: its write-ahead log, the
# writers' lock, the waiting markers and the creation lock (kvtrace.store.connection)
STORE_SIDE_SUFFIXES = (".wal", ".write-lock", ".writer-waiting", ".reader-waiting", ".creating")


def duckdb_magic(path: str | os.PathLike) -> bool | None:
    """Whether the file starts as a DuckDB database does; None when it is empty, missing
    or unreadable (an empty file is a new database to DuckDB)."""
    try:
        with open(path, "rb") as f:
            head = f.read(12)
    except OSError:
        return None
    return head[8:12] == DUCKDB_MAGIC if head else None


def wal_path(path: str) -> str:
    """The write-ahead log DuckDB 2.0.1 keeps beside the database at ``path``: ``<path>.wal``,
    but with ``.wal`` before the first ``?`` of its real path where it holds one
    (``a?b.duckdb``'s is ``a.wal?b.duckdb``: DuckDB reads a '?' as URL parameters' start)."""
    real = os.path.realpath(path)
    at = real.find("?")
    return f"{path}.wal" if at < 0 else real[:at] + ".wal" + real[at:]


def wal_owner(path: str) -> str | None:
    """The database whose write-ahead log ``path`` is by ``wal_path``'s '?' rule
    (``a.wal?b.duckdb`` is ``a?b.duckdb``'s), else None."""
    real = os.path.realpath(path)
    at = real.find("?")
    if at < 0 or "/" in real[at:] or not real[:at].endswith(".wal"):
        return None
    return real[:at - 4] + real[at:]


def read_only_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a regular file not to be replaced: one this process may not write,
    or one nobody may (0444: root may write anything, and a rename over it replaced a store
    or output a user had made read-only on purpose)."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return False
    return stat.S_ISREG(st.st_mode) and (not st.st_mode & 0o222 or not os.access(path, os.W_OK))


READ_ONLY = "cannot write: Permission denied (a read-only file, not replaced)"
READ_ONLY_MOUNT = "cannot write: Read-only file system"


def on_read_only_mount(path: str | os.PathLike) -> bool:
    """Whether ``path`` lies on a file system mounted read-only (no permission bit says so,
    and os.access says only 'no': a 0644 file there was called a read-only file)."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, ValueError):
        return False


def read_only_problem(path: str | os.PathLike) -> str | None:
    """Why the file ``path`` is not to be written or replaced (``read_only_file``), in the
    words of its cause: a read-only mount, or the file's own mode; None when it may be."""
    if not read_only_file(path):
        return None
    return f"{READ_ONLY_MOUNT} (a read-only mount, not replaced)" if on_read_only_mount(path) else READ_ONLY


def file_problem(path: str | os.PathLike, missing: str | None = "no such file") -> str | None:
    """Why ``path`` cannot be used as a regular file (a trace, a store, a config), in a
    user's words; None when it can, or when it is missing and ``missing`` is None (a file to
    create). Nothing is opened: a FIFO would block the open until a writer came."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return missing
    except OSError as err:  # a name too long, a folder in the path that is a file, a loop
        return f"cannot use this path ({err.strerror or err})"
    except ValueError:  # a NUL byte in the path
        return "not a valid path"
    for test, what in _NOT_A_FILE:
        if test(mode):
            return what
    return None if stat.S_ISREG(mode) else "not a regular file"
