"""The three reviews' tests, each with its behaviour on and off."""

import pytest

from kvtrace.cache import (
    ALL_BEHAVIOURS,
    EXTERNAL_HIT_RUNNING_COW,
    SHARED_PREFIX_PINNING,
    TRANSIENT_CHECKPOINT_RETENTION,
    CacheConfig,
    FullAttentionSpec,
    KVCacheManager,
    MambaSpec,
)
from kvtrace.cache.events import BlockEvicted, BlockPublished, StaleHashLeft

from .helpers import cached_block, full_mamba_config, make_request, run_chunk

HBS = 16


def checkpoint_manager(retention, behaviours=ALL_BEHAVIOURS):
    return KVCacheManager(
        full_mamba_config(hash_block_size=HBS, full_block_size=HBS, mamba_block_size=32, enable_partial_hits=True,
                          num_prefill_checkpoint_blocks=1, retention_interval=retention, behaviours=behaviours)
    )


# -- transient-checkpoint-retention (000_353743fc9c388772) ---------------------------
# vLLM 0.33: a checkpoint that is not the prompt's, not kept by the retention mask and
# not the shared-prefix junction is transient at every retention value (its slot's keys
# are evicted, nothing is published); at retention 0 only the chunk reaching the end of
# prefill reserves a checkpoint at all. Switched off: every chunk reserves one and every
# checkpoint is published (the old behaviour).

@pytest.mark.parametrize(
    "retention, behaviours, chunk, checkpoint, published",
    [
        (None, ALL_BEHAVIOURS, 128, (112, 2), False),  # mid-prompt, not block aligned: transient
        (None, ALL_BEHAVIOURS, 129, (128, 3), True),  # block aligned: dense retention keeps it
        (64, ALL_BEHAVIOURS, 129, (128, 3), True),  # ends a 64-token segment: kept
        (64, ALL_BEHAVIOURS, 97, (96, 2), False),  # inside a segment: transient
        (0, ALL_BEHAVIOURS, 128, None, False),  # retention 0: no checkpoint before the prefill end
        (0, ALL_BEHAVIOURS - {TRANSIENT_CHECKPOINT_RETENTION}, 128, (112, 2), True),  # the old behaviour
        (None, ALL_BEHAVIOURS - {TRANSIENT_CHECKPOINT_RETENTION}, 128, (112, 2), True),
    ],
)
def test_internal_checkpoint_publication_respects_retention(retention, behaviours, chunk, checkpoint, published):
    m = checkpoint_manager(retention, behaviours)
    r = make_request("producer", range(240))
    blocks, n, _ = m.get_computed_blocks(r)
    assert m.allocate_slots(r, chunk, n, blocks) is not None
    writes = m.take_state_writes()
    ckpt = [(w.num_tokens, m.get_block_ids("producer")[1].index(w.block_id)) for w in writes if w.kind == "checkpoint"]
    assert ckpt == ([checkpoint] if checkpoint else [])
    if checkpoint:
        assert (cached_block(m, 1, r.block_hashes[checkpoint[0] // HBS - 1]) is not None) == published
    old = {b for _, _, b in m.stats.old_behaviour_acted}
    assert old == ({TRANSIENT_CHECKPOINT_RETENTION} if behaviours != ALL_BEHAVIOURS else set())
    r.num_computed_tokens = chunk
    m.new_step_starts()
    # the prompt-end state at 224 is always published: as a checkpoint of the last
    # chunk when it starts on a hash boundary, else at the scheduler's stop there
    if chunk % HBS:
        run_chunk(m, r, 224 - chunk)
    assert m.allocate_slots(r, 240 - r.num_computed_tokens) is not None
    assert cached_block(m, 1, r.block_hashes[224 // HBS - 1]) is not None


@pytest.mark.parametrize("on", [True, False])
def test_transient_checkpoint_evicts_the_key_its_slot_carries(on):
    """The checkpoint slot first takes its full-block key (dense retention keys every
    block), then the checkpoint state overwrites it: the key must go with it."""
    behaviours = ALL_BEHAVIOURS if on else ALL_BEHAVIOURS - {TRANSIENT_CHECKPOINT_RETENTION}
    m = checkpoint_manager(None, behaviours)
    events = []
    m.subscribe(events.extend)
    r = make_request("producer", range(240))
    blocks, n, _ = m.get_computed_blocks(r)
    assert m.allocate_slots(r, 128, n, blocks)
    m.new_step_starts()
    slot_hash = r.block_hashes[96 // HBS - 1]  # slot 2 ends at 96
    checkpoint_hash = r.block_hashes[112 // HBS - 1]
    assert cached_block(m, 1, slot_hash) is None  # never survives: the slot holds the state at 112
    published = [e for e in events if isinstance(e, BlockPublished) and e.group_id == 1]
    evicted = [e for e in events if isinstance(e, BlockEvicted) and e.group_id == 1]
    assert published[0].kind == "full" and slot_hash in published[0].block_hashes
    if on:
        assert cached_block(m, 1, checkpoint_hash) is None
        assert [(e.reason, e.block_hashes) for e in evicted] == [("stale_hash", (slot_hash,))]
    else:
        assert cached_block(m, 1, checkpoint_hash) is not None  # published, competes in the LRU
        assert [(e.reason, e.block_hashes) for e in evicted] == [("replaced", (slot_hash,))]
        assert published[-1].kind == "checkpoint" and published[-1].num_tokens == 112


@pytest.mark.parametrize("on", [True, False])
def test_resumed_request_checkpoint_at_zero_retention_stays_local(on):
    """A preempted request resumes with its outputs: its prefill ends past the prompt, so
    the checkpoint of its last chunk is not the prompt's and is transient."""
    behaviours = ALL_BEHAVIOURS if on else ALL_BEHAVIOURS - {TRANSIENT_CHECKPOINT_RETENTION}
    m = checkpoint_manager(0, behaviours)
    r = make_request("resumed", range(200))
    r.append_output_token_ids(list(range(5000, 5040)))  # 240 tokens, prefill to 239
    assert m.allocate_slots(r, 240) is not None
    (w,) = [w for w in m.take_state_writes() if w.kind == "checkpoint"]
    assert w.num_tokens == 224
    assert (cached_block(m, 1, r.block_hashes[224 // HBS - 1]) is not None) == (not on)
    assert cached_block(m, 1, r.block_hashes[192 // HBS - 1]) is None  # the prompt checkpoint is elsewhere


@pytest.mark.parametrize("on", [True, False])
def test_transient_checkpoints_evict_hot_prefixes_only_when_switched_off(on):
    """A hot prefix survives a long prefill with checkpoints only when they stay local."""
    behaviours = ALL_BEHAVIOURS if on else ALL_BEHAVIOURS - {TRANSIENT_CHECKPOINT_RETENTION}
    m = KVCacheManager(
        CacheConfig(groups=(FullAttentionSpec(HBS), MambaSpec(32)), num_gpu_blocks=(64, 7), hash_block_size=HBS,
                    num_prefill_checkpoint_blocks=1, retention_interval=0, enable_partial_hits=True,
                    behaviours=behaviours)
    )
    hot = make_request("hot", range(64))
    run_chunk(m, hot, 64)
    m.free(hot)
    hot_key = hot.block_hashes[48 // HBS - 1]  # the hot prompt's end checkpoint (state at 48)
    assert cached_block(m, 1, hot_key) is not None
    long = make_request("long", [9000 + i for i in range(320)])
    for _ in range(5):  # chunks of 64: each writes a checkpoint one hash unit before its end
        run_chunk(m, long, 64)
    m.free(long)
    survived = cached_block(m, 1, hot_key) is not None
    assert survived == on
    again = make_request("hot-again", range(64))
    blocks, hit, _ = m.get_computed_blocks(again)
    assert hit == (48 if on else 0)


# -- shared-prefix-pinning (001_d6e83508532dbf74) -------------------------------------

def _system_prompt_run(behaviours):
    m = KVCacheManager(full_mamba_config(retention_interval=0, behaviours=behaviours, num_blocks=128))
    system = list(range(64))
    a = make_request("a", system + [1000 + i for i in range(40)])
    run_chunk(m, a, 96)
    run_chunk(m, a, 8)
    b = make_request("b", system + [2000 + i for i in range(40)])
    blocks, hit, boundary = m.get_computed_blocks(b)
    b.shared_prefix_boundary = boundary
    # the scheduler stops the chunk at the junction when there is one
    first = boundary - hit if boundary else 96
    run_chunk(m, b, first, num_new_computed_tokens=hit, new_computed_blocks=blocks)
    run_chunk(m, b, b.num_tokens - b.num_computed_tokens)
    c = make_request("c", system + [3000 + i for i in range(40)])
    _, hit_c, _ = m.get_computed_blocks(c)
    return hit, boundary, hit_c, m


def test_shared_prefix_survives_zero_retention_and_is_reused():
    hit, boundary, hit_c, m = _system_prompt_run(ALL_BEHAVIOURS)
    assert (hit, boundary) == (0, 64)
    assert hit_c == 64  # the third request reuses the pinned system-prompt state


def test_without_pinning_zero_retention_drops_the_shared_prefix():
    hit, boundary, hit_c, m = _system_prompt_run(ALL_BEHAVIOURS - {SHARED_PREFIX_PINNING})
    assert (hit, boundary) == (0, 0)
    assert hit_c == 0  # every request re-prefills the system prompt


def test_pinned_boundary_is_kept_even_when_the_scheduler_did_not_stop_there():
    m = KVCacheManager(full_mamba_config(retention_interval=0))
    r = make_request("r", range(200))
    r.shared_prefix_boundary = 64
    run_chunk(m, r, 64)
    run_chunk(m, r, 136)
    assert cached_block(m, 1, r.block_hashes[64 // HBS - 1]) is not None


# -- external-hit-running-cow (003_6907421423c997f2) -----------------------------------

def _external_geometry(behaviours):
    cfg = CacheConfig(groups=(FullAttentionSpec(2), MambaSpec(8)), num_gpu_blocks=32, hash_block_size=2,
                      enable_partial_hits=True, behaviours=behaviours)
    m = KVCacheManager(cfg)
    events = []
    m.subscribe(events.extend)
    r = make_request("0", [0] * 15)
    loaded = m.allocate_slots(r, 0, num_external_computed_tokens=10)
    assert loaded is not None
    r.num_computed_tokens = 10
    assert m.allocate_slots(r, 4) is not None  # prefill to the partial tail at 14
    source = m.get_block_ids("0")[1][1]
    partial_hash = r.block_hashes[14 // 2 - 1]
    assert cached_block(m, 1, partial_hash).block_id == source
    m.new_step_starts()
    r.num_computed_tokens = 14
    cont = m.allocate_slots(r, 1)  # continue to the prompt end at 15, same Mamba block
    assert cont is not None
    copies = m.take_block_copies()
    m.new_step_starts()
    return m, r, source, partial_hash, cont, copies, events


def test_external_mamba_hit_same_block_uses_running_cow_on_continue():
    m, r, source, partial_hash, cont, copies, events = _external_geometry(ALL_BEHAVIOURS)
    assert cont.get_block_ids()[1] == []  # no new Mamba block
    assert m.get_block_ids("0")[1][1] == source  # the live block stays
    cow = next(c for c in copies if c.src == source)
    assert cow.dst != source and cow.why == "running_tail"
    assert cached_block(m, 1, partial_hash).block_id == cow.dst  # the entry moved to the copy
    assert not [e for e in events if isinstance(e, StaleHashLeft)]


def test_without_the_fix_the_core_swaps_the_block_the_worker_keeps_writing():
    m, r, source, partial_hash, cont, copies, events = _external_geometry(
        ALL_BEHAVIOURS - {EXTERNAL_HIT_RUNNING_COW}
    )
    cow = next(c for c in copies if c.src == source)
    assert cow.why == "partial_hit"
    assert cont.get_block_ids()[1] == [cow.dst]  # a worker treating it as running appends this
    assert m.get_block_ids("0")[1][1] == cow.dst  # while the Core swapped it in
    assert cached_block(m, 1, partial_hash).block_id == source  # the key stays on the old block
    (stale,) = [e for e in events if isinstance(e, StaleHashLeft)]
    assert (stale.block_id, stale.block_hash, stale.num_tokens) == (source, partial_hash, 14)
    assert m.stats.stale_hash_left == 1


@pytest.mark.parametrize("on", [True, False])
def test_worker_with_append_only_tables_sees_a_stale_key_only_without_the_fix(on):
    """A worker that builds its tables only from what it is sent (set for a new request,
    append for a running one) writes the running state where *its* table says."""
    behaviours = ALL_BEHAVIOURS if on else ALL_BEHAVIOURS - {EXTERNAL_HIT_RUNNING_COW}
    cfg = CacheConfig(groups=(FullAttentionSpec(2), MambaSpec(8)), num_gpu_blocks=32, hash_block_size=2,
                      enable_partial_hits=True, behaviours=behaviours)
    m = KVCacheManager(cfg)
    r = make_request("0", [3] * 15)
    tokens = r.prompt_token_ids.tolist()
    state: dict[int, tuple] = {}  # Mamba block id -> the prefix its state summarises
    worker_table: list[int] = []

    def step(num_new, **kw):
        start = r.num_computed_tokens + kw.get("num_external_computed_tokens", 0)
        out = m.allocate_slots(r, num_new, **kw)
        if not worker_table:
            worker_table.extend(m.get_block_ids("0")[1])
        else:
            worker_table.extend(out.get_block_ids()[1])
        for c in m.take_block_copies():
            if c.group_id == 1:
                state[c.dst] = state.get(c.src)
        for w in m.take_state_writes():
            if w.group_id == 1 and w.kind == "external":
                state[w.block_id] = tuple(tokens[: w.num_tokens])
        end = start + num_new
        if num_new:
            state[worker_table[-(-end // 8) - 1]] = tuple(tokens[:end])
        r.num_computed_tokens = end
        m.new_step_starts()

    step(0, num_external_computed_tokens=10)
    step(4)
    step(1)
    prefix_of = {h: tuple(tokens[: (i + 1) * 2]) for i, h in enumerate(r.block_hashes)}
    stale = [(bid, n) for g, h, bid, n in m.cached_entries() if g == 1 and state.get(bid) != prefix_of[h]]
    assert stale == ([] if on else [(worker_table[1], 14)])
