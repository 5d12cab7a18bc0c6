"""Probe 24 (cache): what the cache's events say agrees with what the cache did."""

from kvtrace.cache import CacheConfig, ExternalTierConfig, FullAttentionSpec, KVCacheManager
from kvtrace.cache.events import BlockEvicted

from .helpers import make_request, run_chunk


def _steps_to(m: KVCacheManager, step: int) -> None:
    while m.step < step:
        m.new_step_starts()


def test_a_connector_eviction_counts_idle_from_the_entrys_last_load():
    """The tier's ``idle`` is the steps since the entry was last used (stored or loaded),
    as the GPU's is; it was the entry's age, however recently a request had loaded it."""
    cfg = CacheConfig(groups=(FullAttentionSpec(4),), num_gpu_blocks=20, hash_block_size=4,
                      external=ExternalTierConfig(capacity_blocks=3))
    m = KVCacheManager(cfg)
    events: list = []
    m.subscribe(events.extend)
    a = make_request("a", range(9))  # two full blocks: two tier entries, stored at step 0
    run_chunk(m, a, 9)
    m.free(a)
    _steps_to(m, 10)
    assert m.reset_prefix_cache()  # the GPU forgets them; the tier keeps them
    again = make_request("a2", range(9))
    blocks, hit, _ = m.get_computed_blocks(again)
    ext = m.get_num_external_hit_tokens(again, hit)
    assert (hit, ext) == (0, 8)
    loaded_at = m.step
    run_chunk(m, again, 1, num_new_computed_tokens=hit, new_computed_blocks=blocks, num_external_computed_tokens=ext)
    m.free(again)
    _steps_to(m, 20)
    evicted_at = m.step
    run_chunk(m, make_request("c", range(500, 509)), 9)  # two new entries push the oldest out
    out = [e for e in events if isinstance(e, BlockEvicted) and e.reason == "connector"]
    assert [e.block_hashes[0] for e in out] == [again.block_hashes[0]]  # the tier's LRU entry
    assert out[0].step == evicted_at
    assert out[0].ages == (evicted_at - 0,)  # since its first store
    assert out[0].idle == (evicted_at - loaded_at,)  # since the load that used it


def test_the_tiers_evictions_for_room_follow_the_publish_of_the_keys_it_stored():
    """A call that published more keys than the external tier holds reported the tier's
    eviction of the first before the publish that stored it: replaying the events (a publish
    stores its keys in the tier, a connector eviction drops one) left keys the tier had
    dropped. Both backends' adapters order them alike (see the vLLM adapter)."""
    from kvtrace.cache.events import BlockPublished

    m = KVCacheManager(CacheConfig(groups=(FullAttentionSpec(4),), num_gpu_blocks=20, hash_block_size=4,
                                   external=ExternalTierConfig(capacity_blocks=2)))
    events: list = []
    m.subscribe(events.extend)
    for rid, first in (("a", 0), ("b", 100)):
        r = make_request(rid, range(first, first + 13))
        blocks, hit, _ = m.get_computed_blocks(r)
        run_chunk(m, r, 13 - hit, num_new_computed_tokens=hit, new_computed_blocks=blocks)
    tier: set = set()
    for ev in events:
        if isinstance(ev, BlockPublished):
            tier.update((ev.group_id, h) for h in ev.block_hashes)
        elif isinstance(ev, BlockEvicted) and ev.reason == "connector":
            for h in ev.block_hashes:
                assert (ev.group_id, h) in tier, "a connector eviction of a key the tier was never given"
                tier.discard((ev.group_id, h))
    assert len(tier) == 2 and tier == set(m.external.entries)  # what the tier holds, exactly


def test_a_lookup_says_the_external_tokens_it_hit():
    """The lookup's span held 0 external hit tokens for every lookup (the manager learns them
    after the lookup event): a run's lookups summed to 0 where its requests loaded 15,424."""
    from kvtrace.cache.events import PrefixLookup

    m = KVCacheManager(CacheConfig(groups=(FullAttentionSpec(4),), num_gpu_blocks=5, hash_block_size=4,
                                   external=ExternalTierConfig(capacity_blocks=16)))
    events: list = []
    m.subscribe(events.extend)
    for rid, tokens in (("a", range(13)), ("x", range(100, 113)), ("a2", range(13))):
        r = make_request(rid, tokens)
        blocks, hit, _ = m.get_computed_blocks(r)
        ext = m.get_num_external_hit_tokens(r, hit)
        run_chunk(m, r, 13 - hit - ext, num_new_computed_tokens=hit, new_computed_blocks=blocks,
                  num_external_computed_tokens=ext)
        m.free(r)
    lookups = {ev.request_id: ev for ev in events if isinstance(ev, PrefixLookup)}
    assert lookups["a2"].num_external_hit_tokens == 12 - lookups["a2"].num_hit_tokens > 0
    assert lookups["a"].num_external_hit_tokens == 0


def test_a_resends_lookup_names_no_miss_past_the_last_token_it_could_hit():
    """An identical resend hits every block but the one holding its last token, which is
    always recomputed: its lookup named that cached block as its first miss, and the miss
    attribution blamed an old eviction of it."""
    from kvtrace.cache.events import PrefixLookup

    m = KVCacheManager(CacheConfig(groups=(FullAttentionSpec(16),), num_gpu_blocks=10, hash_block_size=16))
    events: list = []
    m.subscribe(events.extend)
    for rid in ("a", "again"):
        r = make_request(rid, range(32))
        blocks, hit, _ = m.get_computed_blocks(r)
        run_chunk(m, r, 32 - hit, num_new_computed_tokens=hit, new_computed_blocks=blocks)
        m.free(r)
    first, again = (ev for ev in events if isinstance(ev, PrefixLookup))
    assert (first.first_miss_index, again.num_hit_tokens) == (0, 16)
    assert again.first_miss_index == -1 and again.first_miss_hash is None


def test_a_publish_that_stores_again_a_key_the_tier_held_is_not_reported_evicting_it():
    """One publish re-stores a key the tier still holds: storing the publish's earlier keys
    dropped it for room, then its own store put it back, and the events said "publish X, evict
    X": replaying them left X out of a tier that held it (and a later eviction of X named a key
    the events said was gone). Only the entries gone at the end are reported."""
    from kvtrace.cache.events import BlockPublished

    m = KVCacheManager(CacheConfig(groups=(FullAttentionSpec(4),), num_gpu_blocks=5, hash_block_size=4,
                                   external=ExternalTierConfig(capacity_blocks=3)))
    events: list = []
    m.subscribe(events.extend)
    for rid, tokens in (("a", range(13)), ("d", range(100, 105)), ("e", range(200, 205)), ("a2", range(13))):
        r = make_request(rid, tokens)
        blocks, hit, _ = m.get_computed_blocks(r)
        ext = m.get_num_external_hit_tokens(r, hit)
        run_chunk(m, r, len(tokens) - hit - ext, num_new_computed_tokens=hit, new_computed_blocks=blocks,
                  num_external_computed_tokens=ext)
        m.take_block_copies()
        m.take_state_writes()
        m.free(r)
    tier: set = set()
    for ev in events:
        if isinstance(ev, BlockPublished):
            tier.update((ev.group_id, h) for h in ev.block_hashes)
        elif isinstance(ev, BlockEvicted) and ev.reason == "connector":
            assert all((ev.group_id, h) in tier for h in ev.block_hashes)
            tier.difference_update((ev.group_id, h) for h in ev.block_hashes)
    assert tier == set(m.external.entries)
    assert m.sink.evictions_by_reason["connector"] == sum(
        len(ev.block_hashes) for ev in events if isinstance(ev, BlockEvicted) and ev.reason == "connector")


def test_a_key_dropped_twice_in_one_publish_is_reported_once_with_its_first_stores_age():
    """One publish dropped a key the tier held, stored it again, and dropped it again: its
    eviction was reported twice (the counter 7 where 6 entries left) with a fresh age, as if
    first stored by this publish."""
    from kvtrace.cache.external import ExternalTier
    from kvtrace.cache.sink import EventSink

    sink = EventSink(enabled=True)
    tier = ExternalTier(3, sink)
    tier.store_all(0, [(b"X", 4), (b"A", 8), (b"B", 12)])
    sink.step = 5
    tier.store_all(0, [(b"k1", 4), (b"k2", 8), (b"X", 12), (b"k3", 16), (b"k4", 20), (b"k5", 24)])
    evicted = {ev.block_hashes[0]: (ev.ages[0], ev.idle[0]) for ev in sink.events if isinstance(ev, BlockEvicted)}
    assert len([ev for ev in sink.events if isinstance(ev, BlockEvicted)]) == len(evicted) == sink.evictions == 5
    assert evicted == {b"A": (5, 5), b"B": (5, 5), b"k1": (0, 0), b"k2": (0, 0), b"X": (5, 0)}
    assert set(tier.entries) == {(0, b"k3"), (0, b"k4"), (0, b"k5")}
