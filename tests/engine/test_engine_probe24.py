"""Engine mode against an independent computation, and a scheduler setting vLLM refuses.

``_simulate`` below is vLLM v1's schedule written out again from its rules (running requests
first, in order, then waiting ones in arrival order while ``max_num_seqs`` and the step's
token budget allow; a chunk cut at ``long_prefill_token_threshold`` unless one request is
alone; a token sampled by the step that computes a request's last known token; a step
starting when the previous one ends, or at the next arrival when idle) and the README's
cost formula, for unique prompts in an ample pool (no hits, no preemption). The engine's
times, steps and prefilled tokens must be its own, with content and without.

Without chunked prefill, a ``long_prefill_token_threshold`` and a step budget under
``max_model_len`` (a combination vLLM refuses: its budget must cover ``max_model_len`` when
prompts are not chunked) made a prompt over the budget wait idle, alone, until an unrelated
request arrived, and then cut it at the threshold after all: the same trace without that
request was an error, and with it a 100 ms queue and a chunked prompt.
"""

from __future__ import annotations

import random
import re
from collections import deque
from itertools import pairwise

import numpy as np
import pytest

from kvtrace.engine import Engine, get_preset
from kvtrace.engine.clock import COST_MODELS, CostModel
from kvtrace.engine.config import SchedulerConfig
from kvtrace.errors import ConfigError, KVTraceError
from kvtrace.workload import TraceRequest
from tests.cli.support import assert_one_line, run

MS = 1_000_000
KNEED = CostModel("kneed", step_overhead_ns=MS, token_ns=10_000, attn_pair_ps=1_000, kv_read_ps=1_000,
                  decode_seq_ns=100_000, token_knee=50, token_above_knee_ns=3_000)


def _step_ns(c: CostModel, tokens: int, pairs: int, context: int, decodes: int) -> int:
    ns = (c.step_overhead_ns + c.token_ns * tokens + (c.attn_pair_ps * pairs + c.kv_read_ps * context) // 1000
          + c.decode_seq_ns * decodes)
    return ns + (c.token_above_knee_ns * (tokens - c.token_knee) if c.token_knee and tokens > c.token_knee else 0)


def _simulate(reqs, cost: CostModel, budget: int, max_seqs: int, threshold: int):
    """{request id: (first scheduled, token times, prompt tokens prefilled)}, and the steps."""
    pending = deque(reqs)
    state = {rid: {"prompt": p, "max": max(o, 1), "done": 0, "times": [], "first": None, "prefilled": 0}
             for rid, _, p, o in reqs}
    now, steps, waiting, running = 0, 0, deque(), []
    while pending or waiting or running:
        while pending and pending[0][1] <= now:
            waiting.append(pending.popleft()[0])
        if not waiting and not running:
            now = pending[0][1]
            continue
        cut = threshold if len(running) + len(waiting) > 1 else 0
        left, chunks = budget, []
        for rid in running:
            if left <= 0:
                break
            r = state[rid]
            n = min(r["prompt"] + len(r["times"]) - r["done"], cut or budget, left)
            chunks.append((rid, n))
            left -= n
        while waiting and left > 0 and len(running) < max_seqs:
            rid = waiting.popleft()
            n = min(state[rid]["prompt"], cut or budget, left)
            running.append(rid)
            state[rid]["first"] = now
            chunks.append((rid, n))
            left -= n
        tokens = pairs = context = decodes = 0
        for rid, n in chunks:
            r = state[rid]
            start, known = r["done"], r["prompt"] + len(r["times"])
            tokens += n
            if n > 1 or start + n < known:  # a prefill chunk: causal query-key pairs
                pairs += n * start + n * (n + 1) // 2
            else:  # one token, the last known: a decode over its context
                context += start + n
                decodes += 1
        now += _step_ns(cost, tokens, pairs, context, decodes)
        steps += 1
        for rid, n in chunks:
            r = state[rid]
            r["prefilled"] += max(0, min(r["done"] + n, r["prompt"]) - r["done"])
            r["done"] += n
            if r["done"] == r["prompt"] + len(r["times"]):
                r["times"].append(now)
                if len(r["times"]) == r["max"]:
                    running.remove(rid)
    return {rid: (r["first"], r["times"], r["prefilled"]) for rid, r in state.items()}, steps


def _random_case(seed: int):
    rng = random.Random(seed)
    t, first_token, reqs = 0, 0, []
    for i in range(rng.randint(1, 8)):
        t += rng.choice([0, 0, rng.randint(0, 3 * MS), rng.randint(0, 100 * MS)])
        prompt, output = rng.randint(1, 300), rng.choice([0, 1, rng.randint(2, 20)])
        reqs.append((f"r{i}", t, prompt, output, first_token))
        first_token += prompt + 7  # (distinct prompts: nothing hits)
    budget = rng.choice([rng.randint(1, 64), rng.randint(64, 600)])
    return reqs, budget, rng.randint(1, 8), rng.choice([0, 0, rng.randint(1, 200)]), rng.choice(
        [COST_MODELS["h200-dense-8b"], KNEED])


@pytest.mark.parametrize("content", [True, False], ids=["content", "no-content"])
def test_times_steps_and_prefilled_tokens_agree_with_an_independent_schedule(content):
    for seed in range(30):
        reqs, budget, seqs, threshold, cost = _random_case(seed)
        work = [TraceRequest(rid, a, p, o, token_ids=np.arange(s, s + p, dtype=np.int64)) for rid, a, p, o, s in reqs]
        config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs,
                                 long_prefill_token_threshold=threshold)
        result = Engine(get_preset("dense-attention"), scheduler_config=config, cost_model=cost,
                        content=content).run(work)
        expected, steps = _simulate([r[:4] for r in reqs], cost, budget, seqs, threshold)
        assert result.summary["steps"] == steps and result.summary["preemptions"] == 0, seed
        for r in result.requests:
            first, times, prefilled = expected[r.request_id]
            gaps = tuple(b - a for a, b in pairwise(times))
            assert (r.first_scheduled_ns, r.first_token_ns, r.finish_ns, r.itl_ns, r.num_computed_prompt_tokens) == (
                first, times[0], times[-1], gaps, prefilled), (seed, r.request_id)


def _trace(path, late: bool) -> None:
    from kvtrace.workload.native import write_native

    reqs = [TraceRequest("long", 0, 745, 1, token_ids=np.arange(745, dtype=np.int64))]
    if late:  # an unrelated request 100 ms later
        reqs.append(TraceRequest("late", 100 * MS, 10, 1, token_ids=np.arange(1000, 1010, dtype=np.int64)))
    write_native(reqs, path)


NO_CHUNKS = "[scheduler]\nenable_chunked_prefill = false\nmax_num_batched_tokens = 626\nmax_num_seqs = 2\n"


@pytest.mark.parametrize("late", [False, True], ids=["alone", "with-a-later-request"])
def test_a_threshold_without_chunked_prefill_under_max_model_len_is_refused_at_its_key(tmp_path, capsys, late):
    trace, config, db = tmp_path / "t.jsonl", tmp_path / "c.toml", tmp_path / "runs.duckdb"
    _trace(trace, late)
    config.write_text(f'preset = "dense-attention"\n{NO_CHUNKS}long_prefill_token_threshold = 38\n')
    code, _, err = run(["replay", str(trace), "--config", str(config), "--db", str(db), "--json"], capsys)
    assert_one_line(code, err, f"{config}: scheduler.long_prefill_token_threshold: 38 with enable_chunked_prefill "
                    "= false and max_num_batched_tokens 626 below max_model_len 1048576",
                    "vLLM requires max_num_batched_tokens >= max_model_len without chunked prefill")
    assert not db.exists()  # (refused before anything was recorded)


def test_the_same_threshold_is_taken_where_vllm_takes_it():
    with pytest.raises(ConfigError, match=r"^SchedulerConfig: long_prefill_token_threshold: 38 with "):
        get_preset("dense-attention", scheduler={"enable_chunked_prefill": False, "max_num_batched_tokens": 626,
                                                 "long_prefill_token_threshold": 38, "max_num_seqs": 256})
    # a budget that covers max_model_len (vLLM's own rule), or chunked prefill on: both run
    for scheduler in ({"enable_chunked_prefill": False, "max_num_batched_tokens": 1000, "max_model_len": 1000,
                       "max_num_seqs": 256},
                      {"max_num_batched_tokens": 626, "max_num_seqs": 256}):
        preset = get_preset("dense-attention", scheduler={**scheduler, "long_prefill_token_threshold": 38})
        work = [TraceRequest("long", 0, 745, 1, token_ids=np.arange(745, dtype=np.int64))]
        assert Engine(preset, content=False).run(work).summary["requests"] == 1
    # without a threshold a prompt over the budget stays what it was: one line at the engine
    preset = get_preset("dense-attention", scheduler={"enable_chunked_prefill": False, "max_num_batched_tokens": 626,
                                                      "max_num_seqs": 256})
    work = [TraceRequest("long", 0, 745, 1, token_ids=np.arange(745, dtype=np.int64))]
    with pytest.raises(KVTraceError, match="without chunked prefill a prompt must fit one step's max_num_batched"):
        Engine(preset, content=False).run(work)


def test_a_partial_hit_on_a_block_written_in_the_same_step_reads_what_was_written():
    """Full attention hashed finer than its blocks (partial hits, a kvtrace-only layout): b
    resends a's 13-token prompt and is admitted in the step that writes a's last 5 tokens. Its
    12-token hit ends mid-block, so the cache plans a copy of that block, which the worker runs
    before the step's writes (as a GPU runs a step's copies before its forward pass): b's copy
    holds nothing of a's tokens 8-11, its output diverges, and the copy's key is stale. Admitted
    one step later (b arriving after a finished), the same hit is right. Mamba groups have a
    same-step rule for this (a hit ending on a state published in the step waits a step)."""
    from dataclasses import replace

    from kvtrace.cache import FullAttentionSpec

    preset = get_preset("dense-attention", groups=(FullAttentionSpec(8),), hash_block_size=4, capacity_blocks=100,
                        scheduler={"max_num_batched_tokens": 8, "max_num_seqs": 2})
    preset = replace(preset, cache_config=replace(preset.cache_config, enable_partial_hits=True))
    prompt = np.arange(100, 113, dtype=np.int64)
    for b_arrives in (10**9, 1):  # after a finished (right), then while a is prefilling
        work = [TraceRequest("a", 0, 13, 1, token_ids=prompt), TraceRequest("b", b_arrives, 13, 1, token_ids=prompt)]
        result = Engine(preset).run(work)
        hits = {r.request_id: r.num_local_hit_tokens for r in result.requests}
        assert hits == {"a": 0, "b": 12} and result.summary["cow_copies"] == 1
        assert (result.summary["divergent_outputs"], result.summary["stale_hashes"]) == (0, 0), b_arrives


@pytest.mark.parametrize("content", [True, False], ids=["content", "no-content"])
def test_a_waiting_head_nothing_can_run_is_refused_before_the_rest_of_the_workload_is_read(content):
    """Nothing running and a waiting head that cannot start (a prompt over the step's budget
    without chunked prefill, or over the pool): a later arrival only queues behind it, so the run
    can never go on. The engine jumped its clock to each later arrival first, reading and holding
    the whole workload (20,000 requests: 138 MB and twice the time before the same one line), and a
    generated workload without end never ended."""
    pulled = 0

    def workload(head: int):
        nonlocal pulled
        for i in range(10_000):
            pulled += 1
            n = head if i == 0 else 20
            yield TraceRequest(f"r{i}", i * MS, n, 1, token_ids=np.arange(i * 1000, i * 1000 + n, dtype=np.int64))

    no_chunks = get_preset("dense-attention", scheduler={"enable_chunked_prefill": False,
                                                         "max_num_batched_tokens": 512, "max_num_seqs": 256})
    small = get_preset("dense-attention", capacity_blocks=10)
    for preset, head, what in ((no_chunks, 700, "without chunked prefill a prompt must fit one step's"),
                               (small, 200, "it needs more KV blocks than the pool holds (num_gpu_blocks 10)")):
        pulled = 0
        with pytest.raises(KVTraceError, match=rf"^engine: request r0 \({head} prompt tokens\) cannot be scheduled: "
                                               f"{re.escape(what)}"):
            Engine(preset, content=content).run(workload(head))
        assert pulled <= 2  # (the head, and the next request read ahead)


def test_block_counts_are_in_the_unit_groups_blocks_whatever_the_group_order():
    """A Mamba group of 64-token blocks before full attention of 16: the summary said
    block_size 16 (the first full-attention group's, as capacity_blocks) beside hit_blocks and
    total_blocks counted in the first group's 64-token blocks. Both orders now count alike."""
    from kvtrace.cache import FullAttentionSpec, MambaSpec

    prompt = np.arange(100, dtype=np.int64)
    work = [TraceRequest("a", 0, 100, 1, token_ids=prompt), TraceRequest("b", 10**9, 100, 1, token_ids=prompt)]
    summaries = []
    for groups in ((FullAttentionSpec(16), MambaSpec(64)), (MambaSpec(64), FullAttentionSpec(16))):
        preset = get_preset("kimi-hybrid", groups=groups, hash_block_size=16, capacity_blocks=400)
        summaries.append(Engine(preset, content=False).run(work).summary)
    for s in summaries:
        assert s["total_blocks"] == 2 * -(-100 // 16)  # two prompts of 100 tokens in 16-token blocks
        assert s["hit_blocks"] == s["prefix_cache_hits"] // 16 > 0  # (b's hit alone, in 16-token blocks)
    assert summaries[0]["total_blocks"] == summaries[1]["total_blocks"]
    assert summaries[0]["hit_blocks"] == summaries[1]["hit_blocks"] > 0
