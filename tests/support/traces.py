"""Small native traces that tests write into their own folders."""

from __future__ import annotations

import json
from pathlib import Path


def tiny_hit_trace(path: Path) -> Path:
    """400 requests of 64 blocks (16 tokens each) sharing one block between the first two: an
    unbounded cache hits 16 of 409,600 prompt tokens (0.0039%)."""
    lines: list[dict] = [{"kvtrace_trace": 1, "hash_block_size": 16, "block_size": 16}]
    lines += [{"request_id": f"q{i}", "arrival_ns": i, "input_length": 1024, "output_length": 1,
               "hash_ids": ([7] if i in (0, 1) else [10_000 + i * 64]) + [100_000 + i * 64 + j for j in range(63)]}
              for i in range(400)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path
