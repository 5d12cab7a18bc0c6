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
