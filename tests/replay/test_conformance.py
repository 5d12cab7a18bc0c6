"""kvtrace's cache manager against vLLM 0.33's own, request by request (``kvtrace conformance``).

Every configuration issue 12 names, on the shared Mooncake synthetic trace and on a
generated hybrid workload with shared prefixes (``gen:mixed``: chat sessions over shared
system prompts and growing agent contexts), must agree on every compared field; with a
behaviour switched off the disagreement must be named after that switch.
"""

from __future__ import annotations

import pytest

from kvtrace.cache import (
    EXTERNAL_HIT_RUNNING_COW,
    SHARED_PREFIX_PINNING,
    TRANSIENT_CHECKPOINT_RETENTION,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from kvtrace.replay.conformance import FIELDS, ConformanceSpec, format_report, run_conformance
from tests.conftest import MOONCAKE

TRACE = str(MOONCAKE)
# FA + Mamba in 32-token blocks hashed per 16 tokens: retention 64 is two blocks (vLLM
# needs a multiple of the scheduler block), with fine-grained hits and FlashKDA checkpoints
HYBRID_32 = dict(groups=(FullAttentionSpec(32), MambaSpec(32)), hash_block_size=16)
SWA_FA = dict(groups=(FullAttentionSpec(512), SlidingWindowSpec(512, sliding_window=1024)), hash_block_size=512,
              retention_interval=0)


def check(spec: ConformanceSpec, api) -> list:
    result = run_conformance(spec, api=api)
    report = "\n".join(format_report(result))
    assert result.agree, report
    for run in result.runs:
        assert run.disagreements == 0 and run.stopped is None, report
        assert all(run.compared[f] == run.agreed[f] for f in FIELDS), report
        assert run.compared["allocation"] > 0 and run.compared["events"] == run.steps
    return result.runs


def test_full_attention_at_three_capacities_one_under_heavy_eviction(vllm_api, tmp_path):
    runs = check(ConformanceSpec(TRACE, preset="dense-attention", block_size=512, capacity_blocks=(120, 1500, 20000),
                                 limit=160), vllm_api)
    heavy, medium, roomy = runs
    # pressure: vLLM's admission gate (its default) keeps requests waiting rather than preempt
    assert heavy.refusals > 0 and heavy.evictions > 2000
    assert medium.evictions > 0 and roomy.evictions == 0
    assert all(r.compared["hit_tokens"] >= 160 for r in runs)
    ungated = tmp_path / "ungated.toml"  # (without the gate, the same pool preempts)
    ungated.write_text("[scheduler]\nscheduler_reserve_full_isl = false\n")
    (heavy,) = check(ConformanceSpec(TRACE, preset="dense-attention", block_size=512, capacity_blocks=(120,),
                                     limit=160, config_file=str(ungated)), vllm_api)
    assert heavy.preemptions > 0 and heavy.evictions > 2000


@pytest.mark.parametrize("trace, limit, capacities", [(TRACE, 120, (1500,)), ("gen:mixed", 60, (120, 2000))])
def test_sliding_window_with_full_attention(vllm_api, trace, limit, capacities):
    check(ConformanceSpec(trace, preset="dense-attention", cache_overrides=SWA_FA, capacity_blocks=capacities,
                          limit=limit), vllm_api)


def test_a_one_token_sliding_window(vllm_api):
    """A window of 1 (no earlier block needed): kvtrace hit whole lookups with no block cached,
    vLLM ends a hit at the rightmost cached block (they parted at step 1)."""
    check(ConformanceSpec("gen:mixed", preset="dense-attention", capacity_blocks=(400,), limit=40, cache_overrides=dict(
        groups=(FullAttentionSpec(16), SlidingWindowSpec(16, sliding_window=1)), hash_block_size=16,
        enable_partial_hits=False, num_prefill_checkpoint_blocks=0)), vllm_api)


@pytest.mark.parametrize("retention", ["none", "0"])
@pytest.mark.parametrize("trace, limit, capacities", [(TRACE, 120, (400, 10_240)), ("gen:mixed", None, (100, 2000))])
def test_hybrid_mamba_align_partial_hits_and_checkpoint(vllm_api, retention, trace, limit, capacities):
    """kimi-hybrid: FA(512) + Mamba(512, align), hash 64, one FlashKDA checkpoint block."""
    runs = check(ConformanceSpec(trace, preset="kimi-hybrid", retention=retention, capacity_blocks=capacities,
                                 limit=limit), vllm_api)
    if trace == "gen:mixed":  # shared prefixes: partial hits with copy-on-write, same-step refusals
        assert all(r.copies > 0 and r.refusals > 0 for r in runs)


@pytest.mark.parametrize("trace, limit", [(TRACE, 80), ("gen:mixed", None)])
def test_hybrid_at_retention_64(vllm_api, trace, limit):
    check(ConformanceSpec(trace, preset="kimi-hybrid", cache_overrides=dict(HYBRID_32, retention_interval=64),
                          capacity_blocks=(250, 3000), limit=limit), vllm_api)


@pytest.mark.parametrize("overrides, capacities", [
    ({}, (100, 2000)),
    (dict(HYBRID_32, retention_interval=64), (250,)),
    (dict(HYBRID_32, retention_interval=0), (250,)),
])
def test_hybrid_with_a_speculative_block(vllm_api, overrides, capacities):
    """num_speculative_blocks = 1 (MTP/EAGLE state blocks), the case 003 asks about."""
    check(ConformanceSpec("gen:mixed", preset="kimi-hybrid", cache_overrides={**overrides, "num_speculative_blocks": 1},
                          capacity_blocks=capacities), vllm_api)


def test_external_hits_through_a_connector(vllm_api):
    """kvtrace's external tier as the connector: both managers load the same tokens."""
    runs = check(ConformanceSpec("gen:study-external-hit-running-cow", preset="kimi-hybrid",
                                 capacity_blocks=(20, 30, 60), external_capacity_blocks=4096), vllm_api)
    assert all(r.copies > 0 for r in runs)


@pytest.mark.parametrize("trace, capacity, vllm_raises", [("gen:mixed", 40, True), ("gen:mixed", 60, True),
                                                           ("gen:agent", 20, False)])
def test_vllms_external_load_leaves_its_mamba_blocks_out_of_the_free_block_check(vllm_api, trace, capacity,
                                                                                vllm_raises):
    """The README's claim: vLLM 0.33 allocates a connector load's Mamba blocks without counting
    them in allocate_slots' free-block check, so on a pool too small for the load it raises
    (or allocates where kvtrace, which counts them, refuses); the run stops there, naming it."""
    (run,) = run_conformance(ConformanceSpec(trace, preset="kimi-hybrid", capacity_blocks=(capacity,),
                                             external_capacity_blocks=4096), api=vllm_api).runs
    first = run.first
    assert first is not None and first.field == "allocation" and run.stopped is not None
    assert first.kvtrace is None
    if vllm_raises:
        assert str(first.vllm).startswith("vLLM raised ValueError: Cannot get ") and "free blocks" in str(first.vllm)
    else:
        assert isinstance(first.vllm, tuple) and all(first.vllm)  # block ids in every group


def test_from_100_blocks_the_external_load_agrees_on_gen_mixed(vllm_api):
    (run,) = check(ConformanceSpec("gen:mixed", preset="kimi-hybrid", capacity_blocks=(100,),
                                   external_capacity_blocks=4096), vllm_api)
    assert run.requests == 150 and run.copies > 0 and run.evictions > 0


@pytest.mark.parametrize("behaviour, trace, kw", [
    (SHARED_PREFIX_PINNING, "gen:study-shared-prefix-pinning", dict(limit=30)),
    (TRANSIENT_CHECKPOINT_RETENTION, "gen:mixed", dict(limit=40)),
    (EXTERNAL_HIT_RUNNING_COW, "gen:study-external-hit-running-cow",
     dict(capacity_blocks=(25,), external_capacity_blocks=4096)),
])
def test_a_switched_off_behaviour_explains_the_disagreement(vllm_api, behaviour, trace, kw):
    """With every behaviour on kvtrace agrees with vLLM 0.33 (which has all three fixes);
    with one off it disagrees, and the report names that switch."""
    result = run_conformance(ConformanceSpec(trace, preset="kimi-hybrid", without=(behaviour,), **kw), api=vllm_api)
    report = "\n".join(format_report(result))
    (run,) = result.runs
    assert not result.agree and run.first is not None, report
    assert [e["behaviour"] for e in run.explained_by] == [behaviour], report
    assert run.explained_by[0]["step"] <= run.first.step
    assert f"explained by switch {behaviour}" in report
    on = run_conformance(ConformanceSpec(trace, preset="kimi-hybrid", **kw), api=vllm_api)
    assert on.agree, "\n".join(format_report(on))


def test_the_trace_block_size_is_the_replays(tmp_path):
    """--trace-block-size was dropped: the trace was read at 512 tokens per hash id and the
    run agreed; a generated workload's was ignored. Both refused as replay refuses them
    (before vLLM loads)."""
    from kvtrace.errors import ConfigError, TraceFormatError

    with pytest.raises(TraceFormatError, match=r"hash_ids: expected ceil\(input_length 40160 / block_size 3\)"):
        run_conformance(ConformanceSpec(TRACE, trace_block_size=3, limit=2))
    with pytest.raises(ConfigError, match=r"^--trace-block-size: 3: gen:mixed is a generated workload"):
        run_conformance(ConformanceSpec("gen:mixed", trace_block_size=3, limit=2))


@pytest.mark.parametrize("scheduler, message", [
    # vLLM's manager raised IndexError (a traceback) past max_model_len
    ("max_model_len = 100", r"^request agent0-s0: 2,741 prompt \+ 4 output tokens exceed max_model_len 100 "),
    # the driver chunked the prompt anyway (and agreed): kvtrace's engine refuses it
    ("enable_chunked_prefill = false\nmax_num_batched_tokens = 1000\nmax_num_seqs = 256",
     r"^request agent0-s0 \(2,741 tokens\) cannot be scheduled: without chunked prefill"),
])
def test_the_schedulers_limits_are_kept(vllm_api, tmp_path, scheduler, message):
    from kvtrace.errors import KVTraceError

    cfg = tmp_path / "s.toml"
    cfg.write_text(f"[scheduler]\n{scheduler}\n")
    with pytest.raises(KVTraceError, match=message):
        run_conformance(ConformanceSpec("gen:mixed", config_file=str(cfg), limit=5), api=vllm_api)


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget(vllm_api, tmp_path):
    allocations = []
    for chunked in ("true", "false"):
        cfg = tmp_path / f"{chunked}.toml"
        cfg.write_text(f"[scheduler]\nenable_chunked_prefill = {chunked}\nmax_num_batched_tokens = 4096\n")
        (run,) = check(ConformanceSpec("gen:mixed", preset="dense-attention", config_file=str(cfg),
                                       capacity_blocks=(8000,), limit=30), vllm_api)
        assert run.requests == 30
        allocations.append(run.compared["allocation"])
    assert allocations[1] < allocations[0]  # no prompt split over two steps (the same when the flag was ignored)


def test_a_lone_request_is_not_cut_by_the_long_prefill_threshold(vllm_api, tmp_path):
    """vLLM's scheduler cuts a long prefill only where another request is in the system; the
    driver cut a lone one too, a call sequence vLLM's scheduler never makes (both managers
    agreed on it all the same)."""
    cfg = tmp_path / "t.toml"
    cfg.write_text("[scheduler]\nlong_prefill_token_threshold = 512\n")
    (run,) = check(ConformanceSpec("gen:mixed", preset="dense-attention", config_file=str(cfg), capacity_blocks=(8000,),
                                   limit=1, concurrency=1, max_output_tokens=2), vllm_api)
    assert run.requests == 1 and run.steps == 2  # the whole prompt in one step, then the second token


def test_a_cache_salt_keys_both_managers_requests(vllm_api, tmp_path, monkeypatch):
    """The trace's cache_salt was dropped: requests of other tenants hit each other's blocks
    (as no replay of the same trace, on either backend, does)."""
    import json

    from kvtrace.replay import conformance

    tokens = list(range(100, 1200))
    rows = [{"kvtrace_trace": 1}] + [
        {"request_id": f"r{i}", "arrival_ns": i, "input_length": len(tokens), "output_length": 2,
         "token_ids": tokens, **({"cache_salt": salt} if salt else {})}
        for i, salt in enumerate(["a", "b", "a", None])]
    trace = tmp_path / "salted.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    hits: dict[str, tuple] = {}
    compare = conformance._Driver.compare

    def recording(self, name, request_id, theirs, ours, hard=False):
        if name == "hit_tokens":
            hits[request_id] = (theirs, ours)
        return compare(self, name, request_id, theirs, ours, hard)

    monkeypatch.setattr(conformance._Driver, "compare", recording)
    check(ConformanceSpec(str(trace), preset="dense-attention"), vllm_api)
    assert hits == {"r0": (0, 0), "r1": (0, 0), "r2": (1088, 1088), "r3": (0, 0)}
