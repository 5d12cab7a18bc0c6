"""Small hand-built workloads for the engine tests (deterministic, seeded)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtrace.cache import CacheConfig, ExternalTierConfig, FullAttentionSpec, MambaSpec
from kvtrace.engine import SchedulerConfig
from kvtrace.engine.clock import get_cost_model
from kvtrace.engine.presets import EnginePreset
from kvtrace.workload import TraceRequest

MS = 1_000_000


def tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 100_000, n).astype(np.int64)


def preset(cache: CacheConfig, batch: int = 8192, seqs: int = 64) -> EnginePreset:
    return EnginePreset("test", cache, SchedulerConfig(max_num_batched_tokens=batch, max_num_seqs=seqs),
                        get_cost_model("h200-kimi-hybrid"))


def hybrid_cache(**kw) -> CacheConfig:
    base: dict[str, Any] = dict(
        groups=(FullAttentionSpec(16), MambaSpec(16)), num_gpu_blocks=560, hash_block_size=16,
        retention_interval=0, enable_partial_hits=True, num_prefill_checkpoint_blocks=1,
    )
    base.update(kw)
    return CacheConfig(**base)


def system_prompt_chat(n: int = 12, sys_len: int = 200, seed: int = 0, gap_ms: int = 50) -> list[TraceRequest]:
    """Requests sharing one system prompt, each with its own question."""
    rng = np.random.default_rng(seed)
    sysp = tokens(rng, sys_len)
    out = []
    for i in range(n):
        t = np.concatenate([sysp, tokens(rng, int(rng.integers(20, 60)))])
        out.append(TraceRequest(f"hot{i}", i * gap_ms * MS, len(t), 4, token_ids=t))
    return out


def hot_prefix_with_long_cold_prompts(rounds: int = 8, cold_per_round: int = 2, seed: int = 1) -> list[TraceRequest]:
    """A hot system prompt reused every round, with long unrelated prompts in between."""
    rng = np.random.default_rng(seed)
    sysp = tokens(rng, 160)
    out, t = [], 0
    for r in range(rounds):
        q = np.concatenate([sysp, tokens(rng, 24)])
        out.append(TraceRequest(f"hot{r}", t, len(q), 2, token_ids=q))
        t += 40 * MS
        for c in range(cold_per_round):
            q = tokens(rng, 400)
            out.append(TraceRequest(f"cold{r}.{c}", t, len(q), 2, token_ids=q))
            t += 40 * MS
    return out


def external_continuation(seed: int = 2) -> tuple[list[TraceRequest], CacheConfig]:
    """Seed 003's geometry: external state at 10 -> partial tail at 14 -> 15 (hash 2, Mamba 8).

    A producer publishes a 10-token prefix (its partial tail) to the write-through
    external tier; fillers push it out of the GPU; the consumer's 15-token prompt then
    loads 10 tokens from the external tier, prefills to its partial tail at 14 and
    continues to 15 and beyond; siblings with the same prompt hit that tail.
    """
    rng = np.random.default_rng(seed)
    common = tokens(rng, 10)
    out = []
    producer = np.concatenate([common, tokens(rng, 1)])
    out.append(TraceRequest("producer", 0, 11, 1, token_ids=producer))
    for i in range(8):
        f = tokens(rng, 40)
        out.append(TraceRequest(f"filler{i}", (10 + 5 * i) * MS, 40, 1, token_ids=f))
    consumer = np.concatenate([common, tokens(rng, 5)])
    out.append(TraceRequest("consumer", 100 * MS, 15, 24, token_ids=consumer))
    for i in range(3):
        out.append(TraceRequest(f"sibling{i}", (160 + 40 * i) * MS, 15, 6, token_ids=consumer.copy()))
    cache = CacheConfig(
        groups=(FullAttentionSpec(2), MambaSpec(8)), num_gpu_blocks=54, hash_block_size=2,
        retention_interval=None, enable_partial_hits=True, external=ExternalTierConfig(1000),
    )
    return out, cache


def mixed_sessions(n_sessions: int = 6, turns: int = 4, seed: int = 3) -> list[TraceRequest]:
    """Multi-turn sessions over two system prompts: each turn extends the previous prompt.

    Arrivals overlap, prompts end at arbitrary (non-block) lengths, so partial hits,
    copy-on-write, checkpoints and preemption under a tight pool all happen.
    """
    rng = np.random.default_rng(seed)
    systems = [tokens(rng, 150), tokens(rng, 90)]
    reqs = []
    for s in range(n_sessions):
        ctx = systems[s % 2]
        t = int(rng.integers(0, 30)) * MS
        for k in range(turns):
            ctx = np.concatenate([ctx, tokens(rng, int(rng.integers(10, 120)))])
            reqs.append(TraceRequest(f"s{s}.t{k}", t, len(ctx), int(rng.integers(2, 12)), token_ids=ctx.copy(),
                                     session_id=f"s{s}"))
            t += int(rng.integers(5, 60)) * MS
    reqs.sort(key=lambda r: (r.arrival_ns, r.request_id))
    return reqs
