"""Hand-built event batches (real event objects) and store helpers for the instrument tests."""

from __future__ import annotations

import hashlib
from pathlib import Path

import duckdb

from kvtrace.cache.events import (
    COPY_PARTIAL_HIT,
    EVICT_LRU,
    PUBLISH_FULL,
    BlockCopied,
    BlockEvicted,
    BlockPublished,
    BlocksFreed,
    CacheEvent,
    PrefixLookup,
    StaleHashLeft,
)
from kvtrace.engine.events import (
    DivergentOutput,
    EngineEvent,
    RequestFinished,
    StaleHashFound,
    StepBatch,
    StepExecuted,
)


def h(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(4, "big")).digest()


def one_of_each_step(step: int = 3, start_ns: int = 1_000, end_ns: int = 2_200) -> StepBatch:
    """One step holding one event of every kind, in this order (6 cache, 3 engine)."""
    cache: list[CacheEvent] = [
        PrefixLookup(step, "r1", 100, 64, (64, 48), 48, 16, h(1), h(5), 4),
        BlockEvicted(step, 0, EVICT_LRU, (5, 6), (h(50), h(60)), (10, 11), (2, 3), "r1"),
        BlockPublished(step, "r1", 0, PUBLISH_FULL, (1, 2, 3), (h(1), h(2), h(3)), 48),
        BlockCopied(step, "r1", 1, 4, 9, COPY_PARTIAL_HIT),
        BlocksFreed(step, "r0", 0, (7, 8)),
        StaleHashLeft(step, "r1", 1, 9, h(9), 32),
    ]
    engine: list[EngineEvent] = [
        StaleHashFound(step, start_ns + 800, 1, 9, h(9), 32, 123, 2**64 - 5, "r1"),
        DivergentOutput(step, start_ns + 900, "r1", 1, 42, 43),
        RequestFinished("r1", "sess", 100, 900, 1_500, 3_000, 100, 3, 64, 16, 20, 1, 1,
                        (700, 800), ((1_000, 1_500, 20),), num_external_query_tokens=36),  # (its 16 hits asked)
    ]
    return StepBatch(StepExecuted(step, start_ns, end_ns, 20, 1, 1, 0, 1, 0, (0.5, 0.25)), cache, engine)


def store_rows(path: str | Path, run_id: str, columns: str = "*") -> list[dict]:
    """All span rows of a run in append order, as dicts (run_id and seq dropped)."""
    con = duckdb.connect(str(path), read_only=True)
    try:
        cur = con.execute(f"SELECT {columns} FROM spans WHERE run_id = ? ORDER BY seq", [run_id])
        names = [d[0] for d in cur.description]
        rows = [dict(zip(names, r)) for r in cur.fetchall()]
    finally:
        con.close()
    for r in rows:
        r.pop("run_id", None)
        r.pop("seq", None)
    return rows


def count_spans(path: str | Path, run_id: str) -> int:
    con = duckdb.connect(str(path), read_only=True)
    try:
        (count,) = con.execute("SELECT count(*) FROM spans WHERE run_id = ?", [run_id]).fetchall()[0]
        return count
    finally:
        con.close()
