"""Shared pieces of the trace readers: the source handle, validation, time conversion.

Every reader is a generator of :class:`~kvtrace.engine.workload.TraceRequest` in file
order. Arrival times must not decrease within a file: a trace that goes back in time is
refused with the offending line, because silently re-sorting would change which request
sees whose cache and a streaming reader cannot sort without loading everything.
"""

from __future__ import annotations

import hashlib
import os
from itertools import islice
from typing import Callable, Iterator

from kvtrace.engine.workload import TraceRequest
from kvtrace.errors import TraceFormatError

MAX_ID = (1 << 63) - 1  # hash ids must fit int64 (Arrow / DuckDB columns downstream)

Reader = Callable[..., Iterator[TraceRequest]]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def ms_to_ns(ms: int | float) -> int:
    if isinstance(ms, int):
        return ms * 1_000_000
    return round(ms * 1e6)


def s_to_ns(s: int | float) -> int:
    if isinstance(s, int):
        return s * 1_000_000_000
    return round(s * 1e9)


def check_int(path: str, line: int | None, key: str, value, minimum: int) -> int:
    # bool is an int subclass in Python; a trace with `true` as a length is malformed.
    if not isinstance(value, int) or isinstance(value, bool):
        raise TraceFormatError(path, line, f"{key}: expected an integer, got {value!r}")
    if value < minimum:
        raise TraceFormatError(path, line, f"{key}: expected >= {minimum}, got {value}")
    return value


def check_hash_ids(
    path: str, line: int | None, hash_ids: list[int], input_length: int, block_size: int, key: str = "hash_ids"
) -> tuple[int, ...]:
    want = cdiv(input_length, block_size)
    if len(hash_ids) != want:
        raise TraceFormatError(
            path, line,
            f"{key}: expected ceil(input_length {input_length} / block_size {block_size}) = {want} ids, "
            f"got {len(hash_ids)}",
        )
    if hash_ids and (min(hash_ids) < 0 or max(hash_ids) > MAX_ID):
        raise TraceFormatError(path, line, f"{key}: ids must lie in [0, 2^63)")
    return tuple(hash_ids)


class ArrivalOrder:
    """Refuses a decreasing arrival time, naming the line."""

    __slots__ = ("path", "last_ns", "what")

    def __init__(self, path: str, what: str):
        self.path, self.last_ns, self.what = path, None, what

    def check(self, arrival_ns: int, line: int | None) -> int:
        last = self.last_ns
        if last is not None and arrival_ns < last:
            raise TraceFormatError(
                self.path, line,
                f"{self.what} goes back in time ({arrival_ns} ns < previous {last} ns); "
                "kvtrace needs the trace sorted by arrival",
            )
        if arrival_ns < 0:
            raise TraceFormatError(self.path, line, f"{self.what}: expected >= 0, got a negative time")
        self.last_ns = arrival_ns
        return arrival_ns


def numbered_lines(path: str) -> Iterator[tuple[int, str]]:
    """(1-based line number, text) for each non-blank line, streamed."""
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise TraceFormatError(path, None, f"cannot open: {e.strerror}") from None
    with f:
        lineno = 0
        try:
            for text in f:
                lineno += 1
                if text.strip():
                    yield lineno, text
        except UnicodeDecodeError:
            raise TraceFormatError(path, lineno + 1, "not UTF-8 text") from None


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def source_sha256(path: str, files: list[str] | None) -> str:
    """sha256 of the file bytes; for a directory, of its sorted (name, sha256) list."""
    if files is None:
        return file_sha256(path)
    h = hashlib.sha256()
    for f in files:
        h.update(os.path.basename(f).encode("utf-8") + b"\0" + file_sha256(f).encode("ascii") + b"\n")
    return h.hexdigest()


class TraceSource:
    """A re-iterable, streaming handle on a trace file (or a WEKA directory).

    Each ``iter()`` reopens the file, so a source can be replayed twice without holding
    its requests in memory. ``source_id`` is the sha256 of the bytes, for run records.
    """

    __slots__ = ("path", "format", "limit", "options", "_reader", "_files", "_source_id")

    def __init__(self, path: str, fmt: str, reader: Reader, limit: int | None, options: dict,
                 files: list[str] | None = None):
        self.path, self.format, self.limit, self.options = path, fmt, limit, options
        self._reader, self._files, self._source_id = reader, files, None

    def __iter__(self) -> Iterator[TraceRequest]:
        it = self._reader(self.path, **self.options)
        return it if self.limit is None else islice(it, self.limit)

    @property
    def source_id(self) -> str:
        if self._source_id is None:
            self._source_id = source_sha256(self.path, self._files)
        return self._source_id

    def __repr__(self) -> str:
        return f"TraceSource(path={self.path!r}, format={self.format!r}, limit={self.limit!r})"
