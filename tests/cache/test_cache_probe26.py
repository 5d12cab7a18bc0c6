"""The cache manager against what vLLM 0.33 and kvtrace's own definitions say (twenty-sixth session's probe)."""

from __future__ import annotations

from kvtrace.cache import CacheConfig, FullAttentionSpec, KVCacheManager, MambaSpec
from kvtrace.cache.events import PrefixLookup

from .helpers import make_request, run_chunk


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
    a = make_request("a", range(25))
    for n in (8, 8, 8, 1):
        run_chunk(m, a, n)
    m.free(a)
    m.new_step_starts()
    pool = m.block_pool
    assert pool is not None
    (attention_16,) = [bid for g, _h, bid, n in m.cached_entries() if g == 0 and n == 16]
    pool.evict_block_keys(pool.blocks[attention_16], "stale_hash", None)
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
