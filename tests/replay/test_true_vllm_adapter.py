"""The ``--backend vllm`` adapter against kvtrace's own manager, call by call, where both
make the same decisions: what the adapter reports of vLLM's allocations (events, state
writes) must be what kvtrace's manager reports of the same allocations."""

from __future__ import annotations

from kvtrace.cache import CacheConfig, FullAttentionSpec, KVCacheManager, SlidingWindowSpec
from kvtrace.cache.config import ExternalTierConfig
from kvtrace.cache.events import BlockCopied
from kvtrace.cache.plans import STATE_EXTERNAL


def test_an_external_load_past_a_sliding_window_copies_no_null_block(vllm_api):
    """A connector load of 16 tokens beside a 4-token window: vLLM's table holds null blocks
    for the skipped ones, and the adapter reported an external copy (and a state write) into
    block 0 for each of them (a cow span and a cow_copies count kvtrace's manager never has)."""
    from kvtrace.engine.backends.vllm.engine_manager import VllmEngineManager

    config = CacheConfig(groups=(FullAttentionSpec(4), SlidingWindowSpec(4, sliding_window=4)), hash_block_size=4,
                         num_gpu_blocks=12, enable_partial_hits=False, num_prefill_checkpoint_blocks=0,
                         external=ExternalTierConfig(64))
    theirs, ours = VllmEngineManager(config, api=vllm_api), KVCacheManager(config)
    events: dict[str, list] = {"vllm": [], "kvtrace": []}
    theirs.subscribe(events["vllm"].extend)
    ours.subscribe(events["kvtrace"].extend)
    writes: dict[str, list] = {"vllm": [], "kvtrace": []}
    loaded = []
    # r1 is published (and written through to the tier), r2 evicts it locally, r3 loads it back
    for rid, tokens in (("r1", range(1, 18)), ("r2", range(100, 117)), ("r3", range(1, 18))):
        request = theirs.new_request(rid, list(tokens), max_tokens=1)
        for name, manager in (("vllm", theirs), ("kvtrace", ours)):
            blocks, hit, _ = manager.get_computed_blocks(request)
            external = manager.get_num_external_hit_tokens(request, hit)
            out = manager.allocate_slots(request, request.num_tokens - hit - external, hit, blocks, external)
            assert out is not None
            loaded.append((rid, name, hit, external))
            writes[name] += [(w.group_id, w.block_id) for w in manager.take_state_writes() if w.kind == STATE_EXTERNAL]
            manager.free(request)
            manager.new_step_starts()
    assert loaded[-2:] == [("r3", "vllm", 0, 16), ("r3", "kvtrace", 0, 16)]  # the load happened, alike
    copies = {name: [(e.group_id, e.dst) for e in evs if isinstance(e, BlockCopied)] for name, evs in events.items()}
    assert copies["vllm"] == copies["kvtrace"] and len(copies["kvtrace"]) == 5  # 4 attention blocks, 1 in the window
    assert all(dst != 0 for _, dst in copies["vllm"])
    assert writes["vllm"] == writes["kvtrace"]
