"""vLLM 0.33 rules the conformance check found kvtrace lacking, one test each.

Each test states the rule with its place in vLLM 0.33.0 (``vllm/v1/core/`` unless
noted) and fails on the code before the fix. The block-pool, partial-tail and
checkpoint rules have theirs in test_block_pool, test_prefix_caching and
test_behaviours.
"""

from __future__ import annotations

from kvtrace.cache import CacheConfig, FullAttentionSpec, KVCacheManager, MambaSpec

from .helpers import cached_block, make_request, run_chunk


def hybrid(num_blocks=64, **kw) -> KVCacheManager:
    base = dict(groups=(FullAttentionSpec(8), MambaSpec(8)), num_gpu_blocks=num_blocks, hash_block_size=4,
                enable_partial_hits=True)
    base.update(kw)
    return KVCacheManager(CacheConfig(**base))


def test_a_mamba_hit_on_a_state_published_this_step_waits_a_step():
    """single_type_kv_cache_manager.py:1704: the state is written by this step's forward
    pass, so the allocation answers "no room" and the request is retried next step; the
    lookup itself sees the hit (full attention would use it at once)."""
    m = hybrid()
    a = make_request("a", range(17))
    out = m.allocate_slots(a, 16)  # publishes the Mamba state at 16 in this very step
    assert out is not None
    b = make_request("b", list(range(16)) + [5, 5, 5])
    blocks, hit, _ = m.get_computed_blocks(b)
    assert hit == 16  # full attention and the lookup see it ...
    assert m.allocate_slots(b, 3, hit, blocks) is None  # ... but the Mamba state is not written yet
    assert m.stats.failed_allocations == 1
    a.num_computed_tokens = 16
    m.take_block_copies()
    m.new_step_starts()
    blocks, hit, _ = m.get_computed_blocks(b)
    assert m.allocate_slots(b, 3, hit, blocks) is not None  # next step it goes


def test_hit_blocks_in_skipped_slots_are_not_taken():
    """add_local_computed_blocks (l.290-305): a hit block in a slot the request already
    skips is padded with a null block and never touched, so it keeps its place in the
    LRU (kvtrace took it and freed it again, moving it to the queue's tail)."""
    m = hybrid()
    a = make_request("a", range(17))
    run_chunk(m, a, 8)  # Mamba state at 8 (block 0)
    run_chunk(m, a, 9)
    m.free(a)
    z = make_request("z", range(900, 924))  # freed after a: its keyed blocks queue behind a's
    run_chunk(m, z, 24)
    m.free(z)
    m.new_step_starts()
    queue = m.block_pool.free_block_queue
    b = make_request("b", list(range(8)) + [50 + i for i in range(12)])
    blocks, hit, _ = m.get_computed_blocks(b)
    assert hit == 8
    state = blocks.blocks[1][0]
    before = queue.block_ids()
    assert before[-1] != state.block_id
    # 8 local tokens + 8 loaded from a connector: the Mamba slot of the hit is skipped
    assert m.allocate_slots(b, 4, hit, blocks, num_external_computed_tokens=8) is not None
    assert m.get_block_ids("b")[1][0] == 0 and state.ref_cnt == 0
    after = queue.block_ids()
    assert state.block_id in after
    assert [x for x in before if x in after] == after  # nothing moved: the LRU order is kept


def test_the_junction_is_the_longest_hit_not_rounded_to_the_scheduler_block():
    """kv_cache_coordinator.py:934 and kv_cache_manager.py:323: shared_prefix_boundary is
    hit + (longest single-group hit - hit), here a fine-grained attention hit of 12."""
    m = hybrid(retention_interval=None)
    a = make_request("a", range(13))
    run_chunk(m, a, 8)
    run_chunk(m, a, 4)  # stops at the tail boundary 12: both groups key it
    run_chunk(m, a, 1)
    m.free(a)
    for g, _h, bid, _n in list(m.cached_entries()):  # the Mamba states leave the cache
        if g == 1:
            m.block_pool.evict_block_keys(m.block_pool.blocks[bid], "stale_hash", None)
    b = make_request("b", list(range(12)) + [77] * 5)
    _blocks, hit, boundary = m.get_computed_blocks(b)
    assert (hit, boundary) == (0, 12)


def test_copies_are_handed_out_group_by_group_and_blocks_allocated_per_group():
    """kv_cache_manager.py:863 drains each group's pending copies in group order, and each
    group takes its copy block and then its new blocks before the next group allocates
    (kv_cache_coordinator.py:338)."""
    m = hybrid(num_blocks=40)
    old = make_request("old", list(range(100, 113)))  # FA and Mamba partial tails at 12
    run_chunk(m, old, 8)
    run_chunk(m, old, 4)
    run_chunk(m, old, 1)
    m.free(old)
    m.new_step_starts()
    a = make_request("a", range(13))  # a producer of a Mamba partial tail at 12
    run_chunk(m, a, 8)
    run_chunk(m, a, 4)
    b = make_request("b", list(range(100, 112)) + list(range(500, 520)))
    assert m.allocate_slots(a, 1) is not None  # a writes on: its tail entry moves to a copy (group 1)
    blocks, hit, _ = m.get_computed_blocks(b)
    assert hit == 12
    free_before = m.block_pool.free_block_queue.block_ids()
    out = m.allocate_slots(b, 20, hit, blocks)  # copy-on-write in both groups, new blocks in both
    assert out is not None
    copies = m.take_block_copies()
    assert [(c.group_id, c.request_id) for c in copies] == [(0, "b"), (1, "a"), (1, "b")]
    fa, mamba = out.get_block_ids()
    # b's own allocations in vLLM's order: group 0's copy block and new blocks, then group 1's
    assert fa + [x for x in mamba if x] == [x for x in free_before if x in fa + mamba][: len(fa) + len(
        [x for x in mamba if x])]


def test_prefill_checkpoints_need_an_exportable_position():
    """kv_cache_interface.py:1189 is_mamba_prefill_checkpoint_valid: the chunk starts on a
    hash boundary, its checkpoint slot lies past its initial state, and the checkpoint is
    a multiple of prefill_checkpoint_alignment past the chunk start."""
    def checkpoints(alignment, start, end, total=240):
        m = KVCacheManager(CacheConfig(groups=(FullAttentionSpec(16), MambaSpec(32)), num_gpu_blocks=80,
                                       hash_block_size=16, enable_partial_hits=True, num_prefill_checkpoint_blocks=1,
                                       prefill_checkpoint_alignment=alignment))
        r = make_request("r", range(total))
        if start:
            run_chunk(m, r, start)
        assert m.allocate_slots(r, end - start) is not None
        return [w.num_tokens for w in m.take_state_writes() if w.kind == "checkpoint"]

    assert checkpoints(16, 0, 240) == [224]
    assert checkpoints(32, 16, 240) == []  # 224 - 16 is not a multiple of 32
    assert checkpoints(32, 32, 240) == [224]
    assert checkpoints(1, 20, 240) == []  # the chunk does not start on a hash boundary
    assert checkpoints(1, 192, 240) == [224]
    assert checkpoints(1, 208, 240) == []  # the checkpoint slot holds the chunk's initial state


def test_a_full_attention_tail_is_keyed_even_without_fine_grained_hits():
    """single_type_kv_cache_manager.py:858: whenever the block is wider than the hash unit.
    Without fine-grained hits the coordinator caches whole scheduler blocks only, so the
    tail at 12 joins the block as an alias once decode fills it (a BlockStored no lookup
    reaches)."""
    m = KVCacheManager(CacheConfig(groups=(FullAttentionSpec(8), MambaSpec(8)), num_gpu_blocks=40, hash_block_size=4,
                                   enable_partial_hits=False))
    a = make_request("a", range(14))
    run_chunk(m, a, 14)
    assert cached_block(m, 0, a.block_hashes[12 // 4 - 1]) is None
    for t in (5, 6):
        a.append_output_token_ids(t)
        run_chunk(m, a, 1)
    block = cached_block(m, 0, a.block_hashes[12 // 4 - 1])
    assert block is not None and block.block_hash == a.block_hashes[16 // 4 - 1]  # the full key's alias
