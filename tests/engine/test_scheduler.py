"""Scheduler scenarios: budget, the Mamba block-aligned split stops, preemption, arrivals."""

import numpy as np
import pytest

from kvtrace.cache import CacheConfig, FullAttentionSpec, KVCacheManager, MambaSpec
from kvtrace.engine import Engine, EngineRequest, Scheduler, SchedulerConfig
from kvtrace.engine.clock import get_cost_model
from kvtrace.engine.presets import EnginePreset
from kvtrace.engine.scheduler import SchedulerOutput
from kvtrace.workload import TraceRequest


def hybrid_cache(blocks=320, hbs=64, bs=512, partial=True, **kw) -> CacheConfig:
    return CacheConfig(
        groups=(FullAttentionSpec(bs), MambaSpec(bs)), num_gpu_blocks=blocks, hash_block_size=hbs,
        retention_interval=0, enable_partial_hits=partial, **kw,
    )


def make_request(rid: str, n: int, seed: int = 0, arrival: int = 0, out: int = 4) -> EngineRequest:
    toks = np.random.default_rng(seed).integers(0, 50_000, n).astype(np.int64)
    return EngineRequest(TraceRequest(rid, arrival, n, out, token_ids=toks))


def split(sched: Scheduler, req: EngineRequest, n: int, local: int = 0, ext: int = 0) -> int:
    return sched._mamba_block_aligned_split(req, n, local, ext)


@pytest.fixture
def sched() -> Scheduler:
    cc = hybrid_cache()
    return Scheduler(SchedulerConfig(max_num_batched_tokens=8192), cc, KVCacheManager(cc))


def test_split_stops_at_last_block_boundary_then_tail_hash_boundary(sched):
    req = make_request("a", 2000)
    assert split(sched, req, 2000) == 1536  # floor(2000/512)*512
    req.num_computed_tokens = 1536
    assert split(sched, req, 464) == 448  # the prompt's tail hash boundary 1984
    req.num_computed_tokens = 1984
    assert split(sched, req, 16) == 16


def test_split_stops_at_the_tail_a_resend_can_reach():
    """vLLM's tail stop is get_mamba_prefill_checkpoint_position(num_prompt_tokens, hash):
    (num_prompt_tokens - 1) // hash * hash. A 2,752-token prompt (a multiple of the hash
    unit) stops at 2,688, where kvtrace stopped nowhere (2,752 // 64 * 64 is the prompt end)."""
    s = Scheduler(SchedulerConfig(), hybrid_cache(), KVCacheManager(hybrid_cache()))
    req = make_request("a", 2752)
    assert split(s, req, 2752) == 2560
    req.num_computed_tokens = 2560
    assert split(s, req, 192) == 128
    req.num_computed_tokens = 2688
    assert split(s, req, 64) == 64


def test_a_chunk_exporting_its_checkpoint_is_not_split():
    """With a checkpoint block the chunk reaching the end of prefill exports the prompt's
    checkpoint itself (use_internal_checkpoint): no stop at the last block, nor at the tail."""
    cc = hybrid_cache(num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=16)
    s = Scheduler(SchedulerConfig(), cc, KVCacheManager(cc))
    req = make_request("a", 2752)
    assert split(s, req, 2752) == 2752
    assert split(s, req, 2700, local=52) == 512 - 52  # from mid-block: not exportable (not on a hash boundary)
    assert split(s, req, 2688, local=64) == 2688  # from a hash boundary: the whole rest


def test_split_without_partial_hits_has_no_tail_stop():
    cc = hybrid_cache(partial=False)
    s = Scheduler(SchedulerConfig(), cc, KVCacheManager(cc))
    req = make_request("a", 2000)
    req.num_computed_tokens = 1536
    assert split(s, req, 464) == 464


def test_split_rounds_an_unfinished_chunk_down_to_a_block(sched):
    req = make_request("a", 5000)
    assert split(sched, req, 1000) == 512


def test_split_stops_at_next_block_boundary_after_mid_block_start(sched):
    req = make_request("a", 5000)
    assert split(sched, req, 4680, local=320) == 192  # 320 -> 512


def test_split_stops_at_shared_prefix_junction_block_floored(sched):
    req = make_request("a", 5000)
    req.shared_prefix_boundary = 1100
    assert split(sched, req, 5000) == 1024
    req.shared_prefix_boundary = 1024
    assert split(sched, req, 5000) == 1024


def test_split_leaves_decode_alone(sched):
    req = make_request("a", 100)
    req.num_computed_tokens = 100
    req.append_output_token_ids(5)
    assert split(sched, req, 1) == 1


def test_split_advances_inside_a_block_wider_than_the_chunk_limit():
    cc = hybrid_cache()
    s = Scheduler(
        SchedulerConfig(max_num_batched_tokens=8192, long_prefill_token_threshold=256), cc, KVCacheManager(cc)
    )
    req = make_request("a", 5000)
    assert split(s, req, 256) == 256  # cannot round down to 0: advance sub-block
    req.num_computed_tokens = 256
    assert split(s, req, 256) == 256  # and re-align at 512


def test_external_geometry_10_14_15():
    cc = CacheConfig(groups=(FullAttentionSpec(2), MambaSpec(8)), num_gpu_blocks=32, hash_block_size=2,
                     retention_interval=None, enable_partial_hits=True)
    s = Scheduler(SchedulerConfig(), cc, KVCacheManager(cc))
    req = make_request("a", 15)
    assert split(s, req, 5, ext=10) == 4  # external state at 10 -> partial tail at 14
    req.num_computed_tokens = 14
    assert split(s, req, 1) == 1  # -> 15


def run_steps(sched: Scheduler, requests, max_steps=10_000):
    """Drive scheduler + cache without a worker (every finished prefill samples token 1)."""
    for r in requests:
        sched.add_request(r)
    outs: list[SchedulerOutput] = []
    while sched.has_unfinished_requests() and len(outs) < max_steps:
        out = sched.schedule()
        outs.append(out)
        running = {r.request_id: r for r in sched.running}
        sampled = {rid: 1 for rid in out.num_scheduled_tokens if rid in running
                   and running[rid].num_computed_tokens == running[rid].num_tokens}
        sched.update_from_output(out, sampled, len(outs))
        sched.kv_cache_manager.new_step_starts()
    return outs


def test_token_budget_and_max_num_seqs_are_respected():
    cc = hybrid_cache(blocks=768)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=3), cc, KVCacheManager(cc))
    reqs = [make_request(f"r{i}", 700 + 97 * i, seed=i, out=5) for i in range(8)]
    outs = run_steps(s, reqs)
    assert all(o.total_num_scheduled_tokens <= 1024 for o in outs)
    assert max(len(o.num_scheduled_tokens) for o in outs) <= 3
    assert max(o.total_num_scheduled_tokens for o in outs) > 512  # the budget was actually used
    assert all(len(r.output_token_ids) == 5 for r in reqs)


def test_preemption_frees_blocks_and_the_request_resumes_to_completion():
    # Each request needs ~12 attention blocks of 64; 24 usable blocks cannot hold three.
    cc = CacheConfig(groups=(FullAttentionSpec(64),), num_gpu_blocks=25, hash_block_size=64)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=4096), cc, KVCacheManager(cc))
    reqs = [make_request(f"r{i}", 700, seed=i, out=80) for i in range(3)]
    outs = run_steps(s, reqs)
    assert s.num_preemptions > 0
    assert any(o.preempted_req_ids for o in outs)
    assert all(len(r.output_token_ids) == 80 for r in reqs)
    assert any(r.num_preemptions > 0 for r in reqs)


def test_preempted_request_output_matches_the_reference():
    preset = EnginePreset(
        "tiny", CacheConfig(groups=(FullAttentionSpec(64),), num_gpu_blocks=25, hash_block_size=64),
        SchedulerConfig(max_num_batched_tokens=4096), get_cost_model("h200-dense-8b"),
    )
    rng = np.random.default_rng(3)
    work = [TraceRequest(f"r{i}", 0, 700, 80, token_ids=rng.integers(0, 9000, 700)) for i in range(3)]
    res = Engine(preset).run(work)
    assert res.summary["preemptions"] > 0
    assert res.summary["divergent_outputs"] == 0
    assert sum(r.num_output_tokens for r in res.requests) == 240


def test_requests_are_admitted_only_after_arrival_and_in_arrival_order():
    rng = np.random.default_rng(1)
    work = [
        TraceRequest(f"r{i}", 5_000_000 * i, 300, 3, token_ids=rng.integers(0, 9000, 300)) for i in range(5)
    ] + [TraceRequest("r5", 500_000_000, 300, 3, token_ids=rng.integers(0, 9000, 300))]
    res = Engine("dense-attention").run(work)
    recs = {r.request_id: r for r in res.requests}
    firsts = [recs[f"r{i}"].first_scheduled_ns for i in range(6)]
    assert all(recs[f"r{i}"].first_scheduled_ns >= 5_000_000 * i for i in range(5))
    assert recs["r1"].first_scheduled_ns > 5_000_000  # arrived while r0 ran: waits for the step end
    assert firsts == sorted(firsts)
    assert recs["r5"].first_scheduled_ns == 500_000_000  # idle engine: scheduled at its arrival


def test_out_of_order_workload_is_a_user_error():
    from kvtrace.errors import KVTraceError

    work = [TraceRequest("a", 10, 5, 1, token_ids=np.arange(5)), TraceRequest("b", 5, 5, 1, token_ids=np.arange(5))]
    with pytest.raises(KVTraceError, match="'b'"):
        Engine("dense-attention").run(work)


def test_recorded_outputs_are_replayed_and_still_verified():
    rng = np.random.default_rng(4)
    prompt = rng.integers(0, 9000, 94)
    follow = np.concatenate([prompt, [7, 8], rng.integers(0, 9000, 30)])
    work = [
        TraceRequest("a", 0, 94, 3, token_ids=prompt, expected_output=(7, 8, 9)),
        TraceRequest("b", 10**9, len(follow), 1, token_ids=follow),
    ]
    res = Engine("dense-attention").run(work)
    hits = {r.request_id: r.num_local_hit_tokens for r in res.requests}
    assert hits["b"] == 96  # a's block 80..95 holds its replayed outputs 7, 8
    assert res.summary["divergent_outputs"] == 0


def test_a_preempted_request_beyond_the_step_budget_without_chunked_prefill_names_the_setting():
    """b (500 prompt tokens) is preempted after ~45 outputs and a's growth evicts its blocks:
    it must prefill 529 tokens again, more than one step's 512. That was blamed on the pool
    ("needs more KV blocks than the pool holds"), which holds b (chunked prefill runs it)."""
    from kvtrace.errors import KVTraceError

    def run(chunked: bool):
        preset = EnginePreset(
            "tiny", CacheConfig(groups=(FullAttentionSpec(16),), num_gpu_blocks=42, hash_block_size=16),
            SchedulerConfig(max_num_batched_tokens=512, enable_chunked_prefill=chunked),
            get_cost_model("h200-dense-8b"),
        )
        rng = np.random.default_rng(0)
        work = [TraceRequest("a", 0, 20, 600, token_ids=rng.integers(0, 9000, 20)),
                TraceRequest("b", 1, 500, 100, token_ids=rng.integers(0, 9000, 500))]
        return Engine(preset, content=False).run(work)

    assert run(True).summary["preemptions"] == 1
    with pytest.raises(KVTraceError) as info:
        run(False)
    text = str(info.value)
    assert "request b (500 prompt tokens, 529 to prefill again after a preemption)" in text, text
    assert "max_num_batched_tokens 512" in text and "capacity" not in text, text


def test_a_prompt_whose_last_token_is_its_own_chunk_counts_it_as_prefilled():
    """b hits 16 of its 17 prompt tokens: its one chunk is the last prompt token alone, which
    the worker runs as a decode. It was left out of computed_prompt_tokens and prefill_chunks
    (b: 0 tokens prefilled, and the summary's computed_prompt_tokens below local_compute)."""
    preset = EnginePreset(
        "tiny", CacheConfig(groups=(FullAttentionSpec(16),), num_gpu_blocks=20, hash_block_size=16),
        SchedulerConfig(), get_cost_model("h200-dense-8b"),
    )
    prompt = np.arange(100, 117)
    work = [TraceRequest("a", 0, 17, 3, token_ids=prompt), TraceRequest("b", 10**9, 17, 3, token_ids=prompt)]
    for content in (True, False):
        res = Engine(preset, content=content).run(work)
        b = {r.request_id: r for r in res.requests}["b"]
        assert b.num_local_hit_tokens == 16
        assert b.num_computed_prompt_tokens == 1 and [c[2] for c in b.prefill_chunks] == [1]
        s = res.summary
        assert s["computed_prompt_tokens"] == s["prompt_tokens_by_source.local_compute"] == 18


def test_a_request_that_outgrows_the_pool_after_a_preemption_names_what_it_must_hold():
    """a's 40-token prompt fits the pool's 3 usable blocks of 16 (the admission gate holds
    the prompt), but its 49th token needs a 4th: it preempts itself and can never be
    resumed. The error named its 40 prompt tokens alone, which the pool holds."""
    from kvtrace.errors import KVTraceError

    preset = EnginePreset(
        "tiny", CacheConfig(groups=(FullAttentionSpec(16),), num_gpu_blocks=4, hash_block_size=16),
        SchedulerConfig(), get_cost_model("h200-dense-8b"),
    )
    work = [TraceRequest("a", 0, 40, 20, token_ids=np.arange(100, 140))]
    for content in (True, False):
        with pytest.raises(KVTraceError) as info:
            Engine(preset, content=content).run(work)
        text = str(info.value)
        assert "request a (40 prompt tokens and 9 generated before a preemption, 49 to hold again)" in text, text
        assert "num_gpu_blocks 4" in text and "\n" not in text, text
