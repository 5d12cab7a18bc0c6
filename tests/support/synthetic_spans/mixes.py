"""The light and heavy event mixes (see the package docstring)."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator

import numpy as np

from kvtrace.cache.events import (
    COPY_EXTERNAL,
    COPY_PARTIAL_HIT,
    COPY_RUNNING_TAIL,
    EVICT_CONNECTOR,
    EVICT_LRU,
    EVICT_REPLACED,
    EVICT_STALE_HASH,
    PUBLISH_BOUNDARY,
    PUBLISH_CHECKPOINT,
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
from kvtrace.instrument import DuckDBSpanExporter
from tests.support.synthetic_spans.span_path import span_batches

STEP_NS = 20_000_000  # 20 ms per synthetic step


# --- light mix ---------------------------------------------------------------------------------
def _hash(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "big")).digest()


def synthetic_steps(num_steps: int, seed: int = 0, events_per_step: int = 12,
                    hashes: int = 4096) -> Iterator[StepBatch]:
    """``num_steps`` StepBatches with about ``events_per_step`` cache events each: every
    cache event kind, now and then a finished request, a stale hash or a divergent token."""
    rng = random.Random(seed)
    pool = [_hash(i) for i in range(hashes)]
    pick = lambda: pool[rng.randrange(hashes)]
    next_request = 0
    for step in range(num_steps):
        start = step * STEP_NS
        events: list = []
        engine: list = []
        while len(events) < events_per_step:
            rid = f"req-{next_request}"
            roll = rng.random()
            group = rng.randrange(2)
            if roll < 0.15:
                n = rng.randint(1, 8)
                hit = rng.randrange(0, 4096, 16)
                events.append(PrefixLookup(step, rid, 4096, hit, (hit, hit - hit % 64), hit, 0, pick(),
                                           pick() if hit < 4096 else None, hit // 16 if hit < 4096 else -1))
            elif roll < 0.40:
                n = rng.randint(1, 4)
                ids = tuple(rng.randrange(100_000) for _ in range(n))
                events.append(BlockEvicted(step, group, EVICT_LRU, ids, tuple(pick() for _ in ids),
                                           tuple(rng.randrange(1000) for _ in ids),
                                           tuple(rng.randrange(500) for _ in ids), rid if rng.random() < 0.9 else None))
            elif roll < 0.80:
                n = rng.randint(1, 8)
                ids = tuple(rng.randrange(100_000) for _ in range(n))
                kind = PUBLISH_FULL if rng.random() < 0.9 else PUBLISH_PARTIAL_TAIL
                events.append(BlockPublished(step, rid, group, kind, ids, tuple(pick() for _ in ids), 16 * n))
            elif roll < 0.95:
                ids = tuple(rng.randrange(100_000) for _ in range(rng.randint(1, 8)))
                events.append(BlocksFreed(step, rid, group, ids))
            elif roll < 0.99:
                events.append(BlockCopied(step, rid, group, rng.randrange(100_000), rng.randrange(100_000),
                                          COPY_PARTIAL_HIT))
            else:
                events.append(StaleHashLeft(step, rid, group, rng.randrange(100_000), pick(), 64))
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
            engine.append(StaleHashFound(step, start + STEP_NS // 3, 1, rng.randrange(100_000), pick(), 64,
                                         rng.getrandbits(64), rng.getrandbits(64), f"req-{next_request}"))
        if rng.random() < 0.01:
            engine.append(DivergentOutput(step, start + STEP_NS // 2, f"req-{next_request}", 3, 11, 12))
        yield StepBatch(
            StepExecuted(step, start, start + STEP_NS, rng.randrange(4096), rng.randrange(64), 64, rng.randrange(8),
                         0, 0, (rng.random(), rng.random())),
            events, engine)


# --- heavy mix (store benchmarks) --------------------------------------------------------------
SPANS_PER_STEP = 47  # 1 step + 2 lookups + 14 evictions + 18 publishes + 2 CoW + 8 frees + 2 requests
NUM_BLOCKS = 60_000
NUM_HASHES = 1 << 21
NUM_PREFIXES = 2_000
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_EVICT_REASONS = [EVICT_LRU] * 3 + [EVICT_STALE_HASH, EVICT_REPLACED, EVICT_CONNECTOR]
_PUBLISH_KINDS = [PUBLISH_FULL] * 6 + [PUBLISH_PARTIAL_TAIL, PUBLISH_CHECKPOINT, PUBLISH_BOUNDARY]
_COPY_REASONS = [COPY_PARTIAL_HIT, COPY_RUNNING_TAIL, COPY_EXTERNAL]


def _hash_values(ids: np.ndarray) -> list[int]:
    """Hash ids -> int64 block hashes (rendered as 16 hex digits, spread by a golden multiply)."""
    return (ids.astype(np.uint64) * _GOLDEN).view(np.int64).tolist()


def _split(flat: list, lengths: np.ndarray) -> list[tuple]:
    out, at = [], 0
    for end in np.cumsum(lengths).tolist():
        out.append(tuple(flat[at:end]))
        at = end
    return out


def _names(prefix: str, ids: np.ndarray) -> list[str]:
    return [f"{prefix}{i}" for i in ids.tolist()]


class HeavyMix:
    """The store benchmarks' mix (see the module docstring); state carries over chunks:
    request numbering and the recently evicted hashes that lookups miss on."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.recent_evicted = np.zeros(0, dtype=np.int64)  # hash ids evicted lately (group 0)
        self.next_request = 0

    def _zipf(self, n: int, size: int, a: float = 1.2) -> np.ndarray:
        return (self.rng.zipf(a, size) - 1) % n

    def steps(self, step0: int, num_steps: int) -> list[StepBatch]:
        """The events of steps [step0, step0 + num_steps)."""
        rng, n = self.rng, num_steps
        steps = np.arange(step0, step0 + n)
        ints = lambda lo, hi, size: rng.integers(lo, hi, size).tolist()
        rid = lambda size, hi: _names("req-", self.next_request + rng.integers(0, hi, size))

        ev_len = rng.integers(1, 5, 14 * n)
        ev_blocks = rng.integers(0, NUM_BLOCKS, ev_len.sum())
        ev_hash_ids = self._zipf(NUM_HASHES, ev_len.sum(), 1.1)
        ev_groups = rng.integers(0, 2, 14 * n)
        evictions = list(map(BlockEvicted, np.repeat(steps, 14).tolist(), ev_groups.tolist(),
                             rng.choice(_EVICT_REASONS, 14 * n).tolist(), _split(ev_blocks.tolist(), ev_len),
                             _split(_hash_values(ev_hash_ids), ev_len), _split(ints(1, 5000, ev_len.sum()), ev_len),
                             _split(ints(0, 2000, ev_len.sum()), ev_len), rid(14 * n, 2 * n)))

        pub_len = rng.integers(1, 5, 18 * n)
        reuse = rng.random(pub_len.sum()) < 0.7  # most published blocks take ids just evicted
        pub_blocks = np.where(reuse, ev_blocks[rng.integers(0, len(ev_blocks), pub_len.sum())],
                              rng.integers(0, NUM_BLOCKS, pub_len.sum()))
        publishes = list(map(BlockPublished, np.repeat(steps, 18).tolist(), rid(18 * n, 2 * n),
                             ints(0, 2, 18 * n), rng.choice(_PUBLISH_KINDS, 18 * n).tolist(),
                             _split(pub_blocks.tolist(), pub_len),
                             _split(_hash_values(self._zipf(NUM_HASHES, pub_len.sum(), 1.1)), pub_len),
                             ints(16, 32768, 18 * n)))

        n_lk = 2 * n
        lk_ids = _names("req-", np.arange(self.next_request, self.next_request + n_lk))
        self.next_request += n_lk
        q = rng.integers(64, 16384, n_lk)
        h = (q * rng.uniform(0, 1, n_lk)).astype(np.int64) // 16 * 16
        x = np.where(rng.random(n_lk) < 0.1, (q - h) // 4, 0)
        pool = np.concatenate([self.recent_evicted, ev_hash_ids[ev_groups.repeat(ev_len) == 0]])
        miss = np.where(rng.random(n_lk) < 0.6, pool[rng.integers(0, len(pool), n_lk)],
                        rng.integers(0, NUM_HASHES, n_lk))
        self.recent_evicted = pool[-50_000:]
        has_miss = (h < q).tolist()
        per_group = np.stack([h, np.minimum(h, (h * rng.uniform(0.5, 1, n_lk)).astype(np.int64))], axis=1)
        lookups = list(map(PrefixLookup, np.repeat(steps, 2).tolist(), lk_ids, q.tolist(), h.tolist(),
                           list(map(tuple, per_group.tolist())), ints(0, 4096, n_lk), x.tolist(),
                           _hash_values(NUM_HASHES + self._zipf(NUM_PREFIXES, n_lk)),
                           [m if hm else None for m, hm in zip(_hash_values(miss), has_miss)],
                           [i if hm else -1 for i, hm in zip((h // 16).tolist(), has_miss)]))

        pick_lk = lambda size: [lk_ids[i] for i in rng.integers(0, n_lk, size).tolist()]
        copies = list(map(BlockCopied, np.repeat(steps, 2).tolist(), pick_lk(2 * n), ints(0, 2, 2 * n),
                          ints(0, NUM_BLOCKS, 2 * n), ints(0, NUM_BLOCKS, 2 * n),
                          rng.choice(_COPY_REASONS, 2 * n).tolist()))
        fr_len = rng.integers(1, 9, 8 * n)
        frees = list(map(BlocksFreed, np.repeat(steps, 8).tolist(), pick_lk(8 * n), ints(0, 2, 8 * n),
                         _split(ints(0, NUM_BLOCKS, fr_len.sum()), fr_len)))

        rare = rng.random(n) < 0.05
        r_steps = steps[rare].tolist()
        k = len(r_steps)
        r_ids = _names("req-", rng.integers(0, max(1, self.next_request), k))
        r_hash, r_blocks, r_tokens = _hash_values(rng.integers(0, NUM_HASHES, k)), ints(0, NUM_BLOCKS, k), \
            ints(16, 8192, k)
        stale_left = list(map(StaleHashLeft, r_steps, r_ids, [1] * k, r_blocks, r_hash, r_tokens))
        r_times = [s * STEP_NS + STEP_NS // 2 for s in r_steps]
        stale = list(map(StaleHashFound, r_steps, r_times, [1] * k, r_blocks, r_hash, r_tokens,
                         ints(0, 2**62, k), ints(0, 2**62, k), r_ids))
        divergent = list(map(DivergentOutput, r_steps, r_times, r_ids, ints(0, 100, k), ints(0, 150000, k),
                             ints(0, 150000, k)))

        requests = self._finished(steps)
        usage = rng.uniform(0.3, 1.0, (n, 2)).tolist()
        step_stats = [rng.integers(0, hi, n).tolist() for hi in (8192, 256, 256, 64, 4, 2)]
        out = []
        rare_at = {s: i for i, s in enumerate(r_steps)}
        for i, s in enumerate(steps.tolist()):
            cache = [*lookups[2 * i:2 * i + 2], *evictions[14 * i:14 * i + 14], *publishes[18 * i:18 * i + 18],
                     *copies[2 * i:2 * i + 2], *frees[8 * i:8 * i + 8]]
            engine = list(requests[2 * i:2 * i + 2])
            j = rare_at.get(s)
            if j is not None:
                cache.append(stale_left[j])
                engine += [stale[j], divergent[j]]
            stats = [col[i] for col in step_stats]
            out.append(StepBatch(StepExecuted(s, s * STEP_NS, (s + 1) * STEP_NS, *stats, tuple(usage[i])),
                                 cache, engine))
        return out

    def _finished(self, steps: np.ndarray) -> list[RequestFinished]:
        """Two requests finishing at each step (the ones looked up lately)."""
        rng = self.rng
        rq_steps = np.repeat(steps, 2)
        n_rq = len(rq_steps)
        out_len = rng.integers(8, 121, n_rq)
        gaps = rng.gamma(4.0, STEP_NS / 4, out_len.sum()).astype(np.int64) + 1
        offs = np.concatenate([[0], np.cumsum(out_len)])
        finish = rq_steps.astype(np.int64) * STEP_NS + STEP_NS
        first_tok = finish - np.add.reduceat(gaps, offs[:-1])
        ttft = rng.gamma(2.0, 5 * STEP_NS, n_rq).astype(np.int64) + STEP_NS
        arrival = first_tok - ttft
        sched = arrival + (ttft * rng.uniform(0, 0.5, n_rq)).astype(np.int64)
        mid = (sched + first_tok) // 2
        prompt = rng.integers(64, 16384, n_rq)
        hit = (prompt * rng.uniform(0, 1, n_rq)).astype(np.int64)
        half = ((prompt - hit) // 2).tolist()
        ids = _names("req-", np.maximum(0, self.next_request - 256 + rng.integers(0, 256, n_rq)))
        zeros = [0] * n_rq
        chunks = [((a, m, c), (m, b, c)) for a, m, b, c in zip(sched.tolist(), mid.tolist(), first_tok.tolist(), half)]
        return list(map(RequestFinished, ids, [None] * n_rq, arrival.tolist(), sched.tolist(), first_tok.tolist(),
                        finish.tolist(), prompt.tolist(), (out_len + 1).tolist(), hit.tolist(), zeros,
                        (prompt - hit).tolist(), zeros, zeros, _split(gaps.tolist(), out_len), chunks))


def heavy_steps(num_spans: int, seed: int = 0, steps_per_chunk: int = 4000) -> Iterator[StepBatch]:
    """Steps of the heavy mix, made ``steps_per_chunk`` at a time, until they hold about
    ``num_spans`` spans (whole steps: a few more)."""
    mix, made, step = HeavyMix(seed), 0, 0
    while made < num_spans:
        n = max(1, min(steps_per_chunk, (num_spans - made) // SPANS_PER_STEP))
        for batch in mix.steps(step, n):
            made += 1 + len(batch.cache_events) + len(batch.engine_events)
            yield batch
        step += n


def fill_store(store, run_id: str, num_spans: int, seed: int = 0, steps_per_chunk: int = 4000) -> int:
    """Append about ``num_spans`` spans of the heavy mix to ``run_id`` through the DuckDB
    exporter; returns the count appended."""
    exporter = DuckDBSpanExporter(store, run_id)
    for batch in span_batches(heavy_steps(num_spans, seed, steps_per_chunk), seed,
                              flush_spans=steps_per_chunk * SPANS_PER_STEP):
        exporter.export_batch(batch)
    store.flush()
    return exporter.spans_written
