"""``--backend vllm`` against the kvtrace backend, eviction by eviction, where vLLM's
manager and kvtrace's make the same decisions (every behaviour on): the adapter's
inferred reasons, the blocks it names and the external tier's own evictions."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import duckdb
import pytest

from kvtrace.replay.run import RunSpec, run_replay

EXTERNAL_STUDY = "gen:study-external-hit-running-cow"


def _evictions(db, run_id: str) -> Counter:
    """(step, group, block id, reason) of every evicted key of the run."""
    with duckdb.connect(str(db), read_only=True) as con:
        rows = con.execute("SELECT step, group_id, evict_reason, unnest(block_ids) FROM spans "
                           "WHERE run_id = ? AND name = 'kvtrace.cache.evict'", [run_id]).fetchall()
    return Counter((step, g, b, reason) for step, g, reason, b in rows)


@pytest.mark.parametrize("capacity, external", [(20, 4096), (60, 64)])
def test_an_external_loads_evictions_agree_block_by_block(vllm_api, tmp_path, capacity, external):
    # At 20 blocks: the blocks a connector load takes off the free queue are not among those
    # allocate_slots returns, so the keys they lost were inferred `replaced` (43 of kvtrace's
    # lru); and a partial key a request's block lost and got back within one call was
    # named on another block keyed alike (then a later eviction named block -1). At 64
    # external blocks: the tier's own (connector) evictions, 228 of kvtrace's 485, were
    # missing from the vllm run's evictions.
    db = tmp_path / "ext.duckdb"
    spec = RunSpec(EXTERNAL_STUDY, capacity_blocks=capacity, external_capacity_blocks=external, content=False)
    ours, theirs = run_replay(spec, db=db), run_replay(replace(spec, backend="vllm"), db=db)
    assert theirs.summary["prefix_cache_hits"] == ours.summary["prefix_cache_hits"]
    assert theirs.summary["external_prefix_cache_hits"] == ours.summary["external_prefix_cache_hits"]
    assert theirs.summary["evictions_by_reason"] == ours.summary["evictions_by_reason"]
    assert theirs.summary["evictions"] == ours.summary["evictions"]
    assert ours.summary["evictions_by_reason"]["lru"] > 0
    if external < 100:  # a tier too small to hit from, evicting
        assert ours.summary["evictions_by_reason"]["connector"] > 0
    else:
        assert ours.summary["external_prefix_cache_hits"] > 0
    assert _evictions(db, theirs.run_id) == _evictions(db, ours.run_id)
    # the tier's own evictions are kvtrace's (the adapter infers nothing of them): not marked
    with duckdb.connect(str(db), read_only=True) as con:
        marked = con.execute("SELECT count(*) FROM spans WHERE run_id = ? AND name = 'kvtrace.cache.evict' AND "
                             "evict_reason = 'connector' AND extra_attributes['kvtrace.inferred'] IS NOT NULL",
                             [theirs.run_id]).fetchone()[0]
    assert marked == 0


@pytest.mark.parametrize("retention, capacity", [("none", None), ("512", 150)])
def test_a_key_a_transient_checkpoint_overwrites_is_a_stale_hash_eviction(vllm_api, tmp_path, retention, capacity):
    # A checkpoint block whose checkpoint the call keys nowhere (request-local) loses its key
    # as the state written there overwrites it: kvtrace's manager says stale_hash, the
    # adapter said replaced (2 of 32 evictions of gen:mixed's first 30 requests)
    db = tmp_path / "stale.duckdb"
    spec = RunSpec("gen:mixed", limit=30, retention=retention, capacity_blocks=capacity, content=False)
    ours, theirs = run_replay(spec, db=db), run_replay(replace(spec, backend="vllm"), db=db)
    assert ours.summary["evictions_by_reason"]["stale_hash"] > 0
    assert theirs.summary["evictions_by_reason"] == ours.summary["evictions_by_reason"]
    assert _evictions(db, theirs.run_id) == _evictions(db, ours.run_id)


def test_the_admission_gate_reaches_vllms_manager(vllm_api):
    # the scheduler passes vLLM's full_sequence_must_fit (scheduler_reserve_full_isl): the
    # adapter's allocate_slots did not take it (a TypeError on every replay)
    from kvtrace.engine import get_preset
    from kvtrace.engine.backends.vllm.engine_manager import VllmEngineManager

    config = replace(get_preset("dense-attention").cache_config, num_gpu_blocks=5)  # 4 usable blocks
    bs = config.groups[0].block_size
    manager = VllmEngineManager(config, api=vllm_api)
    request = manager.new_request("r", list(range(6 * bs)), max_tokens=1)  # 6 blocks: more than the pool
    assert manager.allocate_slots(request, 2 * bs, full_sequence_must_fit=True) is None
    assert manager.allocate_slots(request, 2 * bs).get_block_ids() == ([1, 2],)


def test_a_sliding_windows_admission_is_capped_alike_on_both_backends(vllm_api, tmp_path):
    """vLLM's admission gate caps a sliding window's whole-sequence count at its window plus
    the tokens in flight (one step's budget); the adapter built vLLM's manager without that
    budget, so vLLM counted the whole sequence and refused a request kvtrace's manager admits
    ("cannot be scheduled", exit 2)."""
    cfg = tmp_path / "swa.toml"
    cfg.write_text('preset = "dense-attention"\n[cache]\ngroups = [{ type = "full_attention", block_size = 16 }, '
                   '{ type = "sliding_window", block_size = 16, sliding_window = 64 }]\nhash_block_size = 16\n'
                   "[scheduler]\nmax_num_batched_tokens = 256\nmax_num_seqs = 256\n")
    spec = RunSpec("gen:mixed", limit=60, capacity_blocks=700, config_file=str(cfg), content=False)
    ours, theirs = run_replay(spec), run_replay(replace(spec, backend="vllm"))
    for key in ("requests", "prefix_cache_hits", "preemptions", "mean_ttft_ms"):
        assert theirs.summary[key] == ours.summary[key], key
