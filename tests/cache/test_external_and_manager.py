"""External tier lookups, state writes, copies' lifetime and request hashing in the manager."""

import numpy as np

from kvtrace.cache import (
    CacheConfig,
    ExternalTierConfig,
    FullAttentionSpec,
    KVCacheManager,
    MambaSpec,
    Request,
)
from kvtrace.cache.events import BlockCopied, BlockEvicted, PrefixLookup

from .helpers import cached_block, make_request, run_chunk


def test_external_tier_serves_blocks_evicted_from_the_gpu():
    cfg = CacheConfig(groups=(FullAttentionSpec(4),), num_gpu_blocks=5, hash_block_size=4,
                      external=ExternalTierConfig(capacity_blocks=16))
    m = KVCacheManager(cfg)
    events = []
    m.subscribe(events.extend)
    a = make_request("a", range(13))
    run_chunk(m, a, 13)
    m.free(a)
    b = make_request("b", range(500, 516))
    run_chunk(m, b, 16)  # evicts a's blocks from the GPU
    m.free(b)
    assert all(cached_block(m, 0, h) is None for h in a.block_hashes)
    again = make_request("a2", range(13))
    blocks, hit, _ = m.get_computed_blocks(again)
    assert hit == 0
    ext = m.get_num_external_hit_tokens(again, hit)
    assert ext == 12
    assert m.allocate_slots(again, 1, hit, blocks, num_external_computed_tokens=ext) is not None
    writes = m.take_state_writes()
    assert [(w.kind, w.num_tokens) for w in writes] == [("external", 4), ("external", 8), ("external", 12)]
    m.new_step_starts()
    loads = [e for e in events if isinstance(e, BlockCopied) and e.why == "external"]
    assert len(loads) == 3 and all(e.src == -1 for e in loads)
    assert m.stats.external_hit_tokens == 12


def test_external_tier_capacity_is_lru_with_connector_evictions():
    cfg = CacheConfig(groups=(FullAttentionSpec(4),), num_gpu_blocks=20, hash_block_size=4,
                      external=ExternalTierConfig(capacity_blocks=2))
    m = KVCacheManager(cfg)
    events = []
    m.subscribe(events.extend)
    run_chunk(m, make_request("a", range(13)), 13)  # 3 keys into a 2-block tier
    assert len(m.external) == 2
    ev = [e for e in events if isinstance(e, BlockEvicted) and e.reason == "connector"]
    assert len(ev) == 1 and ev[0].block_ids == (-1,)


def test_hybrid_external_hit_needs_a_state_for_the_mamba_group():
    cfg = CacheConfig(groups=(FullAttentionSpec(4), MambaSpec(8)), num_gpu_blocks=(6, 4), hash_block_size=4,
                      external=ExternalTierConfig(64))
    m = KVCacheManager(cfg)
    a = make_request("a", range(20))
    run_chunk(m, a, 16)  # Mamba state at 16 (block aligned) is published
    run_chunk(m, a, 4)
    m.free(a)
    run_chunk(m, make_request("b", range(900, 920)), 20)  # pushes a out of the small GPU pools
    r = make_request("c", list(range(16)) + [7, 7, 7, 7])
    blocks, hit, _ = m.get_computed_blocks(r)
    assert hit == 0
    assert m.get_num_external_hit_tokens(r, hit) == 16


def test_prefix_lookup_event_and_stats():
    m = KVCacheManager(CacheConfig(groups=(FullAttentionSpec(4),), num_gpu_blocks=20, hash_block_size=4))
    events = []
    m.subscribe(events.extend)
    a = make_request("a", range(13))
    run_chunk(m, a, 13)
    b = make_request("b", list(range(8)) + [99] * 5)
    m.get_computed_blocks(b)
    m.new_step_starts()
    (lk,) = [e for e in events if isinstance(e, PrefixLookup) and e.request_id == "b"]
    assert (lk.num_query_tokens, lk.num_hit_tokens, lk.hit_tokens_per_group) == (13, 8, (8,))
    assert lk.root_hash == a.block_hashes[0] and lk.first_miss_index == 2
    assert lk.first_miss_hash == b.block_hashes[2]
    assert m.stats.as_dict()["hit_tokens"] == 8 and m.stats.publishes == 3


def test_copy_endpoints_stay_referenced_until_copies_are_taken():
    cfg = CacheConfig(groups=(FullAttentionSpec(8),), num_gpu_blocks=10, hash_block_size=4, enable_partial_hits=True)
    m = KVCacheManager(cfg)
    a = make_request("a", range(13))  # prompt tail boundary (13 - 1) // 4 * 4 = 12 inside block 1
    run_chunk(m, a, 13)
    m.free(a)
    b = make_request("b", list(range(12)) + [5, 5])
    blocks, hit, _ = m.get_computed_blocks(b)
    assert hit == 12
    m.allocate_slots(b, 2, hit, blocks)
    src = blocks.blocks[0][1]
    assert src.ref_cnt == 1  # held for the pending copy though b's table moved on
    (copy,) = m.take_block_copies()
    assert copy.src == src.block_id and src.ref_cnt == 0
    assert m.pools[0].blocks[copy.dst].ref_cnt == 1  # only b's table now


def test_requests_given_trace_ids_hash_lazily_and_match_across_managers():
    cfg = CacheConfig(groups=(FullAttentionSpec(16),), num_gpu_blocks=40, hash_block_size=16)
    m1, m2 = KVCacheManager(cfg), KVCacheManager(cfg)
    r1 = Request("x", None, trace_block_ids=(5, 6, 7), trace_block_size=64, num_prompt_tokens=150)
    r2 = Request("x", None, trace_block_ids=(5, 6, 7), trace_block_size=64, num_prompt_tokens=150)
    m1.attach(r1)
    m2.attach(r2)
    assert r1.block_hashes == r2.block_hashes and len(r1.block_hashes) == 9  # process-independent
    assert r1._prompt is None  # no tokens were synthesised to hash
    r1.append_output_token_ids(np.arange(10))
    assert len(r1.block_hashes) == 10


def test_mamba_speculative_blocks_follow_the_align_layout():
    cfg = CacheConfig(groups=(FullAttentionSpec(8), MambaSpec(8)), num_gpu_blocks=16, hash_block_size=8,
                      num_speculative_blocks=1)
    m = KVCacheManager(cfg)
    r = make_request("s", range(16))
    out = m.allocate_slots(r, 16)
    ids = m.get_block_ids("s")[1]
    assert out.get_block_ids()[1] == ids and ids[0] == 0 and len(ids) == 3  # null, state, draft
    (w,) = m.take_state_writes()
    assert (w.block_id, w.num_tokens) == (ids[1], 16)
    r.num_computed_tokens = 16
    m.new_step_starts()
    r.append_output_token_ids([1])
    out = m.allocate_slots(r, 1)
    table = m.get_block_ids("s")[1]
    assert len(out.get_block_ids()[1]) == 1 and len(table) == 4
    (w,) = m.take_state_writes()
    assert w.block_id == table[2] and w.num_tokens == 17  # the previous draft block carries the state
