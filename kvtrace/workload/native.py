"""kvtrace native trace format, version 1 (JSONL): reader and writer. Also in docs/trace-format.md.

Line 1 is a header object; ``kvtrace_trace`` is the format version, the other keys are
free metadata kept as ``TraceSource.header`` (writers put ``source``, ``generator``)::

    {"kvtrace_trace": 1, "source": "mooncake:sha256...", "block_size": 16}

``block_size`` in the header, when present, is the default for request lines that give
``hash_ids`` without their own ``block_size``.

Every further non-blank line is one request; arrival times must not decrease::

    {"request_id": "r0", "arrival_ns": 0, "session": "s1", "input_length": 40,
     "output_length": 8, "hash_ids": [0, 1, 2], "block_size": 16}
    {"request_id": "r1", "arrival_ns": 1500000, "input_length": 3, "output_length": 2,
     "token_ids": [11, 12, 13], "expected_output": [5, 6], "cache_salt": "tenant-a"}

=================  ======================  =============================================
key                type                    meaning
=================  ======================  =============================================
request_id         str, optional           unique; default ``r<index>`` (0-based)
arrival_ns         int >= 0                arrival time in ns (virtual; trace-relative)
session            str, optional           conversation / agent session
input_length       int >= 1                prompt length in tokens
output_length      int >= 0                tokens to generate
token_ids          [int], optional         the prompt; len == input_length,
                                           each in [0, VOCAB_SIZE)
hash_ids           [int], optional         prefix-chained block ids, each in [0, 2^63);
                                           len == ceil(input_length / block_size),
                                           the last block partial
block_size         int >= 1                tokens per hash id (here or in the header); with hash_ids only
namespace          int >= 0, optional      scope of the hash ids (default 0); with hash_ids only
expected_output    [int], optional         reference output; len == output_length
cache_salt         str, optional           vLLM ``cache_salt`` (first block's extra key);
                                           1-128 chars, no ``@ / \\`` or NUL (vLLM's rule)
=================  ======================  =============================================

Exactly one of ``token_ids`` / ``hash_ids`` is given. Unknown request keys are an error
(they are usually typos); unknown header keys are kept.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

import msgspec

from kvtrace.errors import KVTraceError, TraceFormatError
from kvtrace.names import printable
from kvtrace.workload.lines import (
    JSON_ERRORS,
    MAX_ID,
    MAX_LINE_BYTES,
    VOCAB_SIZE,
    ArrivalOrder,
    AtomicText,
    LineDecoder,
    check_hash_ids,
    check_int,
    decode_error,
    integral_floats,
    numbered_lines,
    refuse_repeated_keys,
)
from kvtrace.workload.request import TraceRequest

FORMAT_VERSION = 1
HEADER_KEY = "kvtrace_trace"
_HEADER_KEYS = frozenset((HEADER_KEY, "block_size"))  # the header's keys a reader reads


class NativeLine(msgspec.Struct, forbid_unknown_fields=True):
    arrival_ns: int
    input_length: int
    output_length: int
    request_id: str | None = None
    session: str | None = None
    token_ids: list[int] | None = None
    hash_ids: list[int] | None = None
    block_size: int | None = None
    namespace: int | None = None  # (None: not given; 0 then, with hash_ids)
    expected_output: list[int] | None = None
    cache_salt: str | None = None


# The salts vLLM 0.33's API takes (``validate_cache_salt``): an empty one, which its cache
# would read as none (``if request.cache_salt``), or one it refuses, came from no vLLM request.
MAX_CACHE_SALT = 128
_SALT_FORBIDDEN = frozenset("@/\\\x00")


def check_cache_salt(path: str, line: int, salt: str | None) -> str | None:
    if salt is not None and (not salt or len(salt) > MAX_CACHE_SALT or not _SALT_FORBIDDEN.isdisjoint(salt)):
        raise TraceFormatError(path, line, f"cache_salt: expected 1 to {MAX_CACHE_SALT} characters without '@', "
                                           f"'/', '\\' or NUL, as vLLM takes it; got {salt!r}"[:240])
    return salt


def parse_header(path: str, lineno: int, text: str) -> dict:
    try:
        header = msgspec.json.decode(text)
        refuse_repeated_keys(text, _HEADER_KEYS)  # (the rest is free metadata, kept as decoded)
    except JSON_ERRORS as e:
        raise decode_error(path, lineno, e, text) from None
    if not isinstance(header, dict) or HEADER_KEY not in header:
        raise TraceFormatError(path, lineno, f'expected a header line {{"{HEADER_KEY}": {FORMAT_VERSION}, ...}}')
    version = header[HEADER_KEY]
    if type(version) is not int or version != FORMAT_VERSION:  # (true and 1.0 equal 1 in Python)
        raise TraceFormatError(
            path, lineno, f"{HEADER_KEY}: unsupported version {header[HEADER_KEY]!r}; expected {FORMAT_VERSION}"
        )
    bs = integral_floats(header.get("block_size"))  # (16.0 as a request line's block_size is read)
    if bs is not None:
        header["block_size"] = check_int(path, lineno, "block_size", bs, 1)
    return header


def read_header(path: str) -> dict:
    for lineno, text in numbered_lines(path):
        return parse_header(path, lineno, text)
    raise TraceFormatError(path, None, "empty file; expected a kvtrace header line")


def read_native(path: str) -> Iterator[TraceRequest]:
    lines = numbered_lines(path)
    first = next(lines, None)
    if first is None:
        raise TraceFormatError(path, None, "empty file; expected a kvtrace header line")
    header = parse_header(path, *first)
    default_bs = header.get("block_size")
    decoder = LineDecoder(NativeLine)
    order = ArrivalOrder(path, "arrival_ns")
    seen: set[str] = set()
    for index, (lineno, text) in enumerate(lines):
        try:
            row = decoder.decode(text)
        except JSON_ERRORS as e:
            raise decode_error(path, lineno, e, text) from None
        n = check_int(path, lineno, "input_length", row.input_length, 1)
        out = check_int(path, lineno, "output_length", row.output_length, 0)
        rid = row.request_id if row.request_id is not None else f"r{index}"
        if rid in seen:
            raise TraceFormatError(path, lineno, f"request_id: {rid!r} appears twice")
        seen.add(rid)
        req = TraceRequest(
            request_id=rid,
            arrival_ns=order.check(row.arrival_ns, lineno),
            input_length=n,
            output_length=out,
            session_id=row.session,
            cache_salt=check_cache_salt(path, lineno, row.cache_salt),
        )
        if (row.token_ids is None) == (row.hash_ids is None):
            raise TraceFormatError(path, lineno, "expected exactly one of token_ids / hash_ids")
        if row.token_ids is not None:
            for key in ("block_size", "namespace"):  # (they were ignored: token ids are keyed by content)
                if getattr(row, key) is not None:
                    raise TraceFormatError(path, lineno, f"{key}: only with hash_ids; token_ids are hashed by their "
                                                         "content at the cache's block size")
            if len(row.token_ids) != n:
                raise TraceFormatError(
                    path, lineno, f"token_ids: expected input_length {n} tokens, got {len(row.token_ids)}"
                )
            if row.token_ids and (min(row.token_ids) < 0 or max(row.token_ids) >= VOCAB_SIZE):
                raise TraceFormatError(path, lineno, f"token_ids: expected ids in [0, {VOCAB_SIZE})")
            import numpy as np  # only token-id traces need it: the readers' error paths stay light

            req.token_ids = np.asarray(row.token_ids, dtype=np.int64)
        else:
            bs = row.block_size if row.block_size is not None else default_bs
            if bs is None:
                raise TraceFormatError(path, lineno, "block_size: required with hash_ids (here or in the header)")
            check_int(path, lineno, "block_size", bs, 1)
            assert row.hash_ids is not None  # exactly one of the two is set (checked above)
            req.hash_ids = check_hash_ids(path, lineno, row.hash_ids, n, bs)
            req.hash_block_size = bs
            req.namespace = check_int(path, lineno, "namespace", row.namespace or 0, 0, MAX_ID)
        if row.expected_output is not None:
            if len(row.expected_output) != out:
                raise TraceFormatError(
                    path, lineno,
                    f"expected_output: expected output_length {out} tokens, got {len(row.expected_output)}",
                )
            if row.expected_output and (min(row.expected_output) < 0 or max(row.expected_output) >= VOCAB_SIZE):
                raise TraceFormatError(path, lineno, f"expected_output: expected ids in [0, {VOCAB_SIZE})")
            req.expected_output = tuple(row.expected_output)
        yield req


# -- writer ------------------------------------------------------------------------------
_encode = msgspec.json.Encoder().encode  # keys in insertion order, no spaces, no floats here


def native_record(req: TraceRequest) -> dict:
    """One request line of the native format (lossless: every TraceRequest field)."""
    rec: dict = {"request_id": req.request_id, "arrival_ns": int(req.arrival_ns)}
    if req.session_id is not None:
        rec["session"] = req.session_id
    rec["input_length"] = int(req.input_length)
    rec["output_length"] = int(req.output_length)
    if req.token_ids is not None:
        import numpy as np

        rec["token_ids"] = np.asarray(req.token_ids, dtype=np.int64).tolist()
    else:
        assert req.hash_ids is not None
        rec["hash_ids"] = [int(h) for h in req.hash_ids]
        rec["block_size"] = int(req.hash_block_size)
        if req.namespace:
            rec["namespace"] = int(req.namespace)
    if req.expected_output is not None:
        rec["expected_output"] = [int(t) for t in req.expected_output]
    if req.cache_salt is not None:
        rec["cache_salt"] = req.cache_salt
    return rec


def write_native(requests: Iterable[TraceRequest], path: str | os.PathLike, *, header: dict | None = None,
                 sources: Iterable[str | os.PathLike] = ()) -> int:
    """Write any request stream (e.g. a ``TraceSource``) as native JSONL, atomically.

    The header gets ``source`` (format and sha256) when ``requests`` has ``format`` and
    ``source_id`` (a ``TraceSource``), plus any ``header`` keys. Returns the number of
    requests written. Output bytes depend only on the requests and the header.
    """
    head: dict = {HEADER_KEY: FORMAT_VERSION}
    fmt, sid = getattr(requests, "format", None), getattr(requests, "source_id", None)
    if fmt is not None and sid is not None:
        head["source"] = f"{fmt}:sha256:{sid}"
    if header:
        head.update({k: v for k, v in header.items() if k != HEADER_KEY})
    n = 0
    out = AtomicText(path, sources)
    with out as f:
        f.write(_encode(head) + b"\n")
        try:
            for req in requests:
                line = _encode(native_record(req))
                if len(line) >= MAX_LINE_BYTES:  # (with its newline, past what every reader takes)
                    # (a file is replaced whole or not at all; a pipe or terminal has what went before)
                    kept = ("nothing written" if out.tmp is not None
                            else f"the header and {_requests(n)} written before it")
                    raise KVTraceError(
                        f"{printable(os.fspath(path))}: request {printable(req.request_id)[:80]} would be a line of "
                        f"{len(line) + 1:,} bytes, past the {MAX_LINE_BYTES >> 20} MiB a trace line may hold (no "
                        f"reader would take it back); {kept} (a larger block size gives fewer hash ids)")
                f.write(line + b"\n")
                n += 1
        except TraceFormatError as err:
            if out.tmp is not None:  # (the file is left as it was: nothing to say of it)
                raise
            # a pipe or a terminal, written in place, has what went before the bad request: a
            # reader of it took a trace cut short for the whole one, the error naming the input alone
            raise type(err)(err.path, err.line, f"{err.what} ({printable(os.fspath(path))}: the header and "
                                            f"{_requests(n)} written before it)") from None
    return n


def _requests(n: int) -> str:
    return f"{n:,} request{'s' * (n != 1)}"
