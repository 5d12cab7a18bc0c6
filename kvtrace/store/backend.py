"""Which database a ``--db`` names: a DuckDB file, an embedded ClickHouse, or a server.

- a path (``runs.duckdb``): DuckDB, the default;
- ``chdb:PATH``: embedded ClickHouse (the ``chdb`` package) in the directory PATH;
- ``clickhouse://user:password@host:8123/database`` (``clickhouses://`` for TLS):
  a ClickHouse server through ``clickhouse-connect``; ``?otel_table=NAME`` names the
  OpenTelemetry Collector's traces table (default ``otel_traces``).

Both ClickHouse forms need the optional extra ``kvtrace[clickhouse]``.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

from kvtrace.errors import (
    DUCKDB_MAGIC,
    READ_ONLY_MOUNT,
    ConfigError,
    duckdb_magic,
    file_problem,
    on_read_only_mount,
    read_only_file,
    wal_path,
)
from kvtrace.names import printable, shown_value, without_secrets

CHDB_PREFIX = "chdb:"
SERVER_SCHEMES = ("clickhouse", "clickhouses")
DEFAULT_OTEL_TABLE = "otel_traces"


@dataclass(frozen=True)
class ClickHouseTarget:
    """A ClickHouse database: ``path`` for chdb, else a server address."""

    label: str  # what error messages name: the --db text without the password
    path: str | None = None  # chdb data directory
    host: str = "localhost"
    port: int = 8123
    username: str = "default"
    password: str = ""
    database: str = "default"
    secure: bool = False
    otel_table: str = DEFAULT_OTEL_TABLE

    @property
    def embedded(self) -> bool:
        return self.path is not None

    def directory_problem(self) -> str | None:
        """Why a chdb path cannot hold the embedded ClickHouse (something other than a
        directory is there), else None; a missing one is made by a writer."""
        if self.path is not None and os.path.lexists(self.path) and not os.path.isdir(self.path):
            return "is a file, not a directory; expected chdb:DIR (a directory for the embedded ClickHouse)"
        return None

    def write_problem(self) -> str | None:
        """``directory_problem``, or why a writer may not make a store in the directory: one
        that holds other files and no chdb store (chdb spreads its folders among them:
        ``chdb:/`` wrote data/, metadata/ and store/ into the root). None for a server."""
        problem = self.directory_problem()
        if problem is not None or self.path is None or not os.path.isdir(self.path):
            return problem
        try:
            names = os.listdir(self.path)
        except OSError as err:
            return f"cannot list the directory: {err.strerror or err}"
        if "metadata" in names:  # (chdb's: a store, or one whose creation was cut short)
            return None
        others = sorted(n for n in names if n not in _CHDB_ENTRIES)
        if others:
            shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
            return (f"holds other files ({shown}) and no chdb store; expected chdb:DIR "
                    "naming a new or empty directory, or a chdb store")
        return None


# What chdb makes in its directory before it makes metadata/ (a session killed at once left tmp/)
_CHDB_ENTRIES = frozenset({"tmp", "status", "uuid", "data", "store", "metadata_dropped", "user_files", "flags",
                           "format_schemas", "user_scripts", "user_defined", "preprocessed_configs", "access"})


def check_db_type(db: object) -> None:
    """A ConfigError at ``--db`` for an API caller's store of another type than a path or URL:
    ``str()`` of 0, True, None or a list named a DuckDB file in the current directory."""
    if isinstance(db, bool) or not isinstance(db, (str, os.PathLike)):
        raise ConfigError("--db", shown_value(db), "expected a store's path or URL, a string")
    # Every store reads str(db) as its path: a path-like object of a caller's class whose str()
    # is no path (its repr, '<Mine object at 0x...>') named a DuckDB file in the current
    # directory, even where its __fspath__ raised or gave bytes, and a str() that raised was
    # its own traceback. Refused unless str() and os.fspath() agree on one text.
    try:
        path, text = os.fspath(db), str(db)
    except Exception:  # (whatever a caller's __fspath__ or __str__ raises)
        raise ConfigError("--db", shown_value(db), "expected a store's path or URL: its path cannot be read") from None
    if not (isinstance(path, str) and isinstance(text, str) and str.__eq__(str.__str__(path), str.__str__(text))):
        raise ConfigError("--db", shown_value(db), "expected a store's path or URL, a string or a path whose str() "
                          "is its path")


def is_clickhouse(db: str | os.PathLike) -> bool:
    check_db_type(db)  # (every store's first question: the one place a db's type is read)
    text = str(db)  # (schemes are case-insensitive, RFC 3986: CLICKHOUSE:// is a server too)
    return _is_chdb(text) or text.split("://", 1)[0].lower() in SERVER_SCHEMES


def _is_chdb(text: str) -> bool:
    return text[:len(CHDB_PREFIX)].lower() == CHDB_PREFIX


def clickhouse_target(db: str | os.PathLike) -> ClickHouseTarget:
    """Parse a ClickHouse ``--db`` (``is_clickhouse(db)`` must hold); ConfigError when malformed."""
    text = str(db)
    if _is_chdb(text):
        rest = text[len(CHDB_PREFIX):]
        path, _, query = rest.partition("?")
        if path.startswith("//"):  # chdb:///abs/dir, the URL spelling
            path = path[2:]
        if not path:
            raise ConfigError("--db", text, "expected chdb:PATH (a directory for the embedded ClickHouse)")
        if path.startswith(":") or "://" in path:  # (chdb:://, a URL's spelling: a folder ':' was made)
            raise ConfigError("--db", text, "expected chdb:PATH, a directory's path (write chdb:./NAME for a folder "
                                            "whose name starts with ':'; a server is clickhouse://HOST:8123/DB)")
        opts = parse_qs(query, keep_blank_values=True)  # (an empty ?otel_table= was the default, unsaid)
        try:
            resolved = str(Path(path).resolve())
        except (ValueError, OSError) as err:  # a NUL byte, a path the OS refuses
            raise ConfigError("--db", text, f"not a directory path ({err})") from None
        # (a newline in the path shown as \n, as a DuckDB path is: a one-line error made it a space)
        return ClickHouseTarget(label=printable(text), path=resolved,
                                otel_table=_one(opts, "otel_table", DEFAULT_OTEL_TABLE, text))
    shown = without_secrets(text)  # what errors say: a password is never printed (the userinfo's, the query's)
    try:
        url = urlparse(text)
    except ValueError as err:  # e.g. "Invalid IPv6 URL" for an unclosed [
        raise ConfigError("--db", shown, f"not a URL ({err}); expected clickhouse://user:password@host:8123/database") \
            from None
    if not url.hostname:
        raise ConfigError("--db", shown, "expected clickhouse://user:password@host:8123/database")
    database = url.path.strip("/") or "default"
    if "/" in database:
        raise ConfigError("--db", shown, "the URL path is one database name")
    try:
        port = url.port
    except ValueError:  # (not a number, or past 65535)
        raise ConfigError("--db", shown, "the port must be a number from 1 to 65535") from None
    if port == 0:  # (was read as no port: 8123 was dialled instead)
        raise ConfigError("--db", shown, "the port must be a number from 1 to 65535")
    port = port or (8443 if url.scheme == "clickhouses" else 8123)
    host = f"[{url.hostname}]" if ":" in url.hostname else url.hostname  # an IPv6 address, as a URL writes it
    label = f"{url.scheme}://{url.username + '@' if url.username else ''}{host}:{port}/{database}"
    return ClickHouseTarget(
        label=label, host=url.hostname, port=port, username=unquote(url.username or "default"),
        password=unquote(url.password or ""), database=database, secure=url.scheme == "clickhouses",
        otel_table=_one(parse_qs(url.query, keep_blank_values=True), "otel_table", DEFAULT_OTEL_TABLE, shown),
    )


def _one(opts: dict[str, list[str]], key: str, default: str, text: str) -> str:
    unknown = set(opts) - {key}
    if unknown:
        raise ConfigError("--db", text, f"unknown option {sorted(unknown)[0]!r} (known: {key})")
    values = opts.get(key, [default])
    if len(values) > 1:  # (the last was taken, unsaid)
        raise ConfigError("--db", text, f"{key} is given {len(values)} times")
    if not values[-1].isidentifier():
        raise ConfigError("--db", text, f"{key} must be a table name")
    return values[-1]


# A path DuckDB reads as a location of its own, not a file (its rule: two or more of
# [A-Za-z0-9_] and a colon): md:/motherduck: (its extension downloaded, then the network),
# duckdb: (stripped: another file is opened), my_run: (an extension looked for), s3://...
_URL_LIKE = re.compile(r"[A-Za-z0-9_]{2,}:")
_SQLITE_MAGIC = b"SQLite format 3\x00"


def url_like_problem(path: str) -> str | None:
    """Why ``path`` cannot name a store file: DuckDB reads a ``scheme:`` it knows as a URL or a
    service (``md:`` MotherDuck, ``s3://``), not as a file; None for any other path."""
    if _URL_LIKE.match(path):
        return ("expected a store file path, or chdb:DIR or clickhouse://...; DuckDB would read this as a URL "
                f"or a service (write ./{path} for a file of that name)")
    return None


def duckdb_path_problem(path: str, missing: str | None) -> str | None:
    """Why ``path`` cannot name a DuckDB store file, found without opening it as one; None
    when it can, or when it is missing and ``missing`` is None (a store to create)."""
    if not path or path.startswith(":memory:"):
        # DuckDB opens these as a new in-memory database on each connect: every run lost
        return "expected a database file path (an in-memory DuckDB keeps nothing between connections)"
    problem = url_like_problem(path)
    if problem is not None:
        return problem
    problem = file_problem(path, missing=missing)  # (nothing opened: a FIFO would hang the open)
    if problem is not None:
        return problem if problem == missing else f"{problem}; expected a kvtrace store file"
    # DuckDB reads <file>.wal as <file>'s write-ahead log: a store under that name is replayed
    # into <file> and deleted (its runs lost) by the next writer of <file>
    # (a name with a '?' has its log elsewhere: connection.rewritten_path_problem asks of it)
    if "?" not in path and path.endswith(".wal") and duckdb_magic(path[:-4]) is not None:
        return (f"is the write-ahead log's name of the store {path[:-4]} (DuckDB would take a store here for "
                "that store's log, and delete it); choose another name")
    if duckdb_magic(wal_path(path)):
        return (f"{printable(wal_path(path))} is a DuckDB database of its own, which DuckDB would read as this "
                "store's write-ahead log (and delete); rename that file first")
    try:
        with open(path, "rb") as f:
            head = f.read(len(_SQLITE_MAGIC))
    except OSError:
        return None  # (missing, or unreadable: DuckDB's open says why)
    if head and head[8:12] != DUCKDB_MAGIC:  # (an empty file is a new database to DuckDB)
        if head == _SQLITE_MAGIC:  # (DuckDB would open it through sqlite_scanner, fetched from the network)
            return "a SQLite database, not a DuckDB one; expected a kvtrace store file"
        # told before a command's work, not once a sweep's replays are done and to be stored
        return "not a DuckDB database (expected a kvtrace store file)"
    return truncation_problem(path) if head else None


# DuckDB's file: a main header, then two database headers (each a block of this size, the
# newer by iteration in use), then the blocks. A database header is a checksum and then
# uint64s: iteration, meta_block, free_list, block_count, block_alloc_size, vector_size...
_HEADER_BLOCK = 4096
_DB_HEADER = struct.Struct("<8x5Q")


def truncation_problem(path: str) -> str | None:
    """Why the DuckDB file at ``path`` is cut short: smaller than its newer header's block
    count says, and ending within a block (a copy or a download cut short). A writer's open
    of such a file failed at a block past the end only after it had checkpointed into the
    file, rewriting pages a reader still needed; a cut of the last byte opened without error
    and took new runs that no reader could list. None when whole, or unreadable here."""
    try:
        with open(path, "rb") as f:
            head = f.read(3 * _HEADER_BLOCK)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return None
    if len(head) < 3 * _HEADER_BLOCK:
        return None  # (DuckDB's own open says what is wrong with a file that short)
    headers = [_DB_HEADER.unpack_from(head, at) for at in (_HEADER_BLOCK, 2 * _HEADER_BLOCK)]
    _, _, _, blocks, block_size = max(headers)  # (the newer: iteration first)
    if not (4096 <= block_size <= 1 << 30 and block_size & (block_size - 1) == 0 and blocks < 1 << 40):
        return None  # (a layout this check does not know: left to DuckDB)
    whole = 3 * _HEADER_BLOCK + blocks * block_size
    if size >= whole or (size - 3 * _HEADER_BLOCK) % block_size == 0:
        # (DuckDB writes whole blocks, and cuts free ones off the end just before it writes the
        # header that no longer counts them: a file a kill left there is short, but whole)
        return None
    return (f"corrupt or truncated DuckDB file ({size:,} bytes, where its header counts {whole:,}: a copy or a "
            "download cut short?); nothing is read from or written to it")


READ_ONLY_STORE = "cannot write: Permission denied (a read-only file: nothing is written to it)"
READ_ONLY_MOUNT_STORE = f"{READ_ONLY_MOUNT} (a store on a read-only mount: nothing is written to it)"


def store_to_write_problem(db: str) -> str | None:
    """Why ``db`` cannot name a store to write into, found without opening anything (the
    CLI asks before a command loads DuckDB, so a mistyped --db is told at once); None when
    it may. A malformed ClickHouse URL raises ConfigError."""
    if is_clickhouse(db):
        return clickhouse_target(db).write_problem()
    problem = duckdb_path_problem(db, missing=None)
    if problem is None and read_only_file(db):  # (root's open wrote into a store made read-only on purpose)
        return READ_ONLY_MOUNT_STORE if on_read_only_mount(db) else READ_ONLY_STORE
    if problem is None and not Path(db).parent.is_dir():
        return f"directory {Path(db).parent} does not exist"
    if problem is None and os.path.islink(db) and not os.path.exists(db):  # (written through: its folder counts)
        folder = Path(os.path.realpath(db)).parent
        if not folder.is_dir():
            return f"is a symbolic link into {folder}, which does not exist"
    return problem


def db_label(db: str | os.PathLike) -> str:
    """``db`` as messages name it (a server URL without its password)."""
    return clickhouse_target(db).label if is_clickhouse(db) else str(db)
