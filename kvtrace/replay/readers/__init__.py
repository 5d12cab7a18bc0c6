"""Streaming trace readers: ``open_trace(path)`` -> a re-iterable :class:`TraceSource`.

Formats: ``mooncake``, ``bailian``, ``weka`` (a file or a directory of files), ``azure``,
``native`` (kvtrace JSONL, see :mod:`kvtrace.workload.native`). Each yields
``TraceRequest`` in file order and raises ``TraceFormatError`` naming file and line.
"""

from __future__ import annotations

import os
import sys

import msgspec

from kvtrace.errors import TraceFormatError, file_problem
from kvtrace.names import FORMATS
from kvtrace.replay.readers import azure, bailian, mooncake
from kvtrace.replay.readers.azure import read_azure
from kvtrace.replay.readers.bailian import read_bailian
from kvtrace.replay.readers.mooncake import read_mooncake
from kvtrace.replay.readers.source import TraceSource
from kvtrace.replay.readers.weka import read_weka, weka_files
from kvtrace.workload import TraceRequest
from kvtrace.workload.lines import (
    JSON_ERRORS,
    MAX_TOKENS,
    LineTooLong,
    compressed_problem,
    decode_error,
    nul_problem,
    numbered_lines,
    without_bom,
)
from kvtrace.workload.native import HEADER_KEY, read_header, read_native

READERS = {
    "mooncake": read_mooncake,
    "bailian": read_bailian,
    "weka": read_weka,
    "azure": read_azure,
    "native": read_native,
}
# Formats whose hash ids come without a block size in the file (a reader option), and the
# size each reads them at by default.
BLOCK_SIZE_OPTION = {"mooncake": mooncake.DEFAULT_BLOCK_SIZE, "bailian": bailian.DEFAULT_BLOCK_SIZE,
                     "azure": azure.DEFAULT_BLOCK_SIZE}

_KEYS = msgspec.json.Decoder(dict[str, msgspec.Raw])  # a JSON object's keys, its values left unread

__all__ = ["FORMATS", "TraceSource", "detect_format", "open_trace", "read_trace"]


def detect_format(path: str) -> str:
    """Guess the format from the content (first line), falling back to the suffix."""
    _check_not_stdin(path)
    if os.path.isdir(path):
        weka_files(path)
        return "weka"
    problem = file_problem(path, missing="no such file or directory")  # (a FIFO would block the read)
    if problem is not None:
        raise TraceFormatError(path, None, _expected_trace(problem))
    _refuse_compressed(path)
    try:
        first = next(numbered_lines(path), None)
    except LineTooLong:
        if path.endswith(".json"):  # a WEKA conversation on one line (json.dump's way), which it reads whole
            return "weka"
        raise
    if first is None:
        raise TraceFormatError(path, None, "empty file; cannot detect the trace format")
    lineno, text = first
    stripped = text.strip()
    why = ""
    if stripped.startswith("{"):
        try:  # the keys only: a value no reader takes (1e400) is named by the reader, at its key
            obj = _KEYS.decode(stripped)
        except JSON_ERRORS as e:  # (told as a reader tells it: a lone surrogate, nesting too deep)
            obj, why = None, f" ({decode_error(path, lineno, e, stripped).what})"
        if isinstance(obj, dict):
            if HEADER_KEY in obj:
                return "native"
            if "chat_id" in obj:
                return "bailian"
            if "requests" in obj:
                return "weka"
            if "hash_ids" in obj and "timestamp" in obj:
                return "mooncake"
        elif path.endswith(".json"):  # a pretty-printed WEKA conversation
            return "weka"
    elif "ContextTokens" in stripped and "TIMESTAMP" in stripped:
        return "azure"
    else:
        nul = nul_problem(stripped)  # (a file of zeros, as a crash can leave one)
        why = f" ({nul})" if nul else ""
    raise TraceFormatError(
        path, lineno, f"cannot detect the trace format{why}; give --format, one of {', '.join(FORMATS)}"
    )


def open_trace(
    path: str | os.PathLike, format: str | None = None, limit: int | None = None, *, block_size: int | None = None
) -> TraceSource:
    """A streaming source. ``block_size`` overrides the tokens per hash id where the
    format does not carry it (mooncake 512, bailian 16, azure 16 by default)."""
    path = os.fspath(path)
    _check_not_stdin(path)
    fmt = format or detect_format(path)
    if fmt not in READERS:
        raise TraceFormatError(path, None, f"unknown trace format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if limit is not None and (not isinstance(limit, int) or limit < 0):
        raise TraceFormatError(path, None, f"limit: expected an int >= 0, got {limit!r}")
    options: dict = {}
    if block_size is not None:
        if fmt not in BLOCK_SIZE_OPTION:
            raise TraceFormatError(path, None, f"block_size (--trace-block-size): the {fmt} format carries its own "
                                               "block size")
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise TraceFormatError(path, None, f"block_size: expected an int >= 1, got {block_size!r}")
        if block_size > MAX_TOKENS:  # (bounded as a file's own block_size is: a native trace written at
            # 2^40 was refused by its own reader, and an engine replay hashed a trace block's 2^34 units)
            raise TraceFormatError(path, None, f"block_size (--trace-block-size): {block_size:,} is beyond what "
                                               f"kvtrace can replay (at most {MAX_TOKENS:,} tokens)")
        if block_size != BLOCK_SIZE_OPTION[fmt]:  # (the default given: the same reading, the same trace)
            options["block_size"] = block_size
    files = weka_files(path) if fmt == "weka" else None
    problem = file_problem(path) if files is None else None
    if problem is not None:
        raise TraceFormatError(path, None, _expected_trace(problem, fmt))
    if files is None and format is not None:  # (detect_format refused these itself)
        _refuse_compressed(path)
        if _blank(path, fmt):  # (given a format, it replayed 0 requests with exit 0)
            raise TraceFormatError(path, None, f"empty file; expected a trace in the {fmt} format")
    # a limit past any file's length is no limit (islice takes at most sys.maxsize)
    limit = None if limit is None else min(limit, sys.maxsize)
    return TraceSource(path, fmt, READERS[fmt], limit, options, files)


def _blank(path: str, fmt: str) -> bool:
    """Whether the file holds nothing but blanks (and a byte-order mark), as detection reads
    it: an empty file. A line format's first line that is not blank ends the look; a WEKA
    conversation, one JSON document that may be one long line, is scanned in blocks."""
    if fmt != "weka":
        return next(numbered_lines(path), None) is None  # (its errors are the reader's own)
    try:
        with open(path, "rb") as f:
            block = without_bom(f.read(1 << 16))
            while block:
                if block.strip(b" \t\r\n"):
                    return False
                block = f.read(1 << 16)
    except OSError:
        return False  # (the reader names it)
    return True


def _refuse_compressed(path: str) -> None:
    problem = compressed_problem(path)
    if problem is not None:
        raise TraceFormatError(path, None, problem)


def _check_not_stdin(path: str) -> None:
    if path == "-":  # the shell convention for stdin, which a trace cannot be: it is read more than once
        raise TraceFormatError(path, None, "a trace is read more than once, so never from stdin; save it to a file")


def _expected_trace(problem: str, fmt: str | None = None) -> str:
    if problem.startswith("no such"):
        return problem
    what = f"a trace file ({fmt} format)" if fmt else "a trace file or a directory of WEKA conversations"
    return f"{problem}; expected {what}"


def read_trace(
    path: str | os.PathLike, format: str | None = None, limit: int | None = None, **kw
) -> list[TraceRequest]:
    return list(open_trace(path, format, limit, **kw))


def native_header(path: str | os.PathLike) -> dict:
    """The header object of a native trace (its metadata)."""
    return read_header(os.fspath(path))
