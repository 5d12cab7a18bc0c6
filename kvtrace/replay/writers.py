"""Mooncake JSONL writer (structure-preserving) and the block interner behind it.

The native writer (lossless) is :func:`kvtrace.workload.native.write_native`. Both write
to a temporary file next to the target and rename it at the end, so a failed conversion
never leaves half a trace behind. Output bytes depend only on the requests.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import msgspec

from kvtrace.errors import KVTraceError
from kvtrace.workload import TraceRequest
from kvtrace.workload.lines import AtomicText

_encode = msgspec.json.Encoder().encode  # keys in insertion order, no spaces, no floats here


class BlockInterner:
    """Gives prefix-chained ids to blocks of content, in order of first appearance.

    The key of a block is (id of the block before it, its content), so equal ids mean an
    equal prefix, exactly what Mooncake's ``hash_ids`` promise. Content is the block's
    tokens, or for hash-id prompts the (namespace, ids) it spans, so no tokens need to be
    materialised when the source's block size divides the target's.
    """

    __slots__ = ("_ids", "block_size")

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
    with AtomicText(path) as f:
        for req in requests:
            f.write(_encode(mooncake_record(req, interner)) + b"\n")
            n += 1
    return n
