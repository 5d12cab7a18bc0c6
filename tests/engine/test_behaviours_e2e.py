"""The three behaviours end to end: each switched off on a workload built to expose it."""

from kvtrace.cache import EXTERNAL_HIT_RUNNING_COW, SHARED_PREFIX_PINNING, TRANSIENT_CHECKPOINT_RETENTION
from kvtrace.cache.events import EVICT_LRU, BlockEvicted, BlockPublished, StaleHashLeft
from kvtrace.engine import Engine
from kvtrace.engine.events import DivergentOutput, StaleHashFound
from tests.engine.workloads import (
    external_continuation,
    hot_prefix_with_long_cold_prompts,
    hybrid_cache,
    preset,
    system_prompt_chat,
)


def run(cache, work, batch=8192):
    batches = []
    res = Engine(preset(cache, batch=batch), audit_interval=1).run(work, [batches.append])
    cache_events = [e for b in batches for e in b.cache_events]
    engine_events = [e for b in batches for e in b.engine_events]
    return res, cache_events, engine_events


def hot_prefix_mamba_evictions(cache_events, prefix_len: int) -> int:
    hot = {
        h
        for e in cache_events
        if isinstance(e, BlockPublished) and e.request_id.startswith("hot") and e.group_id == 1
        and e.num_tokens <= prefix_len
        for h in e.block_hashes
    }
    return sum(
        1
        for e in cache_events
        if isinstance(e, BlockEvicted) and e.group_id == 1 and e.reason == EVICT_LRU
        for h in e.block_hashes
        if h in hot
    )


def test_transient_checkpoints_published_evict_the_hot_prefix():
    work = hot_prefix_with_long_cold_prompts()
    # a pool per group (SGLang's layout), with a small state pool: the checkpoints crowd it alone
    cache = hybrid_cache(num_gpu_blocks=(1024, 16))
    on, on_ev, _ = run(cache, work, batch=64)
    off, off_ev, _ = run(cache.without(TRANSIENT_CHECKPOINT_RETENTION), work, batch=64)
    # With the switch off, mid-prompt checkpoints are published and crowd the state LRU.
    assert sum(1 for e in off_ev if isinstance(e, BlockPublished) and e.kind == "checkpoint") > 50
    assert not any(isinstance(e, BlockPublished) and e.kind == "checkpoint" for e in on_ev)
    assert hot_prefix_mamba_evictions(off_ev, 160) >= 10
    assert hot_prefix_mamba_evictions(on_ev, 160) == 0
    # ... so the hot system prompt stops hitting: 6 of 8 rounds hit 160 tokens with it on.
    assert on.summary["prefix_cache_hits"] >= 6 * 160
    assert off.summary["prefix_cache_hits"] <= on.summary["prefix_cache_hits"] // 4
    for r in (on, off):
        assert r.summary["divergent_outputs"] == 0 and r.summary["stale_hashes"] == 0


def test_without_shared_prefix_pinning_the_system_prompt_is_lost_at_zero_retention():
    work = system_prompt_chat(n=12, sys_len=200)
    cache = hybrid_cache()
    on, _, _ = run(cache, work)
    off, _, _ = run(cache.without(SHARED_PREFIX_PINNING), work)
    hits_on = {r.request_id: r.num_local_hit_tokens for r in on.requests}
    hits_off = {r.request_id: r.num_local_hit_tokens for r in off.requests}
    # From the third request on, the junction (200 floored to 192) is pinned and reused.
    assert all(hits_on[f"hot{i}"] == 192 for i in range(2, 12))
    assert all(v == 0 for v in hits_off.values())
    assert on.summary["prefix_cache_hit_rate"] > 0.5 and off.summary["prefix_cache_hit_rate"] == 0.0
    assert on.summary["computed_prompt_tokens"] < off.summary["computed_prompt_tokens"] - 10 * 190


def test_without_external_hit_running_cow_outputs_diverge_after_an_external_hit():
    work, cache = external_continuation()
    on, on_ev, on_eng = run(cache, work)
    off, off_ev, off_eng = run(cache.without(EXTERNAL_HIT_RUNNING_COW), work)
    for r in (on, off):  # the geometry really happens: 10 tokens loaded from the external tier
        assert {x.request_id: x.num_external_hit_tokens for x in r.requests}["consumer"] == 10
    assert on.summary["divergent_outputs"] == 0
    assert on.summary["stale_hashes"] == 0
    assert on.summary["table_disagreements"] == 0
    # Core and Worker disagree on the live state block: the cached tail @14 goes stale and
    # every sibling that hits it samples wrong tokens.
    assert off.summary["table_disagreements"] > 0
    assert off.summary["stale_hashes"] >= 1
    assert any(isinstance(e, StaleHashLeft) for e in off_ev)
    assert any(isinstance(e, StaleHashFound) and e.num_tokens == 14 for e in off_eng)
    diverged = {e.request_id for e in off_eng if isinstance(e, DivergentOutput)}
    # the consumer, whose live state the Core moved, and whoever hits the stale tail
    assert diverged and diverged <= {"consumer", "sibling0", "sibling1", "sibling2"}
    assert off.summary["divergent_outputs"] >= 9
