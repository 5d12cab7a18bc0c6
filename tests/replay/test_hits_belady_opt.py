"""Cache-only numbers on traces small enough to search: Belady against every eviction
choice, and each curve point against a replay of its own at that capacity."""

from __future__ import annotations

import functools
import itertools
import random

import pytest

from kvtrace.replay.belady import chain_keys
from kvtrace.replay.cache_only import replay_cache_only
from kvtrace.replay.curve import capacity_curve
from kvtrace.workload import TraceRequest


def small_trace(rng: random.Random, block_size: int) -> list[TraceRequest]:
    """2-8 requests walking a random prefix tree (ids shared 70% of the time), each with
    a partial last block, so hits nest, overlap and differ in tokens."""
    children: dict[int | None, list[int]] = {}
    next_id = 0
    out = []
    for i in range(rng.randint(2, 8)):
        path: list[int] = []
        parent = None
        for _ in range(rng.randint(1, 4)):
            siblings = children.setdefault(parent, [])
            if siblings and rng.random() < 0.7:
                node = rng.choice(siblings)
            else:
                node, next_id = next_id, next_id + 1
                siblings.append(node)
            path.append(node)
            parent = node
        tokens = (len(path) - 1) * block_size + rng.randint(1, block_size)
        out.append(TraceRequest(f"r{i}", i, tokens, 1, hash_ids=tuple(path), hash_block_size=block_size))
    return out


def best_hit_blocks(keys: list[list[int]], capacity: int) -> int:
    """The most leading-block hits any eviction policy gets: every choice of victims tried
    (a request's blocks must all be resident; a larger one is served uncached)."""
    requests = [tuple(k) for k in keys]

    @functools.cache
    def best(i: int, cached: frozenset) -> int:
        if i == len(requests):
            return 0
        ks = requests[i]
        hit = next((d for d, k in enumerate(ks) if k not in cached), len(ks))
        if len(ks) > capacity:
            return hit + best(i + 1, cached)
        resident = cached | set(ks)
        over = len(resident) - capacity
        if over <= 0:
            return hit + best(i + 1, resident)
        victims = sorted(cached - set(ks))
        return hit + max(best(i + 1, resident - set(v)) for v in itertools.combinations(victims, over))

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(4))
def test_belady_is_the_best_any_policy_gets_and_each_curve_point_is_its_replay(seed):
    rng = random.Random(seed)
    checked = 0
    while checked < 25:
        block_size = rng.choice([2, 4, 16])
        reqs = small_trace(rng, block_size)
        keys = chain_keys(reqs)[0]
        distinct = len({k for ks in keys for k in ks})
        if distinct > 11:  # (the search is exponential in the cached blocks)
            continue
        capacities = sorted({rng.randint(1, distinct + 1) for _ in range(3)})
        points = {(p.capacity_blocks, p.policy): p
                  for p in capacity_curve(reqs, [*capacities, None], block_size=block_size)}
        for c in capacities:
            lru = replay_cache_only(reqs, capacity_blocks=c, block_size=block_size)
            opt = replay_cache_only(reqs, capacity_blocks=c, block_size=block_size, policy="belady")
            assert opt.hit_blocks == best_hit_blocks(keys, c), (c, [r.hash_ids for r in reqs])
            assert opt.hit_tokens >= lru.hit_tokens and opt.hit_blocks >= lru.hit_blocks
            for policy, run in (("lru", lru), ("belady", opt)):
                point = points[c, policy]
                assert (point.hit_tokens, point.hit_blocks, point.prompt_tokens, point.total_blocks) == (
                    run.hit_tokens, run.hit_blocks, run.prompt_tokens, run.total_blocks), (policy, c)
            checked += 1
        unbounded = replay_cache_only(reqs, block_size=block_size)
        assert points[None, "lru"].hit_tokens == unbounded.hit_tokens and unbounded.evictions == 0


def test_belady_evicts_the_child_of_two_blocks_next_used_together():
    # capacity 2: c=[3] must evict 1 or 2, which d=[1,2] uses next, both at once: taking the
    # child 2 leaves d the hit [1]; taking the parent 1 left 2 cached behind a miss (no hit)
    reqs = [TraceRequest(rid, i, 8, 1, hash_ids=ids, hash_block_size=4)
            for i, (rid, ids) in enumerate((("a", (1, 2)), ("c", (3,)), ("d", (1, 2))))]
    run = replay_cache_only(reqs, capacity_blocks=2, block_size=4, policy="belady")
    assert run.per_request_hit_blocks == [0, 0, 1]
    assert best_hit_blocks(chain_keys(reqs)[0], 2) == 1
