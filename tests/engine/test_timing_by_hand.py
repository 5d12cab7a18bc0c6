"""The engine's modelled times on tiny traces, against times worked out by hand from the cost model.

A step costs ``step_overhead_ns + token_ns * T + attn_pair_ps / 1000 * pairs + kv_read_ps / 1000 *
context + decode_seq_ns * decodes`` (``kvtrace.engine.clock``); a token's time is the end of the
step that sampled it, a step starts when the previous one ends or, idle, at the next arrival.
Each expected number below is that arithmetic, written out; TTFT, ITL, E2EL and queueing are
then ``vllm bench serve``'s definitions of those times (``kvtrace.metrics``).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvtrace.engine import Engine, get_preset
from kvtrace.engine.clock import CostModel
from kvtrace.workload import TraceRequest

MS = 1_000_000
# 1 ms a step, 10 us a token: nothing else, unless a test says so
FLAT = CostModel("flat", step_overhead_ns=MS, token_ns=10_000, attn_pair_ps=0, kv_read_ps=0, decode_seq_ns=0)
# every term of a dense model, at values whose products are easy to add up
FULL = CostModel("full", step_overhead_ns=MS, token_ns=10_000, attn_pair_ps=1_000, kv_read_ps=1_000,
                 decode_seq_ns=100_000)


def _request(rid: str, arrival_ns: int, prompt: int, output: int, first_token: int) -> TraceRequest:
    """A prompt of ``prompt`` distinct tokens from ``first_token`` on (two requests share a
    prefix only where their ranges do)."""
    return TraceRequest(rid, arrival_ns, prompt, output,
                        token_ids=np.arange(first_token, first_token + prompt, dtype=np.int64))


def _run(requests, cost, *, content, capacity_blocks=None, **scheduler):
    preset = get_preset("dense-attention", capacity_blocks=capacity_blocks, scheduler=scheduler or None)
    result = Engine(preset, cost_model=cost, content=content).run(requests)
    return result, {r.request_id: r for r in result.requests}


@pytest.fixture(params=[True, False], ids=["content", "no-content"])
def content(request):
    return request.param


def test_idle_gaps_mid_step_arrivals_and_a_zero_output_request(content):
    result, r = _run([_request("a", 0, 100, 3, 1000), _request("b", 50 * MS, 20, 1, 2000),
                      _request("c", 50 * MS, 30, 0, 3000), _request("d", 50_500_000, 16, 2, 4000)],
                     FLAT, content=content)
    # a alone: its prompt (1 + 100 x 0.01 = 2 ms), then two decodes of 1.01 ms
    assert (r["a"].first_token_ns, r["a"].itl_ns, r["a"].finish_ns) == (2 * MS, (1_010_000,) * 2, 4_020_000)
    # idle from 4.02 ms: the clock jumps to 50 ms (no ticking); b and c share a 50-token step of 1.5 ms;
    # c asks for no output and gets one token, as vLLM's max_tokens >= 1
    for rid in "bc":
        assert (r[rid].first_scheduled_ns, r[rid].first_token_ns, r[rid].finish_ns) == (50 * MS, 51_500_000,
                                                                                          51_500_000)
    assert r["c"].num_output_tokens == 1
    # d arrives mid-step (50.5 ms): it waits for the boundary at 51.5 ms, then 1.16 ms, then a 1.01 ms decode
    assert (r["d"].first_scheduled_ns, r["d"].first_token_ns, r["d"].itl_ns) == (51_500_000, 52_660_000,
                                                                                 (1_010_000,))
    s = result.summary
    assert s["mean_ttft_ms"] == pytest.approx((2.0 + 1.5 + 1.5 + 2.16) / 4)
    assert s["mean_queue_ms"] == pytest.approx(1.0 / 4)
    assert s["mean_e2el_ms"] == pytest.approx((4.02 + 1.5 + 1.5 + 3.17) / 4)
    assert s["output_tokens"] == 7 and s["virtual_duration_s"] == pytest.approx(0.05367)


def test_a_chunked_prefill_and_the_request_that_shares_its_step(content):
    _, r = _run([_request("a", 0, 100, 3, 1000), _request("b", 0, 10, 2, 5000)], FULL, content=content,
                max_num_batched_tokens=64, max_num_seqs=4)
    # step 1: a's first 64 tokens, 64 * 65 / 2 = 2,080 pairs: 1 + 0.64 ms + 2,080 ns
    step1 = MS + 640_000 + 2_080
    # step 2: a's last 36 (36 * 64 + 36 * 37 / 2 = 2,970 pairs) and b's 10 (55 pairs): 46 tokens
    step2 = MS + 460_000 + 2_970 + 55
    # step 3: both decode, contexts 101 and 11; step 4: a alone, context 102
    step3 = MS + 20_000 + 112 + 2 * 100_000
    step4 = MS + 10_000 + 102 + 100_000
    assert (r["a"].first_scheduled_ns, r["b"].first_scheduled_ns) == (0, step1)
    assert r["a"].first_token_ns == r["b"].first_token_ns == step1 + step2
    assert r["a"].itl_ns == (step3, step4) and r["b"].itl_ns == (step3,)
    assert r["a"].prefill_chunks == ((0, step1, 64), (step1, step1 + step2, 36))


def test_a_request_preempted_after_its_first_token_shows_the_stall_in_its_next_gap(content):
    """vllm bench serve sees the tokens a preempted request streamed, then a long gap, then the
    rest: the gap runs from its last token to the end of the step that recomputed it."""
    result, r = _run([_request("a", 0, 16, 20, 1000), _request("b", 0, 16, 20, 5000)], FLAT, content=content,
                     capacity_blocks=4, max_num_batched_tokens=64, max_num_seqs=4)
    # 3 usable blocks of 16: both prompts (1 block each) in one 32-token step of 1.32 ms; the
    # first decode needs a second block each: a gets the last one, b (admitted last) is preempted
    assert r["a"].first_token_ns == r["b"].first_token_ns == 1_320_000
    assert r["a"].itl_ns == (1_010_000,) * 19 and r["a"].finish_ns == 1_320_000 + 19 * 1_010_000
    # b waits (its 17 tokens need 2 blocks, 1 is free) until a finishes at 20.51 ms, then
    # recomputes prompt + its one output, 17 tokens (1.17 ms), and samples its second token
    resumed = r["a"].finish_ns + MS + 17 * 10_000
    assert r["b"].num_preemptions == 1 and r["b"].first_scheduled_ns == 0
    assert r["b"].itl_ns == (resumed - 1_320_000,) + (1_010_000,) * 18
    assert result.summary["preemptions"] == 1 and result.summary["preempted_prefix_cache_queries"] == 17


def test_a_request_preempted_before_its_first_token_counts_the_stall_in_its_ttft(content):
    _, r = _run([_request("a", 0, 16, 60, 1000), _request("b", 0, 48, 2, 5000)], FLAT, content=content,
                capacity_blocks=6, max_num_batched_tokens=2, max_num_seqs=2)
    # a budget of 2 tokens: a's prompt takes 8 steps of 1.02 ms; then a decodes beside b's prefill,
    # a token each a step (1.02 ms), until a needs a 4th block and b, 32 tokens in, is preempted
    assert r["a"].first_token_ns == 8 * 1_020_000
    assert set(r["a"].itl_ns) == {1_010_000, 1_020_000}
    # b starts over after a's last token: 48 tokens at 2 a step, 24 steps of 1.02 ms
    assert r["b"].num_preemptions == 1 and r["b"].first_scheduled_ns == 8 * 1_020_000
    assert r["b"].first_token_ns == r["a"].finish_ns + 24 * 1_020_000
    assert r["b"].itl_ns == (1_010_000,)


def test_a_cached_prefix_is_not_computed_again_but_the_last_token_is(content):
    _, r = _run([_request("a", 0, 100, 1, 1000), _request("a2", 10 * MS, 100, 1, 1000)], FULL, content=content)
    # 6 full blocks (96 tokens) hit; 4 tokens after 96: 4 * 96 + 10 = 394 pairs
    assert r["a2"].num_local_hit_tokens == 96
    assert r["a2"].first_token_ns - 10 * MS == MS + 40_000 + 394
    _, r = _run([_request("a", 0, 96, 1, 1000), _request("a2", 10 * MS, 96, 1, 1000)], FULL, content=content)
    # a prompt cached whole: vLLM hits at most num_tokens - 1 = 95, 5 blocks; 16 tokens after 80
    assert r["a2"].num_local_hit_tokens == 80
    assert r["a2"].first_token_ns - 10 * MS == MS + 160_000 + 16 * 80 + 16 * 17 // 2


def test_max_num_seqs_holds_the_second_request_until_the_first_finishes(content):
    _, r = _run([_request("a", 0, 10, 2, 1000), _request("b", 0, 10, 2, 2000)], FULL, content=content,
                max_num_seqs=1, max_num_batched_tokens=64)
    prefill, decode = MS + 100_000 + 55, MS + 10_000 + 11 + 100_000
    assert (r["a"].first_token_ns, r["a"].finish_ns) == (prefill, prefill + decode)
    assert r["b"].first_scheduled_ns == prefill + decode
    assert (r["b"].first_token_ns, r["b"].finish_ns) == (2 * prefill + decode, 2 * (prefill + decode))


@pytest.mark.parametrize("preset_name", ["dense-attention", "kimi-hybrid"])
def test_a_load_from_the_external_tier_costs_its_tokens_and_states(content, preset_name):
    """An external hit was free: a 1,280-token load from the tier cost the step nothing.
    Now the step that admits the request pays kv_load_ns a token loaded and state_load_ns a
    state group's recurrent state (kvtrace.engine.clock)."""
    from dataclasses import replace

    # a fills the pool; c (another prompt) pushes a's blocks out to the tier; b resends a's prompt
    reqs = [_request("a", 0, 2048, 1, 1000), _request("c", 100 * MS, 2048, 1, 50_000),
            _request("b", 200 * MS, 2048, 1, 1000)]
    # a pool that holds one request at a time (dense: 16-token blocks; the hybrid: 512, its
    # states taking blocks of the pool too), a tier that holds both
    capacity = {"dense-attention": 129, "kimi-hybrid": 10}[preset_name]
    preset = get_preset(preset_name, capacity_blocks=capacity, external_capacity_blocks=256)
    loading = replace(FLAT, name="loading", kv_load_ns=1_000, state_load_ns=70_000)
    runs = {}
    for cost in (FLAT, loading):
        result = Engine(preset, cost_model=cost, content=content).run(reqs)
        runs[cost.name] = {r.request_id: r for r in result.requests}
    free, paid = runs["flat"], runs["loading"]
    loaded = paid["b"].num_external_hit_tokens
    assert loaded >= 1024 and paid["b"].num_local_hit_tokens == 0  # (b's prefix came from the tier)
    states = sum(g.__class__.__name__ == "MambaSpec" for g in preset.cache_config.groups)
    assert states == (1 if preset_name == "kimi-hybrid" else 0)
    for rid in "ac":  # (no load before b: the same times)
        assert paid[rid].first_token_ns == free[rid].first_token_ns
    assert paid["b"].first_token_ns - free["b"].first_token_ns == 1_000 * loaded + 70_000 * states
