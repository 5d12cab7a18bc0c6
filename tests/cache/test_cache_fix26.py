"""A lookup's per-group hits and first miss, as README and metrics.py define them, on both
backends (the twenty-sixth session's re-probe of e03aa19 and 7b044f9)."""

from __future__ import annotations

import pytest

from kvtrace.cache import CacheConfig, FullAttentionSpec, KVCacheManager, MambaSpec, SlidingWindowSpec
from kvtrace.cache.events import PrefixLookup

from .helpers import cache_and_free, cached_block, drop_keys, make_request


def _lookup(events: list, request_id: str) -> PrefixLookup:
    (lookup,) = [e for e in events if isinstance(e, PrefixLookup) and e.request_id == request_id]
    return lookup


@pytest.mark.parametrize("other", [MambaSpec(16), SlidingWindowSpec(16, sliding_window=16)])
def test_the_first_miss_is_past_group_0s_hit_before_the_alignment_cut(other):
    """Groups of 8- and 16-token blocks, no partial hits: hits are cut to 16 tokens. Group 0
    holds [0, 24) of b, the hit is cut to 16, and the first miss was read past the cut hit:
    block 2, which group 0 holds (the miss attribution blamed an old eviction of it: 86 of
    1,063 attributions of gen:agent on FA(16)+SW(32))."""
    m = KVCacheManager(CacheConfig(groups=(FullAttentionSpec(8), other), num_gpu_blocks=60, hash_block_size=8))
    events: list = []
    m.subscribe(events.extend)
    cache_and_free(m, "a", range(33), (8, 8, 8, 8, 1))
    assert m.coordinator.hit_alignment == 16
    b = make_request("b", [*range(24), *[99] * 16])
    _blocks, hit, _ = m.get_computed_blocks(b)
    m.new_step_starts()
    lookup = _lookup(events, "b")
    assert hit == 16 and lookup.hit_tokens_per_group == (16, 16)  # the groups' aligned hits, as before
    i = lookup.first_miss_index
    assert (i, lookup.first_miss_hash) == (3, b.block_hashes[3])  # [24, 32): b's own tokens
    assert all(cached_block(m, 0, h) is not None for h in b.block_hashes[:i])
    assert cached_block(m, 0, b.block_hashes[i]) is None


def test_a_second_full_attention_groups_hit_with_partial_hits_is_its_own():
    """FA(16) + FA(32), partial hits on. Group 0's key after 64 tokens gone: it alone hits 48.
    Group 1, capped at 48, found its block 0 and no key inside block 1 before the cap (32 < 48),
    which was taken for its hit alone, yet it holds [0, 96): the full block 1 lies past the cap.
    hit_tokens_per_group is each group's hit alone (metrics.GROUP_HIT_RATE_DOC)."""
    m = KVCacheManager(CacheConfig(groups=(FullAttentionSpec(16), FullAttentionSpec(32)), num_gpu_blocks=60,
                                   hash_block_size=16, enable_partial_hits=True))
    events: list = []
    m.subscribe(events.extend)
    cache_and_free(m, "a", range(97), (32, 32, 32, 1))
    drop_keys(m, lambda g, n: g == 0 and n == 64)
    b = make_request("b", [*range(96), 99])
    _blocks, hit, _ = m.get_computed_blocks(b)
    m.new_step_starts()
    alone = tuple(mg.find_longest_cache_hit(b.block_hashes, 96, m.coordinator.hit_alignment)[1]
                  for mg in m.coordinator.managers)
    assert alone == (48, 96)
    assert hit == 32 and _lookup(events, "b").hit_tokens_per_group == alone


def test_the_vllm_backends_first_miss_is_past_group_0s_own_hit(vllm_api):
    """--backend vllm read the first miss past the request's hit: with no Mamba state before
    b's 24 shared tokens the hit is 0, and it named block 0, which group 0 holds (139 of 431
    attributions of gen:agent, kimi-hybrid, 100 blocks, blamed blocks group 0 held). Now
    past group 0's own hit, as kvtrace's manager reads it."""
    from kvtrace.engine.backends.vllm.engine_manager import VllmEngineManager

    config = CacheConfig(groups=(FullAttentionSpec(8), MambaSpec(8)), hash_block_size=8, num_gpu_blocks=40,
                         enable_partial_hits=False)
    theirs, ours = VllmEngineManager(config, api=vllm_api), KVCacheManager(config)
    events: dict[str, list] = {"vllm": [], "kvtrace": []}
    theirs.subscribe(events["vllm"].extend)
    ours.subscribe(events["kvtrace"].extend)
    hits = []
    for rid, tokens in (("a", range(41)), ("b", [*range(24), *[99] * 16])):
        request = theirs.new_request(rid, list(tokens), max_tokens=1)
        for name, manager in (("vllm", theirs), ("kvtrace", ours)):
            blocks, hit, _ = manager.get_computed_blocks(request)
            assert manager.allocate_slots(request, request.num_tokens - hit, hit, blocks) is not None
            hits.append((rid, name, hit))
            manager.take_state_writes()
            manager.free(request)
            manager.new_step_starts()
    assert hits[-2:] == [("b", "vllm", 0), ("b", "kvtrace", 0)]
    misses = {name: (_lookup(evs, "b").first_miss_index, _lookup(evs, "b").first_miss_hash)
              for name, evs in events.items()}
    assert misses["vllm"] == misses["kvtrace"] == (3, request.block_hashes[3])
