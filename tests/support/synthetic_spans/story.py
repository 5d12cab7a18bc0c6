"""The hybrid-cache story: two runs of one trace, a behaviour on and off (dashboard tests)."""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from kvtrace import metrics
from kvtrace.cache.events import (
    COPY_EXTERNAL,
    EVICT_LRU,
    EVICT_STALE_HASH,
    PUBLISH_CHECKPOINT,
    PUBLISH_FULL,
    PUBLISH_PARTIAL_TAIL,
    BlockCopied,
    BlockEvicted,
    BlockPublished,
    PrefixLookup,
    StaleHashLeft,
)
from kvtrace.engine.events import DivergentOutput, RequestFinished, StaleHashFound, StepBatch, StepExecuted
from tests.support.synthetic_spans.span_path import write_steps

BLOCK = 64  # tokens per block (both groups)
ALIGN = 4  # Mamba state kept every ALIGN blocks
STORY_STEP_NS = 25_000_000  # one scheduler step of virtual time
BEHAVIOUR = "transient-checkpoint-retention"
ALL_BEHAVIOURS = ["transient-checkpoint-retention", "shared-prefix-pinning", "external-hit-running-cow"]


def _key(*parts: object) -> bytes:
    return hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()


class _Group:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.cache: OrderedDict = OrderedDict()  # hash -> (block_id, published_step, last_used_step)
        self.free = list(range(capacity, 0, -1))


def _story_trace(n_requests: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    families = rng.choice(6, size=n_requests, p=[0.35, 0.25, 0.15, 0.1, 0.1, 0.05])
    prefix_blocks = np.array([24, 16, 12, 20, 8, 30])
    suffix = rng.integers(2, 14, size=n_requests)
    outputs = rng.integers(8, 40, size=n_requests)
    arrivals = np.sort(rng.integers(0, n_requests * 2, size=n_requests))  # in steps
    external = rng.random(n_requests) < 0.1
    return [
        dict(i=i, fam=int(families[i]), nprefix=int(prefix_blocks[families[i]]), nsuffix=int(suffix[i]),
             out=int(outputs[i]), arrival=int(arrivals[i]), external=bool(external[i]))
        for i in range(n_requests)
    ]


class _Story:
    """The cache and its events; ``emit`` files each event under its step."""

    def __init__(self, behaviour_on: bool, capacity: int, seed: int):
        self.on = behaviour_on
        self.rng = np.random.default_rng(seed + 1)
        self.groups = [_Group(capacity), _Group(capacity)]
        self.cache_events: dict[int, list] = {}
        self.engine_events: dict[int, list] = {}
        self.usage: dict[int, tuple[float, ...]] = {}
        self.n = dict(publishes=0, evictions=0, cow_copies=0, stale_hashes=0, divergent_outputs=0,
                      lookup_blocks=0, hit_blocks=0)
        self.finished: list[RequestFinished] = []
        self.stale_pending = False

    def emit(self, step: int, event, engine: bool = False) -> None:
        (self.engine_events if engine else self.cache_events).setdefault(step, []).append(event)

    def allocate(self, g: int, step: int, rid: str) -> int:
        grp = self.groups[g]
        if grp.free:
            return grp.free.pop()
        h, (bid, pub, used) = grp.cache.popitem(last=False)
        self.n["evictions"] += 1
        self.emit(step, BlockEvicted(step, g, EVICT_LRU, (bid,), (h,), (step - pub,), (step - used,), rid))
        return bid

    def run_request(self, req: dict, step: int) -> int:
        rid = f"req-{req['i']:04d}"
        hashes = [_key("sys", req["fam"], b) for b in range(req["nprefix"])]
        hashes += [_key("user", req["i"], b) for b in range(req["nsuffix"])]
        nblocks = len(hashes)
        # Lookup: attention scans left to right; the Mamba state needs an aligned stored state.
        g0, g1 = self.groups
        hit = 0
        while hit < nblocks - 1 and hashes[hit] in g0.cache:
            hit += 1
        hit1 = hit - hit % ALIGN
        while hit1 > 0 and hashes[hit1 - 1] not in g1.cache:
            hit1 -= ALIGN
        hit_blocks = max(hit1, 0)
        first_miss = hit if hit < nblocks else -1
        ext = ALIGN if (req["external"] and hit_blocks + ALIGN < nblocks) else 0
        for grp in self.groups:
            for h in hashes[:hit_blocks]:
                if h in grp.cache:
                    bid, pub, _ = grp.cache[h]
                    grp.cache[h] = (bid, pub, step)
                    grp.cache.move_to_end(h)
        self.n["lookup_blocks"] += nblocks
        self.n["hit_blocks"] += hit_blocks + ext
        prompt = nblocks * BLOCK - (req["i"] * 7) % (BLOCK // 2)  # same trace in both runs
        local_hit, ext_hit = hit_blocks * BLOCK, ext * BLOCK
        self.emit(step, PrefixLookup(step, rid, prompt, local_hit, (hit * BLOCK, hit_blocks * BLOCK),
                                     req["nprefix"] * BLOCK, ext_hit, hashes[0],
                                     hashes[first_miss] if first_miss >= 0 else None, first_miss))
        if req["external"] and ext:
            self.n["cow_copies"] += 1
            self.emit(step, BlockCopied(step, rid, 1, 0, int(self.rng.integers(1, 50)), COPY_EXTERNAL))
        # Prefill in chunks of 8 blocks; one step per chunk.
        todo = list(range(hit_blocks + ext, nblocks))
        chunks = []
        s = step
        while todo:
            chunk, todo = todo[:8], todo[8:]
            for g in (0, 1):
                ids, hs = [], []
                for b in chunk:
                    if g == 1 and (b + 1) % ALIGN and b != nblocks - 1:
                        continue  # state kept only at aligned blocks and the prompt tail
                    bid = self.allocate(g, s, rid)
                    self.groups[g].cache[hashes[b]] = (bid, s, s)
                    ids.append(bid)
                    hs.append(hashes[b])
                if ids:
                    kind = PUBLISH_PARTIAL_TAIL if chunk[-1] == nblocks - 1 else PUBLISH_FULL
                    self.n["publishes"] += 1
                    self.emit(s, BlockPublished(s, rid, g, kind, tuple(ids), tuple(hs), (chunk[-1] + 1) * BLOCK))
            if todo and req["nprefix"] + req["nsuffix"] > 16:
                self.checkpoint(s, rid)
            chunks.append((s * STORY_STEP_NS, (s + 1) * STORY_STEP_NS, len(chunk) * BLOCK))
            s += 1
        if not chunks:
            chunks.append((s * STORY_STEP_NS, (s + 1) * STORY_STEP_NS, BLOCK))
            s += 1
        first_token = s * STORY_STEP_NS
        itl = (STORY_STEP_NS + self.rng.integers(0, STORY_STEP_NS // 2, size=req["out"] - 1)).astype(np.int64)
        finish = first_token + int(itl.sum())
        divergent = 0
        if not self.on and self.stale_pending:
            divergent = 1
            self.stale_pending = False
            self.n["divergent_outputs"] += 1
            self.emit(s + 2, DivergentOutput(s + 2, first_token + int(itl[:2].sum()), rid, 2,
                                             int(self.rng.integers(0, 32000)), int(self.rng.integers(0, 32000))),
                      engine=True)
        arrival = req["arrival"] * STORY_STEP_NS
        done = RequestFinished(rid, f"fam-{req['fam']}", arrival, step * STORY_STEP_NS, first_token, finish,
                               prompt, req["out"], local_hit, ext_hit, prompt - local_hit - ext_hit, 0, divergent,
                               tuple(itl.tolist()), tuple(chunks), num_external_query_tokens=prompt - local_hit)
        self.finished.append(done)
        self.emit(s, done, engine=True)
        return s

    def checkpoint(self, s: int, rid: str) -> None:
        """A prefill checkpoint state written into a slot that still carries a hash."""
        g1 = self.groups[1]
        if not g1.cache:
            return
        victim = next(reversed(g1.cache))  # the slot reused for the checkpoint
        bid, pub, used = g1.cache[victim]
        if self.on:  # behaviour on: the old key is evicted as stale, the checkpoint stays local
            del g1.cache[victim]
            g1.free.append(bid)
            self.n["evictions"] += 1
            self.emit(s, BlockEvicted(s, 1, EVICT_STALE_HASH, (bid,), (victim,), (s - pub,), (s - used,), rid))
        else:  # behaviour off: the key stays (stale) and the checkpoint is published too
            self.emit(s, StaleHashLeft(s, rid, 1, bid, victim, BLOCK * 4))
            self.n["stale_hashes"] += 1
            self.stale_pending = True
            self.emit(s, StaleHashFound(s, s * STORY_STEP_NS + 1, 1, bid, victim, BLOCK * 4,
                                        int.from_bytes(victim[:4], "big"), int.from_bytes(_key(rid, s)[:4], "big"),
                                        rid), engine=True)
            ck = _key("ckpt", rid, s)
            nb = self.allocate(1, s, rid)
            g1.cache[ck] = (nb, s, s)
            self.n["publishes"] += 1
            self.emit(s, BlockPublished(s, rid, 1, PUBLISH_CHECKPOINT, (nb,), (ck,), BLOCK * 8))

    def step_batches(self) -> list[StepBatch]:
        """Every step that ran or holds an event, in order, each with its StepExecuted."""
        steps = sorted(set(self.usage) | set(self.cache_events) | set(self.engine_events))
        last: tuple[float, ...] = (0.0, 0.0)
        out = []
        for st in steps:
            last = self.usage.get(st, last)
            out.append(StepBatch(StepExecuted(st, st * STORY_STEP_NS, (st + 1) * STORY_STEP_NS, 8 * BLOCK, 4, 5, 1,
                                              0, 0, last),
                                 self.cache_events.get(st, []), self.engine_events.get(st, [])))
        return out


def simulate(behaviour_on: bool, n_requests: int = 80, capacity: int = 160,
             seed: int = 7) -> tuple[list[StepBatch], dict]:
    """The story's steps (events) and the run summary of one run of its trace."""
    story = _Story(behaviour_on, capacity, seed)
    step = 0
    for req in _story_trace(n_requests, seed):
        step = max(step, req["arrival"])
        start = step
        step = story.run_request(req, step)
        usage = tuple(len(g.cache) / g.capacity for g in story.groups)
        for st in range(start, step):
            story.usage[st] = usage
    reqs = story.finished
    n = story.n
    # every metric from its one definition, as the engine's summary computes it
    summary = dict(
        requests=len(reqs), prompt_tokens=sum(r.num_prompt_tokens for r in reqs), **metrics.hit_summary(reqs),
        block_hit_rate=n["hit_blocks"] / n["lookup_blocks"],
        **metrics.latency_summary(metrics.request_latency_samples(reqs)),
        publishes=n["publishes"], evictions=n["evictions"], cow_copies=n["cow_copies"],
        stale_hashes=n["stale_hashes"], divergent_outputs=n["divergent_outputs"], preemptions=0,
        digest=hashlib.blake2b(repr((behaviour_on, n_requests, seed)).encode(), digest_size=8).hexdigest(),
    )
    return story.step_batches(), summary


def write_runs(db: str, n_requests: int = 80, capacity: int = 160, seed: int = 7) -> dict[str, dict]:
    """Write the story twice into ``db`` (behaviour on, off); return {run_id: summary}."""
    from kvtrace.store.writer import Store

    out = {}
    with Store.open(db) as store:
        for on in (True, False):
            behaviours = ALL_BEHAVIOURS if on else [b for b in ALL_BEHAVIOURS if b != BEHAVIOUR]
            name = "synthetic-on" if on else f"synthetic-without-{BEHAVIOUR}"
            groups = [{"kind": "full_attention", "block_size": BLOCK}, {"kind": "mamba", "block_size": BLOCK}]
            config = {"capacity_blocks": capacity, "block_size": BLOCK, "groups": groups}
            run_id = store.create_run(name, created="2026-11-29T00:00:00+00:00",
                                      trace_source="gen:synthetic-shared-prompts", trace_digest="synthetic-7",
                                      config=config, behaviours=behaviours, mode="engine")
            steps, summary = simulate(on, n_requests, capacity, seed)
            write_steps(store, run_id, steps, seed)
            store.finish_run(run_id, status="complete", digest=summary["digest"], summary=summary)
            out[run_id] = summary
    return out
