"""Trace writers: kvtrace native JSONL (lossless) and Mooncake JSONL (structure-preserving).

Both write to a temporary file next to the target and rename it at the end, so a failed
conversion never leaves half a trace behind. Output bytes depend only on the requests.
"""

from __future__ import annotations

import os
from typing import Iterable

import msgspec
import numpy as np

from kvtrace.engine.workload import TraceRequest
from kvtrace.errors import KVTraceError
from kvtrace.replay.readers.native import FORMAT_VERSION, HEADER_KEY

_encode = msgspec.json.Encoder().encode  # keys in insertion order, no spaces, no floats here


class _AtomicText:
    """Write-then-rename; the target appears only when writing succeeded."""

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


def native_record(req: TraceRequest) -> dict:
    rec: dict = {"request_id": req.request_id, "arrival_ns": int(req.arrival_ns)}
    if req.session_id is not None:
        rec["session"] = req.session_id
    rec["input_length"] = int(req.input_length)
    rec["output_length"] = int(req.output_length)
    if req.token_ids is not None:
        rec["token_ids"] = np.asarray(req.token_ids, dtype=np.int64).tolist()
    else:
        rec["hash_ids"] = [int(h) for h in req.hash_ids]
        rec["block_size"] = int(req.hash_block_size)
        if req.namespace:
            rec["namespace"] = int(req.namespace)
    if req.expected_output is not None:
        rec["expected_output"] = [int(t) for t in req.expected_output]
    if req.cache_salt is not None:
        rec["cache_salt"] = req.cache_salt
    return rec


def write_native(requests: Iterable[TraceRequest], path: str | os.PathLike, *, header: dict | None = None) -> int:
    """Write any request stream (e.g. a ``TraceSource``) as kvtrace native JSONL.

    The header gets ``source`` (format and sha256) when ``requests`` is a TraceSource.
    Returns the number of requests written.
    """
    head: dict = {HEADER_KEY: FORMAT_VERSION}
    fmt, sid = getattr(requests, "format", None), getattr(requests, "source_id", None)
    if fmt is not None and sid is not None:
        head["source"] = f"{fmt}:sha256:{sid}"
    if header:
        head.update({k: v for k, v in header.items() if k != HEADER_KEY})
    n = 0
    with _AtomicText(path) as f:
        f.write(_encode(head) + b"\n")
        for req in requests:
            f.write(_encode(native_record(req)) + b"\n")
            n += 1
    return n


class BlockInterner:
    """Gives prefix-chained ids to blocks of content, in order of first appearance.

    The key of a block is (id of the block before it, its content), so equal ids mean an
    equal prefix, exactly what Mooncake's ``hash_ids`` promise. Content is the block's
    tokens, or for hash-id prompts the (namespace, ids) it spans, so no tokens need to be
    materialised when the source's block size divides the target's.
    """

    __slots__ = ("block_size", "_ids")

    def __init__(self, block_size: int):
        if block_size < 1:
            raise KVTraceError(f"block_size: expected >= 1, got {block_size}")
        self.block_size = block_size
        self._ids: dict[tuple, int] = {}

    def _id(self, parent: int, content) -> int:
        key = (parent, content)
        ids = self._ids
        got = ids.get(key)
        if got is None:
            got = ids[key] = len(ids)
        return got

    def block_ids(self, req: TraceRequest) -> list[int]:
        bs = self.block_size
        n = req.input_length
        out: list[int] = []
        parent = -1
        salt = req.cache_salt
        if req.token_ids is None and req.hash_ids is not None and bs % req.hash_block_size == 0:
            per = bs // req.hash_block_size
            ids, ns = req.hash_ids, req.namespace
            for start in range(0, len(ids), per):
                # the ids are the identity (a partial last id is the same block, as
                # in the cache-only convention)
                parent = self._id(parent, (salt if start == 0 else None, ns, tuple(ids[start:start + per])))
                out.append(parent)
            return out
        toks = req.prompt_token_ids()
        for start in range(0, n, bs):
            parent = self._id(parent, (salt if start == 0 else None, toks[start:start + bs].tobytes()))
            out.append(parent)
        return out


def mooncake_record(req: TraceRequest, interner: BlockInterner) -> dict:
    return {
        "timestamp": int(req.arrival_ns) // 1_000_000,
        "input_length": int(req.input_length),
        "output_length": int(req.output_length),
        "hash_ids": interner.block_ids(req),
    }


def write_mooncake(requests: Iterable[TraceRequest], path: str | os.PathLike, *, block_size: int = 512) -> int:
    """Write Mooncake JSONL with ``block_size``-token blocks (512 as the published traces).

    Ids are re-assigned from 0 in order of first appearance, preserving which requests
    share which prefixes (not the token values: a reader re-synthesises tokens from the
    new ids). Timestamps are whole milliseconds (floored). Returns the request count.
    """
    interner = BlockInterner(block_size)
    n = 0
    with _AtomicText(path) as f:
        for req in requests:
            f.write(_encode(mooncake_record(req, interner)) + b"\n")
            n += 1
    return n
