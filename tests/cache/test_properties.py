"""Property tests over random request streams (hypothesis).

A tiny reference worker in this file executes the manager's plans (copies, state
writes, attention writes through the Core's tables) on a symbolic content model, so
that "no cached key is stale" can be checked against what each key's prefix defines.

Chunks of Mamba models are cut as the scheduler cuts them (vLLM's block-aligned
split, kvtrace's port): like vLLM's, the manager keys a Mamba slot at its block end
trusting the split to have ended a chunk there. One case breaks that trust, in vLLM 0.33
as here: a final chunk that starts mid-block after a hit and exports an internal
checkpoint may run past that block's end, which then keys the hit's copied state
(``is_mid_block_hit_state``; tests/replay/test_vllm_backend.py shows both managers do
it, and the engine's audit and content checks catching it). Every other stale key fails.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvtrace.cache import (
    CacheConfig,
    ExternalTierConfig,
    FullAttentionSpec,
    KVCacheManager,
    MambaSpec,
    Request,
    SlidingWindowSpec,
)
from kvtrace.cache.block_pool import BlockPool
from kvtrace.cache.sink import EventSink
from kvtrace.engine.config import SchedulerConfig
from kvtrace.engine.scheduler import Scheduler

PREFIXES = [tuple(range(100, 124)), tuple(range(200, 220)), tuple(range(100, 112)) + tuple(range(300, 310))]

CONFIGS = {
    "full": dict(groups=(FullAttentionSpec(4),), num_gpu_blocks=24, hash_block_size=4),
    "full-partial": dict(groups=(FullAttentionSpec(8),), num_gpu_blocks=16, hash_block_size=4,
                         enable_partial_hits=True),
    "hybrid-dense": dict(groups=(FullAttentionSpec(4), MambaSpec(8)), num_gpu_blocks=54, hash_block_size=4,
                         enable_partial_hits=True, num_prefill_checkpoint_blocks=1),
    "hybrid-zero": dict(groups=(FullAttentionSpec(4), MambaSpec(8)), num_gpu_blocks=54, hash_block_size=4,
                        enable_partial_hits=True, num_prefill_checkpoint_blocks=1, retention_interval=0),
    "hybrid-k": dict(groups=(FullAttentionSpec(8), MambaSpec(8)), num_gpu_blocks=44, hash_block_size=4,
                     retention_interval=16, num_prefill_checkpoint_blocks=1),
    "hybrid-separate-pools": dict(groups=(FullAttentionSpec(4), MambaSpec(8)), num_gpu_blocks=(40, 14),
                                  hash_block_size=4, enable_partial_hits=True, num_prefill_checkpoint_blocks=1,
                                  prefill_checkpoint_alignment=4, retention_interval=0),
    "swa": dict(groups=(FullAttentionSpec(4), SlidingWindowSpec(4, sliding_window=7)), num_gpu_blocks=70,
                hash_block_size=4, retention_interval=0),
    "external": dict(groups=(FullAttentionSpec(4), MambaSpec(8)), num_gpu_blocks=40, hash_block_size=4,
                     enable_partial_hits=True, external=ExternalTierConfig(64)),
}


class ReferenceWorker:
    """Executes plans against a symbolic content model using the Core's tables."""

    def __init__(self, m: KVCacheManager):
        self.m = m
        self.content = [dict() for _ in m.pools]  # group -> block id -> content
        self.prefix_of: dict[bytes, tuple[int, ...]] = {}

    def note_hashes(self, req: Request) -> None:
        hbs = self.m.hash_block_size
        toks = tuple(req.all_token_ids.tolist())
        for i, h in enumerate(req.block_hashes):
            self.prefix_of[h] = toks[: (i + 1) * hbs]

    def execute(self, req: Request, start: int, end: int) -> None:
        m = self.m
        for c in m.take_block_copies():
            src = self.content[c.group_id].get(c.src)
            self.content[c.group_id][c.dst] = dict(src) if isinstance(src, dict) else src
        toks = req.all_token_ids.tolist()
        for w in m.take_state_writes():
            if isinstance(m.config.groups[w.group_id], MambaSpec):
                self.content[w.group_id][w.block_id] = tuple(toks[: w.num_tokens])
            else:  # external load of an attention block
                table = m.get_block_ids(req.request_id)[w.group_id]
                idx = table.index(w.block_id)
                bs = m.managers[w.group_id].block_size
                slots = self.content[w.group_id].setdefault(w.block_id, {})
                for pos in range(idx * bs, w.num_tokens):
                    slots[pos % bs] = toks[pos]
        for g, spec in enumerate(m.config.groups):
            if isinstance(spec, MambaSpec):
                continue
            table = m.get_block_ids(req.request_id)[g]
            bs = spec.block_size
            for pos in range(start, end):
                bid = table[pos // bs]
                if bid:
                    self.content[g].setdefault(bid, {})[pos % bs] = toks[pos]

    def stale_keys(self) -> list:
        out = []
        m = self.m
        for g, h, bid, n in m.cached_entries():
            prefix = self.prefix_of[h]
            assert len(prefix) == n
            content = self.content[g].get(bid)
            if isinstance(m.config.groups[g], MambaSpec):
                ok = content == prefix
            else:
                bs = m.managers[g].block_size
                first = (n - 1) // bs * bs
                ok = content is not None and all(content.get(p % bs) == prefix[p] for p in range(first, n))
            if not ok:
                out.append((g, bid, n))
        return out

    def is_mid_block_hit_state(self, key: tuple[int, int, int]) -> bool:
        """A Mamba block keyed at its block end (n) that holds the true state of a shorter
        prefix inside that same block: a mid-block hit's copy the chunk ran past."""
        g, bid, n = key
        spec = self.m.config.groups[g]
        content = self.content[g].get(bid)
        if not isinstance(spec, MambaSpec) or not isinstance(content, tuple) or n % spec.block_size:
            return False
        held = len(content)
        return n - spec.block_size < held < n and content == self.prefix_of_key(g, bid)[:held]

    def prefix_of_key(self, g: int, bid: int) -> tuple[int, ...]:
        for group, h, block, _n in self.m.cached_entries():
            if group == g and block == bid:
                return self.prefix_of[h]
        raise KeyError((g, bid))


def chunk_end(m: KVCacheManager, req: Request, start: int, chunk: int, local: int = 0, ext: int = 0) -> int:
    """The end of the next chunk of at most ``chunk`` tokens, as the scheduler splits it."""
    end = min(req.num_tokens, start + chunk)
    if not any(isinstance(s, MambaSpec) for s in m.config.groups):
        return end
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=max(chunk, 1)), m.config, m)
    return start + sched._mamba_block_aligned_split(req, end - start, local, ext)


def check_pool_invariants(m: KVCacheManager) -> None:
    for pool in dict.fromkeys(m.pools):
        q = pool.free_block_queue
        seen = []
        prev = q.head
        b = q.head.next_free
        while b is not q.tail:
            assert b.prev_free is prev, "free queue back link"
            seen.append(b.block_id)
            prev, b = b, b.next_free
        assert q.tail.prev_free is prev
        assert len(seen) == q.num_free_blocks == len(set(seen))
        in_queue = set(seen)
        assert 0 not in in_queue
        for blk in pool.blocks[1:]:
            assert (blk.block_id in in_queue) != (blk.ref_cnt > 0), f"block {blk.block_id} ref {blk.ref_cnt}"
            for h, _n in blk.keys():
                holders = pool.get_cached_blocks(h, blk.group_id)
                assert blk in holders, "a block records a key the map lacks"
        for g, cached in enumerate(pool.cached):
            for h, v in cached.items():
                for blk in ([v] if not isinstance(v, dict) else v.values()):
                    assert blk.group_id == g, "a key of one group on another group's block"
                    assert h in [k for k, _ in blk.keys()], "a cached key maps to a block that does not record it"
        held = [sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0 and b.group_id == g) for g in range(len(pool.cached))]
        assert held == pool.num_used, "usage per group"


action = st.tuples(st.sampled_from(["new", "new", "run", "run", "decode", "free", "step"]),
                   st.integers(0, 2), st.integers(1, 30), st.integers(1, 24))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=st.sampled_from(sorted(CONFIGS)), actions=st.lists(action, min_size=5, max_size=60))
@example(config="hybrid-dense",  # (hypothesis found it: the mid-block hit state keyed at 24)
         actions=[("new", 1, 1, 21), ("step", 0, 1, 1), ("new", 1, 13, 13), ("step", 0, 1, 1), ("step", 0, 1, 1)])
def test_random_streams_keep_the_pool_consistent_and_no_other_key_stale(config, actions):
    m = KVCacheManager(CacheConfig(**CONFIGS[config]))
    worker = ReferenceWorker(m)
    live: dict[str, Request] = {}
    counter = 0
    hbs = m.hash_block_size
    for kind, pick, size, chunk in actions:
        if kind == "new":
            counter += 1
            toks = PREFIXES[pick] + tuple(range(1000 * counter, 1000 * counter + size))
            req = Request(f"r{counter}", np.asarray(toks, dtype=np.int64))
            blocks, hit, boundary = m.get_computed_blocks(req)
            req.shared_prefix_boundary = boundary
            ext = m.get_num_external_hit_tokens(req, hit)
            start = hit + ext
            end = chunk_end(m, req, start, chunk, hit, ext) if start < req.num_tokens else req.num_tokens
            if end <= start:
                continue
            out = m.allocate_slots(req, end - start, hit, blocks, num_external_computed_tokens=ext)
            if out is None:
                m.take_block_copies()
                continue
            worker.note_hashes(req)
            worker.execute(req, start, end)
            req.num_computed_tokens = end
            live[req.request_id] = req
        elif kind in ("run", "decode") and live:
            req = live[sorted(live)[pick % len(live)]]
            if req.num_computed_tokens >= req.num_tokens:
                if kind != "decode" or req.num_tokens > 90:
                    continue
                req.append_output_token_ids([(req.num_tokens * 7) % 11])
            start = req.num_computed_tokens
            end = chunk_end(m, req, start, chunk)
            if end <= start:
                continue
            if m.allocate_slots(req, end - start) is None:
                m.take_block_copies()
                continue
            worker.note_hashes(req)
            worker.execute(req, start, end)
            req.num_computed_tokens = end
        elif kind == "free" and live:
            m.free(live.pop(sorted(live)[pick % len(live)]))
        else:
            m.new_step_starts()
        check_pool_invariants(m)
        stale = worker.stale_keys()
        assert all(worker.is_mid_block_hit_state(k) for k in stale), stale  # (vLLM's, see the docstring)
    for rid in sorted(live):
        m.free(live[rid])
    m.take_block_copies()
    check_pool_invariants(m)
    for pool in dict.fromkeys(m.pools):
        assert pool.num_free_blocks == pool.num_blocks - 1
    assert hbs


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "touch", "key"]), st.integers(0, 9)), max_size=80))
def test_eviction_order_is_lru_as_defined(ops):
    """The pool's queue against a plain list model: pop head; free unhashed->head, hashed->tail."""
    pool = BlockPool(8, EventSink())
    model = list(range(1, 8))
    held: list = []
    for op, x in ops:
        if op == "alloc" and model:
            n = 1 + x % min(3, len(model))
            got = pool.get_new_blocks(n, 0)
            assert [b.block_id for b in got] == model[:n]
            for b in got:
                assert b.block_hash is None  # popped keys were evicted
            del model[:n]
            held.extend(got)
        elif op == "key" and held:
            b = held[x % len(held)]
            if b.block_hash is None:
                pool.cache_full_blocks(0, "r", [b], [bytes([b.block_id, x])], 0, 1, 4, None, "full")
        elif op == "free" and held:
            b = held.pop(x % len(held))
            pool.free_blocks([b], 0)
            if b.block_hash is None:
                model.insert(0, b.block_id)
            else:
                model.append(b.block_id)
        elif op == "touch" and model:
            bid = model[x % len(model)]
            blk = pool.blocks[bid]
            if blk.block_hash is not None:
                pool.touch([blk], 0)
                model.remove(bid)
                held.append(blk)
        assert pool.free_block_queue.block_ids() == model
