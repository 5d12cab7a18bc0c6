"""A self-contained drive of the cache manager over a generated request stream.

This test helper replays a seeded multi-turn workload (shared system
prompts, growing conversations) through a Kimi-like hybrid config (attention + KDA
state in align mode, partial hits, prefill checkpoints, retention 0), once with all
behaviours on and once with each switched off, and prints a summary per run. Requests
run one after another with vLLM's Mamba block-aligned chunk split (stopping at the
shared-prefix junction); there is no device content here (see kvtrace.engine).
"""

from __future__ import annotations

import numpy as np

from kvtrace.cache.config import ALL_BEHAVIOURS, CacheConfig, FullAttentionSpec, MambaSpec
from kvtrace.cache.manager import KVCacheManager
from kvtrace.cache.request import Request

HBS = 16
MAMBA_BS = 64


def demo_config(**changes) -> CacheConfig:
    base = dict(
        groups=(FullAttentionSpec(HBS), MambaSpec(MAMBA_BS)), num_gpu_blocks=(4000, 140), hash_block_size=HBS,
        enable_partial_hits=True, num_prefill_checkpoint_blocks=1, retention_interval=0,
    )
    base.update(changes)
    return CacheConfig(**base)


def generate_stream(seed: int = 0, sessions: int = 40, turns: int = 4) -> list[np.ndarray]:
    """Prompts of multi-turn sessions sharing a few system prompts, interleaved."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, 50_000, size=int(rng.integers(300, 700))) for _ in range(3)]
    convs = [systems[int(rng.integers(0, 3))] for _ in range(sessions)]
    out = []
    for _turn in range(turns):
        for s in range(sessions):
            convs[s] = np.concatenate([convs[s], rng.integers(0, 50_000, size=int(rng.integers(40, 400)))])
            out.append(convs[s].copy())
    return out


def chunk_end(start: int, num_tokens: int, boundary: int, budget: int = 512) -> int:
    """vLLM's Mamba block-aligned split over a token budget."""
    end = min(num_tokens, start + budget)
    if end < num_tokens:
        end = max(end // MAMBA_BS * MAMBA_BS, start + 1)
    stops = [num_tokens // MAMBA_BS * MAMBA_BS, (num_tokens // HBS) * HBS, boundary]
    if start % MAMBA_BS:
        stops.append((start // MAMBA_BS + 1) * MAMBA_BS)
    inside = [s for s in stops if start < s < end]
    return min(inside) if inside else end


def run(config: CacheConfig, prompts: list[np.ndarray]) -> dict:
    m = KVCacheManager(config)
    num_events = [0]
    m.subscribe(lambda batch: num_events.__setitem__(0, num_events[0] + len(batch)))
    for i, prompt in enumerate(prompts):
        req = Request(f"r{i}", prompt)
        blocks, hit, boundary = m.get_computed_blocks(req)
        req.shared_prefix_boundary = boundary
        start, first = hit, True
        while start < req.num_tokens:
            end = chunk_end(start, req.num_tokens, boundary)
            kw = dict(num_new_computed_tokens=hit, new_computed_blocks=blocks) if first else {}
            if first:
                req.num_computed_tokens = 0
            if m.allocate_slots(req, end - start, **kw) is None:
                raise RuntimeError("demo pool too small")
            m.take_block_copies()
            m.take_state_writes()
            req.num_computed_tokens = end
            start, first = end, False
            m.new_step_starts()
        m.free(req)
        m.new_step_starts()
    out = m.stats.as_dict()
    out["token_hit_rate"] = round(m.stats.token_hit_rate, 4)
    out["events"] = num_events[0]
    return out


def main() -> None:
    prompts = generate_stream()
    runs = [("all behaviours on", demo_config())]
    for name in sorted(ALL_BEHAVIOURS):
        runs.append((f"without {name}", demo_config().without(name)))
    print(f"{len(prompts)} requests, {sum(len(p) for p in prompts)} prompt tokens "
          f"(attention {HBS}-token blocks + KDA state {MAMBA_BS}-token blocks, retention 0)")
    print(f"{'run':46s} {'hit rate':>8s} {'publishes':>9s} {'lru evict':>9s} {'stale evict':>11s} {'copies':>6s}")
    for label, cfg in runs:
        s = run(cfg, prompts)
        ev = s["evictions"]
        print(f"{label:46s} {s['token_hit_rate']:8.1%} {s['publishes']:9d} {ev.get('lru', 0):9d} "
              f"{ev.get('stale_hash', 0):11d} {s['copies']:6d}")


if __name__ == "__main__":
    main()
