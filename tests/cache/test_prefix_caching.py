"""Ported vLLM prefix-caching scenarios, in kvtrace's API."""

import pytest

from kvtrace.cache import CacheConfig, FullAttentionSpec, KVCacheManager, MambaSpec, SlidingWindowSpec
from kvtrace.cache.retention import mamba_reachable_mask, swa_reachable_mask

from .helpers import cached_block, full_mamba_config, make_request, run_chunk


def test_prefill_then_decode_reuse():
    m = KVCacheManager(CacheConfig(groups=(FullAttentionSpec(16),), num_gpu_blocks=20, hash_block_size=16))
    common = list(range(48))
    a = make_request("a", common + [100, 101, 102])
    blocks, hit, _ = m.get_computed_blocks(a)
    assert hit == 0
    out = run_chunk(m, a, 51)
    assert out.get_block_ids() == ([1, 2, 3, 4],)
    # decode: 13 more tokens fill block 4, whose key appears once it is full
    for t in range(13):
        a.append_output_token_ids(200 + t)
        assert m.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
        m.new_step_starts()
    assert len(a.block_hashes) == 4 and cached_block(m, 0, a.block_hashes[3]).block_id == 4

    b = make_request("b", common + [7, 8])
    blocks, hit, _ = m.get_computed_blocks(b)
    assert hit == 48 and blocks.get_block_ids() == ([1, 2, 3],)
    out = m.allocate_slots(b, 2, hit, blocks)
    assert out.get_block_ids() == ([5],)
    assert [x.ref_cnt for x in blocks.blocks[0]] == [2, 2, 2]
    assert m.stats.hit_tokens == 48 and m.stats.queries == 2


def test_cache_salt_isolates_prefixes():
    m = KVCacheManager(CacheConfig(groups=(FullAttentionSpec(4),), num_gpu_blocks=20, hash_block_size=4))
    run_chunk(m, make_request("a", range(13), cache_salt="alice"), 13)
    assert m.get_computed_blocks(make_request("b", range(13), cache_salt="alice"))[1] == 12
    assert m.get_computed_blocks(make_request("c", range(13), cache_salt="bob"))[1] == 0
    assert m.get_computed_blocks(make_request("d", range(13)))[1] == 0


def test_sliding_window_hit_needs_contiguous_window_blocks():
    cfg = CacheConfig(groups=(SlidingWindowSpec(4, sliding_window=9),), num_gpu_blocks=30, hash_block_size=4)
    m = KVCacheManager(cfg)
    mgr = m.managers[0]
    assert mgr.need == 2
    a = make_request("a", range(25))
    run_chunk(m, a, 25)
    m.free(a)
    m.new_step_starts()
    b = make_request("b", list(range(24)) + [999] * 6)
    blocks, hit, _ = m.get_computed_blocks(b)
    null = m.pools[0].null_block
    assert hit == 24 and blocks.blocks[0][:4] == [null] * 4
    assert [x.block_id for x in blocks.blocks[0][4:]] == [5, 6]
    # drop block 4's key: the right-to-left scan falls back to blocks 2 and 3
    m.pools[0].evict_block_keys(m.pools[0].blocks[5], "stale_hash", None)
    blocks, hit, _ = m.get_computed_blocks(b)
    assert hit == 16 and [x.block_id for x in blocks.blocks[0][2:]] == [3, 4]


def test_a_one_token_window_hits_only_on_a_cached_block_as_vllm():
    """A window of 1 needs no earlier block (need 0): kvtrace took a whole lookup as a hit
    with no block cached at all, where vLLM 0.33's scan ends a hit at its rightmost cached
    block, and keeps none of such a group's blocks (its retention keeps the last 0 of each
    segment): no hit ever, as ``tests/replay/test_conformance.py`` holds against vLLM."""
    cfg = CacheConfig(groups=(SlidingWindowSpec(4, sliding_window=1),), num_gpu_blocks=30, hash_block_size=4)
    m = KVCacheManager(cfg)
    assert m.managers[0].need == 0
    assert m.get_computed_blocks(make_request("cold", range(17)))[1] == 0
    a = make_request("a", range(9))
    run_chunk(m, a, 9)
    m.free(a)
    m.new_step_starts()
    assert not m.managers[0].cached  # (nothing kept, as vLLM)
    assert m.get_computed_blocks(make_request("b", list(range(8)) + [7] * 9))[1] == 0


def test_sliding_window_frees_blocks_outside_the_window_but_keeps_their_keys():
    cfg = CacheConfig(groups=(SlidingWindowSpec(4, sliding_window=5),), num_gpu_blocks=30, hash_block_size=4)
    m = KVCacheManager(cfg)
    a = make_request("a", range(40))
    run_chunk(m, a, 20)
    run_chunk(m, a, 20)
    table = m.get_block_ids("a")[0]
    assert table[:4] == [0, 0, 0, 0] and all(b != 0 for b in table[4:])
    assert cached_block(m, 0, a.block_hashes[0]) is not None  # freed, still hashed


def test_hybrid_mamba_align_hit():
    m = KVCacheManager(full_mamba_config(hash_block_size=32, full_block_size=32, mamba_block_size=32))
    a = make_request("a", range(100))
    run_chunk(m, a, 96)  # block-aligned split
    run_chunk(m, a, 4)
    assert m.get_block_ids("a")[1][:3] == [0, 0, m.get_block_ids("a")[1][2]]
    b = make_request("b", range(100))
    blocks, hit, boundary = m.get_computed_blocks(b)
    assert hit == 96 and boundary == 0
    ids = blocks.get_block_ids()
    assert len(ids[0]) == 3 and ids[1][:2] == [0, 0] and ids[1][2] != 0
    # a different tail after 64 tokens: Mamba has no state at 64 (a null slot), so the
    # fixed point falls back to 0 even though attention hits 64
    c = make_request("c", list(range(64)) + [5] * 40)
    blocks, hit, boundary = m.get_computed_blocks(c)
    assert hit == 0 and boundary == 64


@pytest.mark.parametrize(
    "k, boundaries, expected",
    [(64, (255,), {3, 7, 11, 14, 15}), (0, (255,), {14}), (0, (255, 96), {5, 14}), (None, (255,), None)],
)
def test_mamba_retention_mask_sets(k, boundaries, expected):
    mask, _owed = mamba_reachable_mask(0, 16, 16, 16, k, boundaries)
    if expected is None:
        assert mask is None
    else:
        assert {i for i, keep in enumerate(mask) if keep} == expected


def test_mamba_retention_mask_windowed_range_and_owed_boundaries():
    mask, owed = mamba_reachable_mask(4, 12, 16, 16, 64, (255, 96))
    assert {i + 4 for i, keep in enumerate(mask) if keep} == {5, 7, 11}
    assert owed == {5}


def test_sliding_window_retention_mask():
    mask, owed = swa_reachable_mask(0, 16, 16, 16, 2, 64, (255,))
    assert {i for i, keep in enumerate(mask) if keep} == {2, 3, 6, 7, 10, 11, 13, 14, 15}
    assert owed == {13}
    mask, owed = swa_reachable_mask(0, 16, 16, 16, 2, 0, (255, 96))
    assert {i for i, keep in enumerate(mask) if keep} == {4, 5, 13, 14}


def test_hybrid_shared_prefix_detection():
    """Attention hits 48, Mamba 0 -> the junction is 32 (Mamba-block aligned)."""
    m = KVCacheManager(full_mamba_config(retention_interval=0))
    a = make_request("a", list(range(48)) + [1000 + i for i in range(60)])
    run_chunk(m, a, 96)
    run_chunk(m, a, 12)
    b = make_request("b", list(range(48)) + [2000 + i for i in range(60)])
    blocks, hit, boundary = m.get_computed_blocks(b)
    assert (hit, boundary) == (0, 32)
    assert blocks.get_block_ids() == ([], [])
    # the scheduler splits at the junction: the state at 32 exists and is kept at k=0
    b.shared_prefix_boundary = boundary
    events = []
    m.subscribe(events.extend)
    run_chunk(m, b, 32, num_new_computed_tokens=hit, new_computed_blocks=blocks)
    run_chunk(m, b, b.num_tokens - 32)
    kept = [e for e in events if getattr(e, "kind", None) == "boundary" and e.group_id == 1]
    assert [e.num_tokens for e in kept] == [32]
    c = make_request("c", list(range(48)) + [3000 + i for i in range(60)])
    assert m.get_computed_blocks(c)[1] == 32


def test_partial_hash_hit_with_copy_on_write():
    cfg = CacheConfig(
        groups=(FullAttentionSpec(2), MambaSpec(4)), num_gpu_blocks=32, hash_block_size=2, enable_partial_hits=True
    )
    m = KVCacheManager(cfg)
    producer = make_request("p", [1, 2, 3, 4, 5, 6, 7])
    run_chunk(m, producer, 6)  # the scheduler stops at the prompt's tail boundary (7 - 1) // 2 * 2
    src = m.get_block_ids("p")[1][1]
    assert cached_block(m, 1, producer.block_hashes[2]).block_id == src  # partial tail @6
    run_chunk(m, producer, 1)  # the producer writes on: the entry moves to a copy first
    moved = cached_block(m, 1, producer.block_hashes[2]).block_id
    assert moved != src and m.get_block_ids("p")[1][1] == src
    m.free(producer)
    m.new_step_starts()

    consumer = make_request("c", [1, 2, 3, 4, 5, 6, 9, 8])
    blocks, hit, _ = m.get_computed_blocks(consumer)
    assert hit == 6 and blocks.get_block_ids()[1] == [0, moved]
    out = m.allocate_slots(consumer, 2, hit, blocks)
    (copy,) = m.take_block_copies()  # the Mamba hit ends inside a block
    assert (copy.group_id, copy.src, copy.why) == (1, moved, "partial_hit") and copy.dst != moved
    assert m.get_block_ids("c")[1] == [0, copy.dst]
    assert copy.dst in out.get_block_ids()[1]
    # the source keeps its key for other requests; the copy owns the running state
    assert cached_block(m, 1, producer.block_hashes[2]).block_id == moved
    writes = m.take_state_writes()
    assert [(w.block_id, w.num_tokens, w.kind) for w in writes] == [(copy.dst, 8, "running")]


def test_partial_tail_is_where_a_resend_can_hit():
    """The prompt's partial-tail entry sits at (num_prompt_tokens - 1) // hash * hash: a
    resend matches at most num_prompt_tokens - 1 tokens (vLLM's token_limit). The issue's
    reproduction: FA(512) + Mamba(512, align, one checkpoint block), hash 64, retention 0,
    a 2,752-token prompt sent twice hits 2,688 tokens (kvtrace hit 2,560 with the tail at
    num_prompt_tokens // hash * hash = 2,752: a multiple of the hash unit, not of the block)."""
    cfg = CacheConfig(groups=(FullAttentionSpec(512), MambaSpec(512)), num_gpu_blocks=64, hash_block_size=64,
                      retention_interval=0, enable_partial_hits=True, num_prefill_checkpoint_blocks=1,
                      prefill_checkpoint_alignment=16)
    m = KVCacheManager(cfg)
    prompt = range(1000, 1000 + 2752)
    a = make_request("a", prompt)
    run_chunk(m, a, 2752)
    assert cached_block(m, 0, a.block_hashes[2688 // 64 - 1]) is not None  # FA partial tail
    assert cached_block(m, 1, a.block_hashes[2688 // 64 - 1]) is not None  # the prompt checkpoint
    assert cached_block(m, 0, a.block_hashes[2752 // 64 - 1]) is None
    m.free(a)
    m.new_step_starts()
    blocks, hit, _ = m.get_computed_blocks(make_request("b", prompt))
    assert hit == 2688
