"""The cache manager against what vLLM 0.33 and kvtrace's own definitions say (twenty-sixth session's probe)."""

from __future__ import annotations

from kvtrace.cache import CacheConfig, FullAttentionSpec, KVCacheManager, MambaSpec
from kvtrace.cache.events import PrefixLookup

from .helpers import cache_and_free, drop_keys, make_request, run_chunk


def _lookup_events(manager: KVCacheManager) -> list[PrefixLookup]:
    events: list = []
    manager.subscribe(events.extend)
    return events  # (filled at each new_step_starts)


def test_a_groups_hit_per_group_is_what_it_alone_found_not_capped_by_the_attention_hit():
    """metrics.GROUP_HIT_RATE_DOC: "hit tokens KV group g alone found ... (before the groups
    agree on one hit)". The state group was looked up capped by the attention group's hit, so
    with the attention key of block 1 gone (attention alone: 8 tokens) the state stored
    after 24 tokens was reported as 8, the request's hit, not the 24 the group holds."""
    m = KVCacheManager(CacheConfig(groups=(FullAttentionSpec(8), MambaSpec(8)), num_gpu_blocks=40,
                                   hash_block_size=8))
    events = _lookup_events(m)
    cache_and_free(m, "a", range(25), (8, 8, 8, 1))
    assert drop_keys(m, lambda g, n: g == 0 and n == 16) == 1  # (attention's key of block 1)
    b = make_request("b", [*range(24), 99, 99, 99, 99])
    _blocks, hit, _boundary = m.get_computed_blocks(b)
    m.new_step_starts()
    (lookup,) = [e for e in events if isinstance(e, PrefixLookup) and e.request_id == "b"]
    assert hit == lookup.num_hit_tokens == 8  # the request hits what both groups hold
    assert lookup.hit_tokens_per_group == (8, 24)


def test_an_empty_request_hits_nothing_in_a_hybrid_lookup():
    """The hybrid fixed point started from num_tokens - 1 = -1 and kept it: an empty request's
    lookup answered a hit of -1 tokens and counted it as a hit request (one group: 0)."""
    m = KVCacheManager(CacheConfig(groups=(FullAttentionSpec(4), MambaSpec(4)), num_gpu_blocks=10,
                                   hash_block_size=4))
    _blocks, hit, boundary = m.get_computed_blocks(make_request("z", []))
    assert (hit, boundary) == (0, 0)
    assert (m.stats.hit_tokens, m.stats.hit_requests) == (0, 0)


def _tier_lookup(window: int, published: list[int], prompt: list[int]) -> int:
    """The external hit of ``prompt`` on a sliding-window group (4-token blocks) whose tier
    holds what a request of ``published`` tokens keyed (none of it local any more)."""
    from kvtrace.cache import SlidingWindowSpec
    from kvtrace.cache.config import ExternalTierConfig

    m = KVCacheManager(CacheConfig(groups=(SlidingWindowSpec(4, window),), num_gpu_blocks=40, hash_block_size=4,
                                   external=ExternalTierConfig(100)))
    if published:
        a = make_request("a", published)
        run_chunk(m, a, len(published))
        m.free(a)
        assert m.reset_prefix_cache()  # the local keys go; the tier keeps its own
    b = make_request("b", prompt)
    _blocks, hit, _ = m.get_computed_blocks(b)
    assert hit == 0
    return m.get_num_external_hit_tokens(b, hit)


def test_a_one_token_window_has_no_external_hit_on_an_empty_tier():
    """The tier's sliding-window rule asked for cdiv(window - 1, bs) blocks: none for a
    one-token window, so an empty tier answered with the whole prompt (16 of 20 tokens;
    gen:mixed with one such group read 99% external hits, its tier holding nothing). The
    local lookup's rule holds for the tier too: a hit ends on a block it holds."""
    assert _tier_lookup(1, [], list(range(50, 70))) == 0


def test_the_tiers_window_rule_counts_the_blocks_it_holds_in_a_row():
    """(the rule, read once per lookup now: a 64k-token window over a 256k-token prompt took
    9.4 s a lookup, every window's blocks looked up again at each candidate length)"""
    shared = list(range(50, 63))  # 13 tokens: 3 blocks keyed and written through to the tier
    assert _tier_lookup(9, shared, shared[:12] + list(range(900, 910))) == 12
    assert _tier_lookup(9, shared, shared[:9] + list(range(900, 910))) == 8  # a window of 2 blocks ending at 8
    assert _tier_lookup(9, shared, shared[:5] + list(range(900, 910))) == 4  # the window reaches the start


def test_a_lookups_first_miss_is_past_group_0s_own_hit():
    """first_miss_hash is "the first full block that missed (group 0)" (README): it was read
    past the request's hit, so where the state group cut the hit short it named a block
    group 0 held, and the miss attribution blamed an old eviction of it (1,394 of 2,893
    attributions of gen:agent on 40 blocks)."""
    m = KVCacheManager(CacheConfig(groups=(FullAttentionSpec(8), MambaSpec(8)), num_gpu_blocks=40,
                                   hash_block_size=8))
    events = _lookup_events(m)
    cache_and_free(m, "a", range(41), (8, 8, 8, 8, 8, 1))
    drop_keys(m, lambda g, n: (g == 1 and n > 8) or (g == 0 and n == 32))  # states past 8 go; attention keeps 0..24
    b = make_request("b", [*range(40), 99])
    _blocks, hit, _ = m.get_computed_blocks(b)
    m.new_step_starts()
    (lookup,) = [e for e in events if isinstance(e, PrefixLookup) and e.request_id == "b"]
    assert hit == 8 and lookup.hit_tokens_per_group == (24, 8)
    assert (lookup.first_miss_index, lookup.first_miss_hash) == (3, b.block_hashes[3])  # [24, 32): gone
