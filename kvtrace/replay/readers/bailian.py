"""Alibaba Bailian (Qwen) JSONL usage traces.

One request per line: ``chat_id`` (>= 0), ``parent_chat_id`` (-1 for the first turn of a
conversation), ``timestamp`` (seconds since the trace start, float), ``input_length``,
``output_length``, ``type`` (e.g. "text"), ``turn`` and ``hash_ids`` (prefix-chained ids
of 16-token blocks, ``len == ceil(input_length / 16)``).

The session of a request is the chat id of its conversation's root turn. A parent that
does not appear earlier in the file (the trace is a window of a longer log) is taken as
the root itself, so the turns after it still share one session.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec

from kvtrace.errors import TraceFormatError
from kvtrace.workload import TraceRequest
from kvtrace.workload.lines import ANOTHER_BLOCK_SIZE, ArrivalOrder, S, check_hash_ids, check_int, typed_lines

DEFAULT_BLOCK_SIZE = 16


class BailianLine(msgspec.Struct):
    chat_id: int
    parent_chat_id: int
    timestamp: int | float
    input_length: int
    output_length: int
    hash_ids: list[int]
    type: str | None = None
    turn: int | None = None


def read_bailian(path: str, block_size: int = DEFAULT_BLOCK_SIZE) -> Iterator[TraceRequest]:
    order = ArrivalOrder(path, "timestamp", S)
    root_of: dict[int, int] = {}
    for lineno, row in typed_lines(path, BailianLine):
        n = check_int(path, lineno, "input_length", row.input_length, 1)
        out = check_int(path, lineno, "output_length", row.output_length, 0)
        cid, parent = row.chat_id, row.parent_chat_id
        if cid < 0:  # (-1 is the parent of a first turn: a chat -1 could be no turn's parent)
            raise TraceFormatError(path, lineno, f"chat_id: expected >= 0, got {cid}")
        if cid in root_of:
            raise TraceFormatError(path, lineno, f"chat_id: {cid} appears twice")
        if parent < -1:
            raise TraceFormatError(path, lineno, f"parent_chat_id: expected -1 or a chat id, got {parent}")
        root = cid if parent == -1 else root_of.get(parent, parent)
        root_of[cid] = root
        yield TraceRequest(
            request_id=f"chat-{cid}",
            arrival_ns=order.check(row.timestamp, lineno),
            input_length=n,
            output_length=out,
            hash_ids=check_hash_ids(path, lineno, row.hash_ids, n, block_size, hint=ANOTHER_BLOCK_SIZE),
            hash_block_size=block_size,
            session_id=str(root),
        )
