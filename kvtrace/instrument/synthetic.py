"""A seeded stream of real event objects shaped like an engine replay, for tests and bench.

Each step carries a ``StepExecuted``, a few lookups, evictions, publishes, frees and
copies, and now and then a finished request, a stale hash or a divergent token. The mix
is fixed by ``seed``; nothing reads a clock.
"""

from __future__ import annotations

import hashlib
import random
from typing import Iterator

from kvtrace.cache.events import (
    COPY_PARTIAL_HIT,
    EVICT_LRU,
    PUBLISH_FULL,
    PUBLISH_PARTIAL_TAIL,
    BlockCopied,
    BlockEvicted,
    BlockPublished,
    BlocksFreed,
    PrefixLookup,
    StaleHashLeft,
)
from kvtrace.engine.events import DivergentOutput, RequestFinished, StaleHashFound, StepBatch, StepExecuted

STEP_NS = 20_000_000  # 20 ms per synthetic step


def _hash(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "big")).digest()


def synthetic_steps(num_steps: int, seed: int = 0, events_per_step: int = 12,
                    hashes: int = 4096) -> Iterator[StepBatch]:
    """``num_steps`` StepBatches with about ``events_per_step`` cache events each."""
    rng = random.Random(seed)
    pool = [_hash(i) for i in range(hashes)]
    next_request = 0
    for step in range(num_steps):
        start = step * STEP_NS
        events = []
        engine = []
        while len(events) < events_per_step:
            rid = f"req-{next_request}"
            roll = rng.random()
            group = rng.randrange(2)
            if roll < 0.15:
                n = rng.randint(1, 8)
                hit = rng.randrange(0, 4096, 16)
                events.append(PrefixLookup(step, rid, 4096, hit, (hit, hit - hit % 64), hit, 0,
                                           pool[rng.randrange(hashes)], pool[rng.randrange(hashes)] if hit < 4096 else None,
                                           hit // 16 if hit < 4096 else -1))
            elif roll < 0.40:
                n = rng.randint(1, 4)
                ids = tuple(rng.randrange(100_000) for _ in range(n))
                events.append(BlockEvicted(step, group, EVICT_LRU, ids, tuple(pool[rng.randrange(hashes)] for _ in ids),
                                           tuple(rng.randrange(1000) for _ in ids), tuple(rng.randrange(500) for _ in ids),
                                           rid if rng.random() < 0.9 else None))
            elif roll < 0.80:
                n = rng.randint(1, 8)
                ids = tuple(rng.randrange(100_000) for _ in range(n))
                kind = PUBLISH_FULL if rng.random() < 0.9 else PUBLISH_PARTIAL_TAIL
                events.append(BlockPublished(step, rid, group, kind, ids,
                                             tuple(pool[rng.randrange(hashes)] for _ in ids), 16 * n))
            elif roll < 0.95:
                ids = tuple(rng.randrange(100_000) for _ in range(rng.randint(1, 8)))
                events.append(BlocksFreed(step, rid, group, ids))
            elif roll < 0.99:
                events.append(BlockCopied(step, rid, group, rng.randrange(100_000), rng.randrange(100_000), COPY_PARTIAL_HIT))
            else:
                events.append(StaleHashLeft(step, rid, group, rng.randrange(100_000), pool[rng.randrange(hashes)], 64))
        if rng.random() < 0.3:
            arrival = max(0, start - rng.randrange(10) * STEP_NS)
            itl = tuple(rng.randrange(5_000_000, 30_000_000) for _ in range(rng.randint(0, 6)))
            first_token = start + STEP_NS // 2
            engine.append(RequestFinished(
                f"req-{next_request}", None if rng.random() < 0.5 else f"s{next_request % 7}", arrival,
                arrival + STEP_NS // 4, first_token, first_token + sum(itl), 4096, len(itl) + 1,
                rng.randrange(0, 4096, 16), 0, 1024, 0, 0, itl, ((arrival, first_token, 1024),)))
            next_request += 1
        if rng.random() < 0.02:
            engine.append(StaleHashFound(step, start + STEP_NS // 3, 1, rng.randrange(100_000),
                                         pool[rng.randrange(hashes)], 64, rng.getrandbits(64), rng.getrandbits(64),
                                         f"req-{next_request}"))
        if rng.random() < 0.01:
            engine.append(DivergentOutput(step, start + STEP_NS // 2, f"req-{next_request}", 3, 11, 12))
        yield StepBatch(
            StepExecuted(step, start, start + STEP_NS, rng.randrange(4096), rng.randrange(64), 64, rng.randrange(8),
                         0, 0, (rng.random(), rng.random())),
            events, engine)
