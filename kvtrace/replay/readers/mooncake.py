"""Mooncake JSONL (FAST'25 traces, Dynamo ``datagen``).

One request per line: ``timestamp`` (ms since the trace start), ``input_length``,
``output_length``, ``hash_ids`` (prefix-chained ids of ``block_size``-token blocks,
512 in the published traces; ``len == ceil(input_length / block_size)``, the last block
partial). Extra keys are ignored.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec

from kvtrace.workload import TraceRequest
from kvtrace.workload.lines import ANOTHER_BLOCK_SIZE, MS, ArrivalOrder, check_hash_ids, check_int, typed_lines

DEFAULT_BLOCK_SIZE = 512


class MooncakeLine(msgspec.Struct):
    timestamp: int | float
    input_length: int
    output_length: int
    hash_ids: list[int]


def read_mooncake(path: str, block_size: int = DEFAULT_BLOCK_SIZE) -> Iterator[TraceRequest]:
    order = ArrivalOrder(path, "timestamp", MS)
    for index, (lineno, row) in enumerate(typed_lines(path, MooncakeLine)):
        n = check_int(path, lineno, "input_length", row.input_length, 1)
        out = check_int(path, lineno, "output_length", row.output_length, 0)
        yield TraceRequest(
            request_id=f"r{index}",
            arrival_ns=order.check(row.timestamp, lineno),
            input_length=n,
            output_length=out,
            hash_ids=check_hash_ids(path, lineno, row.hash_ids, n, block_size, hint=ANOTHER_BLOCK_SIZE),
            hash_block_size=block_size,
        )
