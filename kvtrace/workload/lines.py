"""Reading trace files line by line, with errors that name the file and the line.

Shared by every reader (the native one here, the public formats in ``kvtrace.replay.readers``):
streamed numbered lines, typed JSON-line decoding (msgspec), field checks, arrival-order
checks, time units and the file digest that identifies a trace in run records.

Arrival times must not decrease within a file: a trace that goes back in time is refused
with the offending line, because silently re-sorting would change which request sees
whose cache and a streaming reader cannot sort without loading everything.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from typing import TypeVar

import msgspec

from kvtrace.errors import TraceFormatError
from kvtrace.numeric import cdiv

MAX_ID = (1 << 63) - 1  # hash ids must fit int64 (Arrow / DuckDB columns downstream)
T = TypeVar("T")


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


def decode_error(path: str, line: int | None, err: Exception) -> TraceFormatError:
    if isinstance(err, msgspec.ValidationError):
        return TraceFormatError(path, line, str(err))
    return TraceFormatError(path, line, f"invalid JSON: {err}")


def typed_lines(path: str, schema: type[T]) -> Iterator[tuple[int, T]]:
    """Each non-blank line decoded as ``schema`` (a msgspec Struct)."""
    decoder = msgspec.json.Decoder(schema)
    for lineno, text in numbered_lines(path):
        try:
            yield lineno, decoder.decode(text)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise decode_error(path, lineno, e) from None


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

    __slots__ = ("last_ns", "path", "what")

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


class AtomicText:
    """Write-then-rename: the target appears only when writing succeeded, so a failed
    conversion never leaves half a trace behind."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.tmp = f"{self.path}.tmp-{os.getpid()}"

    def __enter__(self):
        self.f = open(self.tmp, "wb")
        return self.f

    def __exit__(self, exc_type, exc, tb):
        self.f.close()
        if exc_type is None:
            os.replace(self.tmp, self.path)
        else:
            os.unlink(self.tmp)
        return False
