"""Block pool: one pool for every group, null block, free-queue order, touch, duplicates,
alias keys, moves, reset."""

import numpy as np

from kvtrace.cache import CacheConfig, FullAttentionSpec, KVCacheManager, MambaSpec
from kvtrace.cache.block_pool import BlockPool
from kvtrace.cache.events import EVICT_LRU, EVICT_RESET, BlockEvicted, BlockPublished, BlocksFreed
from kvtrace.cache.sink import EventSink

from .helpers import make_request


def fa_manager(num_blocks=11, block_size=4, **kw):
    cfg = CacheConfig(
        groups=(FullAttentionSpec(block_size),), num_gpu_blocks=num_blocks, hash_block_size=block_size, **kw
    )
    return KVCacheManager(cfg)


def test_free_queue_order_after_free_is_tail_first():
    """vLLM's test_evict shape: request 0 on blocks 1..6 (6 partial), block 10 free."""
    m = fa_manager()
    r0 = make_request("0", range(22))  # 5 full blocks + 2 tokens
    assert m.allocate_slots(r0, 22).get_block_ids() == ([1, 2, 3, 4, 5, 6],)
    r1 = make_request("1", range(100, 112))
    assert m.allocate_slots(r1, 12).get_block_ids() == ([7, 8, 9],)
    assert m.pools[0].free_block_queue.block_ids() == [10]
    m.free(r0)
    # 6 is unhashed -> head; 5..1 are hashed -> tail, in reverse (tail-first) order
    assert m.pools[0].free_block_queue.block_ids() == [6, 10, 5, 4, 3, 2, 1]
    # the next allocation pops 6 then 10 (no eviction), then 5 (evicts its key)
    m.new_step_starts()
    r2 = make_request("2", range(200, 212))
    assert m.allocate_slots(r2, 12).get_block_ids() == ([6, 10, 5],)
    assert m.pools[0].get_cached_block(r0.block_hashes[4], 0) is None
    assert m.pools[0].get_cached_block(r0.block_hashes[3], 0).block_id == 4


def test_null_block_is_never_free_or_cached():
    m = fa_manager(num_blocks=4)
    pool = m.pools[0]
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert 0 not in pool.free_block_queue.block_ids()
    assert m.allocate_slots(make_request("a", range(12)), 12).get_block_ids() == ([1, 2, 3],)
    assert m.allocate_slots(make_request("b", range(4)), 4) is None  # the null block is not usable
    assert m.stats.failed_allocations == 1


def test_touch_removes_free_hit_blocks_and_capacity_counts_them():
    m = fa_manager(num_blocks=5)
    a = make_request("a", range(13))
    m.allocate_slots(a, 13)
    m.free(a)
    m.new_step_starts()
    assert m.pools[0].free_block_queue.block_ids() == [4, 3, 2, 1]
    b = make_request("b", range(13))
    blocks, hit, _ = m.get_computed_blocks(b)
    assert hit == 12 and blocks.get_block_ids() == ([1, 2, 3],)
    assert [x.ref_cnt for x in blocks.blocks[0]] == [0, 0, 0]
    assert m.allocate_slots(b, 1, hit, blocks) is not None
    assert [x.ref_cnt for x in blocks.blocks[0]] == [1, 1, 1]
    assert m.pools[0].free_block_queue.block_ids() == []  # block 4 reused for the last token


def test_attention_keys_are_hittable_in_the_step_that_publishes_them():
    """vLLM publishes at schedule time and lets a later request of the same step hit:
    the forward pass writes a block's kv before any request attends to it."""
    m = fa_manager()
    a = make_request("a", range(9))
    m.allocate_slots(a, 9)
    b = make_request("b", range(9))
    assert m.get_computed_blocks(b)[1] == 8


def test_duplicates_and_eviction_of_one_copy():
    m = fa_manager()
    a, b = make_request("a", range(8)), make_request("b", range(8))
    m.allocate_slots(a, 8)
    m.allocate_slots(b, 8)  # no lookup: the same hashes land on new blocks
    pool = m.pools[0]
    h0 = a.block_hashes[0]
    assert sorted(x.block_id for x in pool.get_cached_blocks(h0, 0)) == [1, 3]
    pool.evict_block_keys(pool.blocks[1], "stale_hash", None)
    assert [x.block_id for x in pool.get_cached_blocks(h0, 0)] == [3]
    m.new_step_starts()
    blocks, hit, _ = m.get_computed_blocks(make_request("c", range(9)))
    assert hit == 8 and blocks.get_block_ids() == ([3, 2],)  # first holder of each key


def test_partial_keys_promote_alias_move_and_promote_to_full():
    sink = EventSink(enabled=True)
    pool = BlockPool(6, sink)
    (b,) = pool.get_new_blocks(1, 0)
    assert pool.cache_partial_block(0, "r", b, b"p6", 6, "partial_tail") == b"p6"
    # a key for a longer prefix replaces the shorter one (vLLM's promotion)
    assert pool.cache_partial_block(0, "r", b, b"p7", 7, "partial_tail") == b"p7"
    assert b.keys() == [(b"p7", 7)] and pool.get_cached_block(b"p6", 0) is None
    # a key for a shorter prefix joins as an alias
    assert pool.cache_partial_block(0, "r", b, b"p5", 5, "partial_tail") == b"p5"
    assert b.keys() == [(b"p7", 7), (b"p5", 5)]
    n_pub = sum(isinstance(e, BlockPublished) for e in sink.events)
    assert pool.cache_partial_block(0, "r", b, b"p5", 5, "partial_tail") == b"p5"  # already there: no event
    assert sum(isinstance(e, BlockPublished) for e in sink.events) == n_pub
    (dst,) = pool.get_new_blocks(1, 0)
    pool.move_block_hashes(b, dst, "r")
    assert b.keys() == [] and dst.keys() == [(b"p7", 7), (b"p5", 5)]
    assert pool.get_cached_block(b"p7", 0) is dst and pool.get_cached_block(b"p5", 0) is dst
    # promotion: a full key replaces the partial ones on the same block
    pool.cache_full_blocks(0, "r", [dst], [b"full"], 0, 1, 8, None, "full")
    assert dst.keys() == [(b"full", 8)] and pool.get_cached_block(b"p5", 0) is None
    reasons = [e.reason for e in sink.events if isinstance(e, BlockEvicted)]
    assert reasons == ["replaced", "moved", "replaced"]


def test_unhashed_blocks_rejoin_the_head_in_free_order():
    """vLLM's ``prepend_n``: several unhashed blocks go to the head in the order freed."""
    pool = BlockPool(6, EventSink())
    blocks = pool.get_new_blocks(5, 0)
    pool.free_blocks([blocks[3], blocks[1]], 0)
    assert pool.free_block_queue.block_ids() == [4, 2]
    pool.free_blocks([blocks[0], blocks[4], blocks[2]], 0)
    assert pool.free_block_queue.block_ids() == [1, 5, 3, 4, 2]


def test_one_pool_serves_every_group():
    """vLLM's coordinator builds one BlockPool for all groups: block ids are unique
    across groups, one free queue and LRU, keys are (hash, group)."""
    cfg = CacheConfig(groups=(FullAttentionSpec(4), MambaSpec(4)), num_gpu_blocks=12, hash_block_size=4)
    m = KVCacheManager(cfg)
    assert m.pools[0] is m.pools[1] is m.block_pool and m.block_pool.num_blocks == 12
    a = make_request("a", range(9))
    m.allocate_slots(a, 9)
    fa, mamba = m.get_block_ids("a")
    assert fa == [1, 2, 3] and mamba == [0, 0, 4]  # one id space, block 0 the null block
    assert m.num_free_blocks == 12 - 1 - 4
    assert m.usage == (3 / 11, 1 / 11) and m.pool_usage == 4 / 11
    h = a.block_hashes[1]
    assert m.block_pool.get_cached_block(h, 0).block_id == 2
    assert m.block_pool.get_cached_block(h, 1) is None  # the Mamba state at 8 is not kept (no block end)
    a.num_computed_tokens = 9
    m.free(a)
    # FA frees tail first (3, 2, 1), then Mamba (4): each group's unhashed blocks go to
    # the head when that group frees, the hashed ones to the tail
    assert m.block_pool.free_block_queue.block_ids()[:2] == [4, 3]
    assert m.block_pool.free_block_queue.block_ids()[-2:] == [2, 1]


def test_groups_may_keep_separate_pools():
    """A tuple num_gpu_blocks: one pool per group (SGLang's separate Mamba state pool)."""
    cfg = CacheConfig(groups=(FullAttentionSpec(4), MambaSpec(4)), num_gpu_blocks=(8, 3), hash_block_size=4)
    m = KVCacheManager(cfg)
    assert m.pools[0] is not m.pools[1] and m.block_pool is None
    a = make_request("a", range(9))
    m.allocate_slots(a, 9)
    assert m.get_block_ids("a") == ([1, 2, 3], [0, 0, 1])  # ids per pool
    assert m.usage == (3 / 7, 1 / 2)
    b = make_request("b", range(100, 109))
    assert m.allocate_slots(b, 9) is not None
    c = make_request("c", range(200, 209))
    assert m.allocate_slots(c, 9) is None  # the state pool is full, the attention one is not


def test_reset_prefix_cache_only_when_idle():
    m = fa_manager()
    events = []
    m.subscribe(events.extend)
    a = make_request("a", range(8))
    m.allocate_slots(a, 8)
    assert m.reset_prefix_cache() is False
    m.free(a)
    assert m.reset_prefix_cache() is True
    assert list(m.cached_entries()) == []
    m.new_step_starts()
    resets = [e for e in events if isinstance(e, BlockEvicted) and e.reason == EVICT_RESET]
    assert sorted(h for e in resets for h in e.block_hashes) == sorted(a.block_hashes)
    assert m.get_computed_blocks(make_request("b", range(9)))[1] == 0


def test_events_per_store_and_remove_are_batched_per_step():
    m = fa_manager(num_blocks=4)
    batches = []
    m.subscribe(batches.append)
    a = make_request("a", range(12))
    m.allocate_slots(a, 12)
    m.free(a)
    m.new_step_starts()
    (step0,) = batches
    pub = [e for e in step0 if isinstance(e, BlockPublished)]
    assert len(pub) == 1 and pub[0].block_ids == (1, 2, 3) and pub[0].block_hashes == tuple(a.block_hashes)
    assert pub[0].num_tokens == 12 and pub[0].kind == "full" and pub[0].step == 0
    freed = [e for e in step0 if isinstance(e, BlocksFreed)]
    assert freed[0].block_ids == (3, 2, 1)
    for _ in range(3):
        m.new_step_starts()
    b = make_request("b", range(50, 58))
    m.allocate_slots(b, 8)  # pops 3 then 2: evicts their keys
    m.new_step_starts()
    ev = [e for e in batches[-1] if isinstance(e, BlockEvicted)]
    assert len(ev) == 1 and ev[0].reason == EVICT_LRU and ev[0].block_ids == (3, 2)
    assert ev[0].block_hashes == (a.block_hashes[2], a.block_hashes[1])
    assert ev[0].ages == (4, 4) and ev[0].idle == (4, 4) and ev[0].request_id == "b"
    assert len(batches) == 5  # one batch per step, even when empty


def test_usage_and_cached_entries():
    m = fa_manager(num_blocks=5)
    a = make_request("a", np.arange(9))
    m.allocate_slots(a, 9)
    assert m.usage == (0.75,) and m.pool_usage == 0.75
    entries = sorted(m.cached_entries(), key=lambda e: e[3])
    assert entries == [(0, a.block_hashes[0], 1, 4), (0, a.block_hashes[1], 2, 8)]
