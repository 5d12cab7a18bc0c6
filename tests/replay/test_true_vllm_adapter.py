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


def test_a_mamba_hit_block_a_connector_load_takes_back_is_an_lru_eviction(vllm_api, tmp_path):
    """A Mamba hit's state block, freed as the table skips past it for an external load and
    taken back off the free queue for the load, loses its key to the pool: kvtrace's manager
    says lru, the adapter (which took every hit block to keep its key) said replaced
    (gen:agent's agent5-s1 at step 918: 180 lru and 18 replaced against 181 and 17)."""
    from collections import Counter
    from dataclasses import replace

    import duckdb

    from kvtrace.replay.run import RunSpec, run_replay

    cfg = tmp_path / "hybrid.toml"
    cfg.write_text('[cache]\ngroups = [{ type = "full_attention", block_size = 512 }, '
                   '{ type = "mamba", block_size = 512, num_lanes = 4 }]\nhash_block_size = 16\n'
                   "num_prefill_checkpoint_blocks = 1\nprefill_checkpoint_alignment = 1\nenable_partial_hits = true\n"
                   'num_speculative_blocks = 1\nretention_interval = "none"\n[scheduler]\nmax_num_seqs = 4\n'
                   "long_prefill_token_threshold = 1024\nscheduler_reserve_full_isl = false\n")
    db = tmp_path / "runs.duckdb"
    spec = RunSpec("gen:agent", preset="dense-attention", config_file=str(cfg), capacity_blocks=60,
                   external_capacity_blocks=4096, limit=30, content=False)
    ours, theirs = run_replay(spec, db=db), run_replay(replace(spec, backend="vllm"), db=db)
    assert ours.summary["external_prefix_cache_hits"] == theirs.summary["external_prefix_cache_hits"] > 0
    assert theirs.summary["evictions_by_reason"] == ours.summary["evictions_by_reason"]
    with duckdb.connect(str(db), read_only=True) as con:
        evictions = [Counter(con.execute(
            "SELECT step, group_id, evict_reason, unnest(block_ids) FROM spans WHERE run_id = ? AND "
            "name = 'kvtrace.cache.evict'", [run]).fetchall()) for run in (ours.run_id, theirs.run_id)]
    assert evictions[0] == evictions[1]
