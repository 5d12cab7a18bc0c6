"""Azure LLM inference traces (AzurePublicDataset, 2023/2024 CSV).

Columns used: ``TIMESTAMP`` ("YYYY-MM-DD HH:MM:SS[.fffffff]", taken as UTC),
``ContextTokens``, ``GeneratedTokens``. The trace carries no prompt content, so nothing
may be shared: request *i* gets hash ids ``(i << 24) + j`` in their own namespace, i.e.
tokens unique to that request and derived from its index alone. Arrival times are made
relative to the first row.
"""

from __future__ import annotations

import csv
import hashlib
import re
from collections.abc import Iterator
from datetime import date

from kvtrace.errors import TraceFormatError
from kvtrace.numeric import cdiv
from kvtrace.workload import TraceRequest
from kvtrace.workload.lines import (
    MAX_LINE_BYTES,
    MAX_TIME_NS,
    MAX_TOKENS,
    ArrivalOrder,
    S,
    check_int,
    csv_problem,
    decoded_lines,
    parse_integral,
    row_nul_problem,
)

DEFAULT_BLOCK_SIZE = 16
REQUIRED_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
AZURE_NAMESPACE = int.from_bytes(hashlib.sha256(b"kvtrace/azure").digest()[:8], "big") >> 1
_BLOCKS_PER_REQUEST = 1 << 24
# A prompt's tokens at most: above any model's context window (10M the largest). The trace
# names a length, not content, so every block is made here: 268M tokens in one 80-byte row
# took 5 GB and a minute of a cache-only replay.
MAX_CONTEXT_TOKENS = 1 << 24

_TS = re.compile(r"^(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?(?:Z|\+00:?00)?$", re.ASCII)


def parse_timestamp_ns(text: str) -> int | None:
    """Nanoseconds since 0001-01-01 (no time zones, no floats: exact and locale-free)."""
    m = _TS.match(text.strip())
    if not m:
        return None
    y, mo, d, hh, mm, ss, frac = m.groups()
    try:
        days = date(int(y), int(mo), int(d)).toordinal()
    except ValueError:
        return None
    if int(hh) > 23 or int(mm) > 59 or int(ss) > 60:
        return None
    secs = days * 86_400 + int(hh) * 3600 + int(mm) * 60 + int(ss)
    ns = int((frac or "").ljust(9, "0"))
    return secs * 1_000_000_000 + ns


def _int(path: str, line: int, key: str, text: str | None, minimum: int, maximum: int = MAX_TOKENS) -> int:
    value = parse_integral(text) if isinstance(text, str) else None
    if value is None:
        raise TraceFormatError(path, line, f"{key}: expected an integer, got {text!r}"[:200])
    return check_int(path, line, key, value, minimum, maximum)


def _refuse_nul(path: str, line: int, row: list[str]) -> None:
    """A row holding a NUL byte told as what it is (a file padded with zeros: 'expected 3
    columns, got 1'); nothing where it holds none."""
    problem = row_nul_problem(row)
    if problem is not None:
        raise TraceFormatError(path, line, problem)


def read_azure(path: str, block_size: int = DEFAULT_BLOCK_SIZE) -> Iterator[TraceRequest]:
    try:
        f = open(path, "rb")  # noqa: SIM115  (closed by the with below; open errors named apart)
    except IsADirectoryError:
        raise TraceFormatError(path, None, "is a directory, not a trace file") from None
    except OSError as e:
        raise TraceFormatError(path, None, f"cannot open: {e.strerror}") from None
    with f:
        # a field may be as long as a line (the columns other than the three are ignored, but
        # csv's 128 KiB field limit failed the whole trace on one long one)
        csv.field_size_limit(max(csv.field_size_limit(), MAX_LINE_BYTES))
        reader = csv.reader(decoded_lines(path, f))
        header: list[str] | None = []
        while header is not None and not any(h.strip() for h in header):  # (blank lines before it, as between rows)
            try:
                header = next(reader, None)
            except (csv.Error, UnicodeDecodeError) as e:
                raise TraceFormatError(path, reader.line_num or 1,
                                       f"unreadable CSV header: {csv_problem(e)}") from None
        if header is None:
            raise TraceFormatError(path, 1, "empty file; expected a CSV header")
        head = reader.line_num  # (the header's line, which blank lines may have moved)
        header = [h.strip() for h in header]
        missing = [c for c in REQUIRED_COLUMNS if c not in header]
        if missing:
            _refuse_nul(path, head, header)
            raise TraceFormatError(path, head, f"missing column(s) {missing}; expected {list(REQUIRED_COLUMNS)}")
        twice = [c for c in REQUIRED_COLUMNS if header.count(c) > 1]
        if twice:  # (which one would hold the value?)
            raise TraceFormatError(path, head, f"column {twice[0]} appears {header.count(twice[0])} times")
        its, ictx, igen = (header.index(c) for c in REQUIRED_COLUMNS)
        width = len(header)  # every row has the header's columns: no fewer, no more
        order = ArrivalOrder(path, "TIMESTAMP")
        origin: int | None = None
        last = 0
        first = previous = ""
        index = 0
        while True:
            start = reader.line_num + 1  # (a row's quote may run on: the error names where it began)
            try:
                row = next(reader)
            except StopIteration:
                return
            except csv.Error as e:
                raise TraceFormatError(path, start, f"unreadable CSV row: {csv_problem(e)}"
                                       + (f" (read on to line {reader.line_num})" if reader.line_num > start else "")
                                       ) from None
            line = reader.line_num
            if line > start:  # a quote left open takes the lines after it into one field
                raise TraceFormatError(path, start, f"a quoted field runs on to line {line} (an unterminated "
                                                    "quote?); a row is one line")
            if not row or not any(c.strip() for c in row):
                continue
            if any("\x00" in cell for cell in row):  # (in any column, read or not: the file is damaged there)
                _refuse_nul(path, line, row)
            if len(row) != width:
                raise TraceFormatError(path, line, f"expected {len(header)} columns, got {len(row)}")
            ts = parse_timestamp_ns(row[its])
            if ts is None:
                raise TraceFormatError(path, line, f"TIMESTAMP: expected 'YYYY-MM-DD HH:MM:SS.fff', got {row[its]!r}")
            if origin is None:
                origin, first = ts, row[its].strip()
            elif ts < last:  # (told in the file's own words: the ns after the first row were negative)
                raise TraceFormatError(path, line, f"TIMESTAMP goes back in time ({row[its].strip()!r} < previous "
                                                   f"{previous!r}); kvtrace needs the trace sorted by arrival")
            elif ts - origin >= MAX_TIME_NS:
                raise TraceFormatError(path, line, f"TIMESTAMP: {row[its].strip()!r} is {MAX_TIME_NS // S:,} s or more "
                                                   f"after the first row's {first!r}, past what kvtrace replays")
            last, previous = ts, row[its].strip()
            n = _int(path, line, "ContextTokens", row[ictx], 1, MAX_CONTEXT_TOKENS)
            out = _int(path, line, "GeneratedTokens", row[igen], 0)
            nblocks = cdiv(n, block_size)
            if nblocks > _BLOCKS_PER_REQUEST:  # (2^24 blocks fit: j < 2^24; at one token a block, 2^24 tokens
                # of ContextTokens' own bound were refused as too long)
                raise TraceFormatError(path, line, f"ContextTokens: {n} is too long for block_size {block_size}")
            base = index << 24
            yield TraceRequest(
                request_id=f"r{index}",
                arrival_ns=order.check(ts - origin, line),
                input_length=n,
                output_length=out,
                hash_ids=tuple(range(base, base + nblocks)),
                hash_block_size=block_size,
                namespace=AZURE_NAMESPACE,
            )
            index += 1
