"""Named engine presets: a CacheConfig, a SchedulerConfig and a cost model.

| preset | groups | hash block | retention | partial hits | checkpoints | blocks per group | batch tokens / seqs | cost model |
|---|---|---|---|---|---|---|---|---|
| dense-attention | FullAttention(16) | 16 | None (dense) | off | 0 | 53_760 (~860k tokens) | 8192 / 256 | h200-dense-8b |
| kimi-hybrid | FullAttention(512) + Mamba/KDA(512, align, 4 lanes) | 64 | 0 (latest-only) | on | 1 | 8_192 attention (~4.2M tokens), 2_048 states | 8192 / 256 | h200-kimi-hybrid |
| dense-70b-tp4 | FullAttention(16) | 16 | None (dense) | off | 0 | 70_000 (~1.1M tokens) | 8192 / 256 | h200-dense-70b-tp4 |
| dense-70b-tp8 | FullAttention(16) | 16 | None (dense) | off | 0 | 168_000 (~2.7M tokens) | 8192 / 256 | h200-dense-70b-tp8 |

Capacity is overridable (``capacity_blocks`` per group or for all; ``capacity_tokens``
for the attention groups), as are retention and the behaviours.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import gcd

from kvtrace.cache import ALL_BEHAVIOURS, CacheConfig, ExternalTierConfig, FullAttentionSpec, MambaSpec
from kvtrace.engine.clock import CostModel, get_cost_model
from kvtrace.engine.config import SchedulerConfig
from kvtrace.errors import ConfigError
from kvtrace.numeric import cdiv

KEEP = object()  # "leave this setting as the preset has it"


@dataclass(frozen=True)
class EnginePreset:
    name: str
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    cost_model: CostModel


def _dense_attention() -> EnginePreset:
    return EnginePreset(
        "dense-attention",
        CacheConfig(groups=(FullAttentionSpec(16),), num_gpu_blocks=53_760, hash_block_size=16, retention_interval=None),
        SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=256),
        get_cost_model("h200-dense-8b"),
    )


def _kimi_hybrid() -> EnginePreset:
    return EnginePreset(
        "kimi-hybrid",
        CacheConfig(
            groups=(FullAttentionSpec(512), MambaSpec(512, num_lanes=4)),
            num_gpu_blocks=(8_192, 2_048),
            hash_block_size=64,
            retention_interval=0,
            enable_partial_hits=True,
            num_prefill_checkpoint_blocks=1,
        ),
        SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=256),
        get_cost_model("h200-kimi-hybrid"),
    )


def _dense_70b(tp: int, num_gpu_blocks: int) -> EnginePreset:
    # KV per token: 80 layers x 8 KV heads x 128 x 2 (K, V) x 2 B = 320 KiB, split over the TP
    # ranks; per H200 ~127 GB usable minus 140 GB / tp of weights holds num_gpu_blocks x 16 tokens.
    return EnginePreset(
        f"dense-70b-tp{tp}",
        CacheConfig(groups=(FullAttentionSpec(16),), num_gpu_blocks=num_gpu_blocks, hash_block_size=16),
        SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=256),
        get_cost_model(f"h200-dense-70b-tp{tp}"),
    )


PRESETS = {
    "dense-attention": _dense_attention,
    "dense-70b-tp4": lambda: _dense_70b(4, 70_000),
    "dense-70b-tp8": lambda: _dense_70b(8, 168_000),
    "kimi-hybrid": _kimi_hybrid,
}


def get_preset(
    name: str,
    *,
    capacity_blocks: int | tuple[int, ...] | None = None,
    capacity_tokens: int | None = None,
    retention_interval=KEEP,
    without: tuple[str, ...] = (),
    external_capacity_blocks: int | None = None,
    block_size: int | None = None,
    hash_block_size: int | None = None,
    scheduler: dict | None = None,
) -> EnginePreset:
    """A named preset with overrides.

    ``capacity_blocks``: blocks per group (an int for all, or one per group);
    ``capacity_tokens``: attention groups sized to hold this many tokens;
    ``retention_interval``: None | 0 | k; ``without``: behaviour names to switch off;
    ``external_capacity_blocks``: add an external tier; ``block_size``: every group's block
    size (the hash block size shrinks to divide it); ``scheduler``: SchedulerConfig fields.
    """
    try:
        preset = PRESETS[name]()
    except KeyError:
        raise ConfigError("preset", name, f"unknown; known: {sorted(PRESETS)}") from None
    cc = preset.cache_config
    changes: dict = {}
    groups = cc.groups
    if block_size is not None or hash_block_size is not None:
        if block_size is not None:
            groups = tuple(replace(g, block_size=block_size) for g in cc.groups)
        hbs = hash_block_size or cc.hash_block_size
        for g in groups:
            hbs = gcd(hbs, g.block_size)
        changes["groups"], changes["hash_block_size"] = groups, hbs
    blocks = list(cc.num_gpu_blocks)
    if capacity_blocks is not None:
        blocks = [capacity_blocks] * len(blocks) if isinstance(capacity_blocks, int) else list(capacity_blocks)
    if capacity_tokens is not None:
        # in the final groups' block sizes: a --block-size given with it changes them
        for g, spec in enumerate(groups):
            if not isinstance(spec, MambaSpec):
                blocks[g] = cdiv(capacity_tokens, spec.block_size) + 1
    elif block_size is not None and capacity_blocks is None:
        # keep the token capacity of the attention groups when their block size changes
        for g, (old, spec) in enumerate(zip(cc.groups, groups)):
            if not isinstance(spec, MambaSpec):
                blocks[g] = max(2, (blocks[g] - 1) * old.block_size // spec.block_size + 1)
    changes["num_gpu_blocks"] = tuple(blocks)
    if retention_interval is not KEEP:
        changes["retention_interval"] = retention_interval
    if without:
        unknown = sorted(set(without) - ALL_BEHAVIOURS)
        if unknown:
            raise ConfigError("preset", "without", f"unknown behaviours {unknown}; known: {sorted(ALL_BEHAVIOURS)}")
        changes["behaviours"] = cc.behaviours - frozenset(without)
    if external_capacity_blocks is not None:
        changes["external"] = ExternalTierConfig(external_capacity_blocks)
    sc = preset.scheduler_config
    if scheduler:
        sc = replace(sc, **scheduler)
    return replace(preset, cache_config=replace(cc, **changes), scheduler_config=sc)
