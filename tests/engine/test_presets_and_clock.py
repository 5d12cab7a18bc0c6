"""Presets, overrides, the cost model's arithmetic, and how a run treats the heap."""

import gc
from pathlib import Path

import numpy as np
import pytest

from kvtrace.cache import SHARED_PREFIX_PINNING, MambaSpec
from kvtrace.engine import Engine, get_preset
from kvtrace.engine.clock import Clock, CostModel, prefill_pairs
from kvtrace.errors import ConfigError
from kvtrace.workload import TraceRequest


def test_named_presets_have_the_documented_shape():
    dense = get_preset("dense-attention")
    assert len(dense.cache_config.groups) == 1 and dense.cache_config.retention_interval is None
    kimi = get_preset("kimi-hybrid").cache_config
    assert isinstance(kimi.groups[1], MambaSpec)
    assert kimi.retention_interval == 0 and kimi.enable_partial_hits and kimi.num_prefill_checkpoint_blocks == 1
    assert kimi.prefill_checkpoint_alignment == 16  # FlashKDA
    # one pool shared by both groups, the former two per-group pools together (8,192 + 2,048)
    assert kimi.shared_pool and kimi.num_gpu_blocks == 10_240


def test_overrides_capacity_retention_behaviours_and_block_size():
    p = get_preset("kimi-hybrid", capacity_tokens=1 << 20, retention_interval=None, without=(SHARED_PREFIX_PINNING,))
    cc = p.cache_config
    # the pool in tokens: 2^20 tokens' blocks and the null block, which the Mamba states share
    assert cc.num_gpu_blocks == (1 << 20) // 512 + 1
    assert cc.retention_interval is None and SHARED_PREFIX_PINNING not in cc.behaviours
    assert get_preset("kimi-hybrid", capacity_blocks=600).cache_config.num_gpu_blocks == 600
    separate = get_preset("kimi-hybrid", capacity_blocks=(100, 20)).cache_config  # SGLang-style pools
    assert separate.num_gpu_blocks == (100, 20) and not separate.shared_pool
    small = get_preset("dense-attention", block_size=32).cache_config
    # one group is hashed per block (vLLM); the token capacity is kept
    assert small.groups[0].block_size == 32 and small.hash_block_size == 32
    assert small.num_gpu_blocks == 1 + 53_759 * 16 // 32
    kimi64 = get_preset("kimi-hybrid", block_size=64).cache_config
    assert kimi64.hash_block_size == 64 and kimi64.num_gpu_blocks == 1 + 2048 + 8191 * 512 // 64
    with pytest.raises(ConfigError, match="unknown"):
        get_preset("no-such-preset")
    with pytest.raises(ConfigError, match="behaviours"):
        get_preset("kimi-hybrid", without=("no-such-behaviour",))


def test_cost_model_is_integer_and_additive():
    cm = CostModel("linear", 6_000_000, 14_000, 340, 2_400, 40_000, kv_copy_ns=2_000, state_copy_ns=20_000)
    assert prefill_pairs(0, 4) == 10 and prefill_pairs(6, 4) == 34
    base = cm.step_ns(0, 0, 0, 0, 0, 0)
    assert base == cm.step_overhead_ns
    one = cm.step_ns(num_tokens=100, prefill_pairs=5050, decode_context_tokens=0, num_decode_seqs=0,
                     num_kv_copies=1, num_state_copies=2)
    assert one == base + 100 * cm.token_ns + cm.attn_pair_ps * 5050 // 1000 + cm.kv_copy_ns + 2 * cm.state_copy_ns
    clock = Clock(cm)
    clock.advance_to(50)
    assert clock.run_step(
        num_tokens=1,
        prefill_pairs=0,
        decode_context_tokens=1000,
        num_decode_seqs=1,
        num_kv_copies=0,
        num_state_copies=0,
    ) == (50, 50 + base + cm.token_ns + cm.kv_read_ps + cm.decode_seq_ns)


def test_knee_and_experts_terms():
    knee = CostModel("knee", 0, 10, 0, 0, 0, token_knee=512, token_above_knee_ns=5)
    assert knee.step_ns(512, 0, 0, 0, 0, 0) == 5120 and knee.step_ns(612, 0, 0, 0, 0, 0) == 6120 + 500
    moe = CostModel("moe", 0, 0, 0, 0, 0, moe_expert_ns=1_000_000, num_experts=256, experts_per_token=8)
    one = moe.step_ns(1, 0, 0, 0, 0, 0)
    assert 7_999_000 <= one <= 8_000_000  # one token touches its 8 experts
    many = moe.step_ns(8192, 0, 0, 0, 0, 0)
    assert 255_999_000 <= many <= 256_000_000  # a big chunk touches all 256
    expected = 256 * (1 - (1 - 8 / 256) ** 64) * 1_000_000
    assert abs(moe.step_ns(64, 0, 0, 0, 0, 0) - expected) <= 1_000  # E(1 - (1 - k/E)^T), in fixed point
    assert moe.step_ns(64, 0, 0, 0, 0, 0) == moe.step_ns(64, 0, 0, 0, 0, 0)  # integer and repeatable
    with pytest.raises(ConfigError, match="experts_per_token"):
        CostModel("bad", 0, 0, 0, 0, 0, num_experts=8, experts_per_token=9)


def test_block_size_and_capacity_tokens_combine():
    # the capacity is converted with the block size the groups end up with
    cc = get_preset("kimi-hybrid", block_size=64, capacity_tokens=1_000_000).cache_config
    assert cc.groups[0].block_size == 64 and cc.hash_block_size == 64
    pool = cc.num_gpu_blocks - 1  # the null block holds nothing; the states share the rest
    assert pool * 64 >= 1_000_000 > (pool - 1) * 64
    # a block size alone keeps the preset's token capacity; capacity_blocks alone is taken as given
    base = get_preset("kimi-hybrid").cache_config
    resized = get_preset("kimi-hybrid", block_size=64).cache_config
    assert (resized.num_gpu_blocks - 1 - 2048) * 64 == (base.num_gpu_blocks - 1 - 2048) * 512
    assert get_preset("kimi-hybrid", block_size=64, capacity_blocks=300).cache_config.num_gpu_blocks == 300


def test_retention_without_a_sparse_group_is_refused():
    with pytest.raises(ConfigError, match="retention_interval: 0 has no effect without a sliding-window or Mamba"):
        get_preset("dense-attention", retention_interval=0)
    assert get_preset("dense-attention", retention_interval=None).cache_config.retention_interval is None


@pytest.mark.parametrize("content", [True, False])
def test_a_run_pauses_the_collector_and_gives_it_back(content):
    """No cyclic collection during a run; the collector is as the caller had it after it,
    also when the run fails, and stays off when the caller had it off."""
    work = [TraceRequest("r0", 0, 40, 3, token_ids=np.arange(40, dtype=np.int64))]
    seen: list[bool] = []
    assert gc.isenabled()
    Engine("dense-attention", content=content).run(work, listeners=[lambda batch: seen.append(gc.isenabled())])
    assert seen and not any(seen)
    assert gc.isenabled()

    def fail(batch):
        raise RuntimeError("listener failed")

    with pytest.raises(RuntimeError):
        Engine("dense-attention", content=content).run(work, listeners=[fail])
    assert gc.isenabled()

    gc.disable()
    try:
        Engine("dense-attention", content=content).run(work)
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("preset,content", [("kimi-hybrid", True), ("kimi-hybrid", False), ("dense-attention", True)])
def test_a_run_makes_no_garbage_cycles_per_request(preset, content):
    """What the paused collector relies on: the cycles left after a run (the block pool's
    linked blocks, the same for any workload) do not grow with the requests replayed."""
    from kvtrace.replay.run import RunSpec, engine_preset, open_workload

    spec = RunSpec(str(Path(__file__).resolve().parents[1] / "data" / "mooncake_synthetic_trace.jsonl"),
                   preset=preset)
    work = list(open_workload(spec).requests)
    left = []
    for n in (20, 120):
        gc.collect()
        gc.disable()
        try:
            Engine(engine_preset(spec), content=content).run(work[:n])
            left.append(gc.collect())
        finally:
            gc.enable()
    assert left[1] - left[0] < 100, left  # 100 more requests: not even one cycle each


def test_capacity_tokens_is_the_pool_capacity_blocks_spells_in_blocks():
    """kimi-hybrid's --capacity-tokens added the preset's 2,048-block state budget to the
    attention tokens asked for, in the one pool attention shares: attention took the budget
    too, so 20,000 tokens ran a pool of ~1M tokens, at the unbounded pool's hit rate, and
    a sweep over capacity_tokens was flat. It is now the pool in tokens, as the study takes
    its two spellings for one setting."""
    from kvtrace.numeric import cdiv
    from kvtrace.replay.run import RunSpec, run_replay

    tokens = run_replay(RunSpec("gen:chat", limit=40, content=False, capacity_tokens=20_000))
    blocks = run_replay(RunSpec("gen:chat", limit=40, content=False, capacity_blocks=1 + cdiv(20_000, 512)))
    unbounded = run_replay(RunSpec("gen:chat", limit=40, content=False))
    assert tokens.summary["digest"] == blocks.summary["digest"]
    assert tokens.summary["prefix_cache_hit_rate"] < unbounded.summary["prefix_cache_hit_rate"]
