"""kvtrace's engine scheduler against vLLM 0.33's own ``Scheduler``, step by step.

``tests/support/scheduler_conformance.py`` drives both on one workload (vLLM's fed a
``ModelRunnerOutput`` each step that samples what kvtrace's worker replays) and compares
every step's schedule, queues, preemptions, finishes and prefix-cache counters. Each case
also checks that the pressure it names happened (preemption, chunking, the seat limit...),
so an agreement is never an agreement about nothing.

Both run vLLM 0.33's default full-sequence admission gate (``scheduler_reserve_full_isl``):
a request is admitted only when its whole sequence fits the free blocks, so a pool that
once forced preemptions now mostly holds requests back. A case about preemption runs
with the gate off too (``gated``), where the pressure it names shows.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from kvtrace.cache import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from tests.conftest import MOONCAKE
from tests.support.scheduler_conformance import FIELDS, SchedulerCase, SchedulerRun, run_scheduler_conformance

# FA + Mamba in 32-token blocks hashed per 16 tokens, retention 64 (test_conformance.py's)
HYBRID_32 = dict(groups=(FullAttentionSpec(32), MambaSpec(32)), hash_block_size=16, retention_interval=64)
SWA_FA = dict(groups=(FullAttentionSpec(16), SlidingWindowSpec(16, sliding_window=256)), hash_block_size=16,
              retention_interval=0)


def check(case: SchedulerCase, api) -> SchedulerRun:
    run = run_scheduler_conformance(case, api)
    assert run.agree, run.report()
    assert run.stuck is None and run.requests > 0 and run.finished == run.requests, run.report()
    compared = [f for f in FIELDS if f != "prefix_cache_stats" or case.compare_stats]
    assert all(run.compared[f] == run.steps for f in compared) and run.compared["drained"] == 1, (run.compared,
                                                                                                  run.steps)
    return run


def gated(case: SchedulerCase, api) -> tuple[SchedulerRun, SchedulerRun]:
    """``case`` with the admission gate on (vLLM's default) and off, each agreeing; the gate
    refused admissions and held back some of the preemptions the pool forces without it."""
    on = check(replace(case, reserve_full_isl=True), api)
    off = check(replace(case, reserve_full_isl=False), api)
    assert on.gate_refusals > 0 and off.gate_refusals == 0, (on.report(), off.report())
    assert on.preemptions < off.preemptions, (on.report(), off.report())
    return on, off


def test_full_attention_with_a_roomy_pool(vllm_api):
    run = check(SchedulerCase("gen:mixed", limit=60, capacity_blocks=20_000), vllm_api)
    assert run.hit_tokens > 50_000 and run.preemptions == 0
    assert run.stats["prefix_cache_hits"] > 50_000 and run.stats["requests"] == 60


def test_full_attention_under_a_tight_pool_preempts_alike(vllm_api):
    _, run = gated(SchedulerCase("gen:mixed", limit=60, capacity_blocks=500, max_num_batched_tokens=1024,
                                 concurrency=32), vllm_api)
    assert run.preemptions >= 10 and run.resumed == run.preemptions
    assert run.stats["preempted_prefix_cache_queries"] > 0  # the re-lookups, counted apart


def test_full_attention_chunks_a_small_budget_alike(vllm_api):
    run = check(SchedulerCase("gen:mixed", limit=60, max_num_batched_tokens=256), vllm_api)
    assert run.chunks > 100


def test_max_num_seqs_holds_the_queue_alike(vllm_api):
    run = check(SchedulerCase("gen:mixed", limit=60, max_num_seqs=3, max_num_batched_tokens=4096), vllm_api)
    assert run.max_running == 3 and run.waited_for_seqs > 100


def test_long_prefill_token_threshold_cuts_alike(vllm_api):
    run = check(SchedulerCase("gen:mixed", limit=60, long_prefill_token_threshold=300, max_num_batched_tokens=2048),
                vllm_api)
    assert run.chunks > 50


def test_a_lone_request_is_not_cut_by_the_threshold(vllm_api):
    """vLLM 0.33 applies long_prefill_token_threshold only when another request could be
    starved (running + waiting > 1); kvtrace cut a lone request's prefill too (they parted
    at step 1: vLLM scheduled 1,024 tokens, kvtrace 256)."""
    run = check(SchedulerCase("gen:mixed", limit=20, concurrency=1, long_prefill_token_threshold=256,
                              max_num_batched_tokens=1024), vllm_api)
    assert run.chunks > 0  # prompts over the budget are still chunked, by the budget


def test_without_chunked_prefill(vllm_api):
    # (vLLM requires max_num_batched_tokens >= max_model_len without chunked prefill)
    check(SchedulerCase("gen:mixed", limit=60, enable_chunked_prefill=False, max_num_batched_tokens=16_384,
                        max_model_len=16_384, capacity_blocks=1500, concurrency=32), vllm_api)


def test_requests_finished_in_one_step_are_freed_in_the_schedule_order(vllm_api):
    """One-token outputs: a request admitted in a step can finish in it beside running ones.
    vLLM frees them in the schedule's order (running, then admitted); kvtrace freed them in
    the worker's batch order (admitted first), so its LRU evicted other blocks and a later
    prefix hit differed (step 20 of the first case: 2,592 hit tokens against vLLM's 2,000)."""
    for case in (SchedulerCase("gen:agent", capacity_blocks=600, limit=40, seed=823, max_output_tokens=1,
                               max_num_batched_tokens=2048, max_num_seqs=2, long_prefill_token_threshold=512),
                 SchedulerCase("gen:chat", capacity_blocks=800, limit=80, seed=483, max_output_tokens=1,
                               max_num_batched_tokens=1024, max_num_seqs=8)):
        run = check(case, vllm_api)
        assert run.mixed_finishes > 0


def test_mooncake_trace(vllm_api):
    run = check(SchedulerCase(str(MOONCAKE), limit=60, capacity_blocks=20_000, max_num_batched_tokens=2048,
                              concurrency=32), vllm_api)
    assert run.chunks > 100


def test_caching_off_schedules_alike(vllm_api):
    # the prefix-cache counters are left out: with caching off vLLM records no lookup, kvtrace's
    # metrics count every prompt as queried (a difference of kvtrace.metrics, not the scheduler)
    _, run = gated(SchedulerCase("gen:mixed", limit=60, capacity_blocks=500, max_num_batched_tokens=1024,
                                 concurrency=32, cache_overrides=dict(enable_caching=False), compare_stats=False),
                   vllm_api)
    assert run.preemptions > 10 and run.hit_tokens == 0


@pytest.mark.parametrize("capacity, budget, threshold, preempts", [(100, 8192, 0, True), (60, 2048, 0, True),
                                                                    (2000, 1000, 700, False)])
def test_kimi_hybrid(vllm_api, capacity, budget, threshold, preempts):
    """FA(512) + Mamba align(512), hash 64, partial hits, a FlashKDA checkpoint block: the
    block-aligned split and the Mamba same-step rule in both schedulers."""
    case = SchedulerCase("gen:mixed", preset="kimi-hybrid", limit=None if preempts else 60,
                         capacity_blocks=capacity, max_num_batched_tokens=budget,
                         long_prefill_token_threshold=threshold, concurrency=32)
    run = gated(case, vllm_api)[1] if preempts else check(case, vllm_api)
    assert run.chunks > 100 and (run.preemptions > 20) == preempts


def test_hybrid_32_token_blocks_at_retention_64(vllm_api):
    _, run = gated(SchedulerCase("gen:mixed", preset="kimi-hybrid", limit=60, capacity_blocks=400,
                                 cache_overrides=HYBRID_32, max_num_batched_tokens=1024, concurrency=32), vllm_api)
    assert run.preemptions > 10


def test_sliding_window_with_full_attention(vllm_api):
    _, run = gated(SchedulerCase("gen:study-shared-prefix-pinning", limit=150, seed=729, capacity_blocks=400,
                                 cache_overrides=SWA_FA, max_num_batched_tokens=2048, max_num_seqs=4, concurrency=32,
                                 max_output_tokens=1, long_prefill_token_threshold=1000), vllm_api)
    assert run.preemptions > 20 and run.mixed_finishes > 0


def native_sessions(path) -> str:
    """Two tenants (``cache_salt``) over one system prompt; each next turn carries the previous
    prompt and its recorded output (``expected_output``), so hits run through replayed outputs."""
    rng = random.Random(7)
    system = [rng.randrange(50_000) for _ in range(700)]
    prompts = {s: system + [rng.randrange(50_000) for _ in range(rng.randrange(20, 300))] for s in range(6)}
    lines: list[dict] = [{"kvtrace_trace": 1}]
    for turn in range(4):
        for s, prompt in prompts.items():
            out = [rng.randrange(50_000) for _ in range(rng.randrange(5, 60))]
            lines.append(dict(request_id=f"s{s}-t{turn}", arrival_ns=len(lines), session=f"s{s}",
                              input_length=len(prompt), output_length=len(out), token_ids=prompt,
                              expected_output=out, cache_salt=f"tenant-{s % 2}"))
            prompts[s] = prompt + out + [rng.randrange(50_000) for _ in range(rng.randrange(10, 200))]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


@pytest.mark.parametrize("content", [False, True])
def test_salted_sessions_replaying_recorded_outputs(vllm_api, tmp_path, content):
    """Hits through the replayed outputs, none across tenants; in content mode the engine's
    worker writes and checks every block (no divergence)."""
    trace = native_sessions(tmp_path / "sessions.jsonl")
    _, run = gated(SchedulerCase(trace, preset="kimi-hybrid", limit=None, capacity_blocks=16, concurrency=4,
                                 max_output_tokens=64, max_num_batched_tokens=1024, content=content), vllm_api)
    roomy = check(SchedulerCase(trace, limit=None, capacity_blocks=2000, concurrency=4, max_output_tokens=64,
                                content=content), vllm_api)
    assert run.preemptions > 5 and run.stats["preempted_prefix_cache_hits"] > 0
    assert run.divergences == roomy.divergences == 0
    # every later turn hits past its 700-token system prompt: its session's earlier turns
    assert roomy.stats["prefix_cache_hits"] > 18 * 700


def test_content_mode_under_pressure(vllm_api):
    on, run = gated(SchedulerCase("gen:mixed", preset="kimi-hybrid", limit=60, capacity_blocks=60, concurrency=32,
                                  max_num_batched_tokens=2048, content=True), vllm_api)
    assert run.preemptions > 10 and run.divergences == on.divergences == 0


# random cases: a cache (dense, Kimi's FA + Mamba hybrid with its checkpoint block, 32-token
# blocks at retention 64, sliding windows beside full attention, FA + SWA + Mamba) and a
# scheduler (budget, seats, threshold, chunked prefill or not) over a tight pool
RANDOM_CACHES = [
    ("dense-attention", {}),
    ("kimi-hybrid", {}),
    ("kimi-hybrid", HYBRID_32),
    ("dense-attention", SWA_FA),
    ("dense-attention", dict(groups=(FullAttentionSpec(16), SlidingWindowSpec(16, sliding_window=64)),
                             hash_block_size=16)),
    ("dense-attention", dict(groups=(FullAttentionSpec(32), SlidingWindowSpec(32, sliding_window=100), MambaSpec(32)),
                             hash_block_size=16)),
]


def random_case(seed: int, gate: bool) -> SchedulerCase:
    rng = random.Random(seed)
    preset, overrides = rng.choice(RANDOM_CACHES)
    chunked = rng.random() < 0.85
    pool = rng.choice([30, 40, 60, 100]) if preset == "kimi-hybrid" and not overrides else rng.choice(
        [150, 250, 400, 800])
    return SchedulerCase(rng.choice(["gen:mixed", "gen:chat", "gen:agent", "gen:study-shared-prefix-pinning"]),
                         preset=preset, cache_overrides=overrides, capacity_blocks=pool, limit=rng.choice([20, 40]),
                         seed=rng.randrange(1000), concurrency=rng.choice([4, 16, 32]),
                         max_output_tokens=rng.choice([1, 8, 24]),
                         max_num_batched_tokens=rng.choice([128, 256, 512, 1024, 2048]) if chunked else 16_384,
                         max_num_seqs=rng.choice([2, 8, 128]),
                         long_prefill_token_threshold=rng.choice([0, 0, 300]) if chunked else 0,
                         enable_chunked_prefill=chunked, max_model_len=65_536 if chunked else 16_384,
                         reserve_full_isl=gate)


@pytest.mark.parametrize("gate", [True, False])
def test_random_cases_agree_with_the_admission_gate_on_and_off(vllm_api, gate):
    """vLLM 0.33's ``scheduler_reserve_full_isl`` (on by default) and off, in both schedulers:
    every step of every random case agrees (up to a waiting head neither can ever schedule:
    larger than the pool, or, gated, than the pool can hold beside what runs). With the gate
    off kvtrace used to admit where vLLM's gate refused (38 of 150 cases parted)."""
    runs = [run_scheduler_conformance(random_case(seed, gate), vllm_api) for seed in range(80)]
    wrong = [r.report() for r in runs if not r.agree]
    assert not wrong, "\n".join(wrong)
    assert sum(r.finished == r.requests for r in runs) >= 40
    assert sum(r.steps for r in runs) > 5000 and sum(r.chunks for r in runs) > 2000
    if gate:
        assert sum(r.gate_refusals > 0 for r in runs) >= 40
    else:
        assert sum(r.gate_refusals for r in runs) == 0 and sum(r.preemptions for r in runs) > 200
