"""Named engine presets: a CacheConfig, a SchedulerConfig and a cost model.

| preset | groups | hash block | retention | partial hits | checkpoints | block pool (shared by the groups) | batch tokens / seqs | cost model |
|---|---|---|---|---|---|---|---|---|
| dense-attention | FullAttention(16) | 16 | None (dense) | off | 0 | 53_760 (~860k tokens) | 8192 / 1024 | h200-dense-8b |
| kimi-hybrid | FullAttention(512) + Mamba/KDA(512, align, 4 lanes) | 64 | 0 (latest-only) | on | 1 (FlashKDA: alignment 16) | 10_240: ~8_192 for attention (~4.2M tokens) + ~2_048 for states, in one LRU | 8192 / 1024 | h200-kimi-hybrid |
| dense-70b-tp4 | FullAttention(16) | 16 | None (dense) | off | 0 | 70_000 (~1.1M tokens) | 8192 / 1024 | h200-dense-70b-tp4 |
| dense-70b-tp8 | FullAttention(16) | 16 | None (dense) | off | 0 | 168_000 (~2.7M tokens) | 8192 / 1024 | h200-dense-70b-tp8 |

The pool counts blocks as vLLM's ``num_gpu_blocks`` does (the null block included) and
is shared by every KV cache group, as in vLLM: attention blocks and Mamba states take
what they need from it. Capacity is overridable (``capacity_blocks``: the pool; a tuple
gives each group a pool of its own instead, SGLang's layout; ``capacity_tokens``: the
same pool spelt in tokens, that many tokens' blocks for each attention group and the null
block, which Mamba states share as they share any pool), as are retention and the behaviours.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import gcd

from kvtrace.cache import ALL_BEHAVIOURS, CacheConfig, ExternalTierConfig, FullAttentionSpec, MambaSpec
from kvtrace.cache.config import MAX_BLOCKS
from kvtrace.engine.clock import CostModel, get_cost_model
from kvtrace.engine.config import SchedulerConfig
from kvtrace.errors import ConfigError
from kvtrace.names import shown_value
from kvtrace.numeric import cdiv

KEEP = object()  # "leave this setting as the preset has it"

# `vllm serve`'s own limits on a 70-160 GB GPU (H100, H200: vLLM's EngineArgs.get_batch_defaults for
# the OpenAI server): 8,192 tokens and 1,024 running requests a step. The presets model H200s.
SERVE_MAX_NUM_BATCHED_TOKENS = 8192
SERVE_MAX_NUM_SEQS = 1024


@dataclass(frozen=True)
class EnginePreset:
    name: str
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    cost_model: CostModel
    # blocks of the pool budgeted for Mamba states when the preset's pool is re-blocked
    # (block_size): the rest keeps the attention groups' token capacity
    state_blocks: int = 0


def _dense_attention() -> EnginePreset:
    return EnginePreset(
        "dense-attention",
        CacheConfig(groups=(FullAttentionSpec(16),), num_gpu_blocks=53_760, hash_block_size=16, retention_interval=None),
        SchedulerConfig(max_num_batched_tokens=SERVE_MAX_NUM_BATCHED_TOKENS, max_num_seqs=SERVE_MAX_NUM_SEQS),
        get_cost_model("h200-dense-8b"),
    )


def _kimi_hybrid() -> EnginePreset:
    return EnginePreset(
        "kimi-hybrid",
        CacheConfig(
            groups=(FullAttentionSpec(512), MambaSpec(512, num_lanes=4)),
            num_gpu_blocks=10_240,  # one pool: 8_192 + 2_048, the two former per-group pools
            hash_block_size=64,
            retention_interval=0,
            enable_partial_hits=True,
            num_prefill_checkpoint_blocks=1,
            prefill_checkpoint_alignment=16,  # FlashKDA's (vLLM's kda_prefill_checkpoint_alignment)
        ),
        SchedulerConfig(max_num_batched_tokens=SERVE_MAX_NUM_BATCHED_TOKENS, max_num_seqs=SERVE_MAX_NUM_SEQS),
        get_cost_model("h200-kimi-hybrid"),
        state_blocks=2_048,
    )


def _dense_70b(tp: int, num_gpu_blocks: int) -> EnginePreset:
    # KV per token: 80 layers x 8 KV heads x 128 x 2 (K, V) x 2 B = 320 KiB, split over the TP
    # ranks; per H200 ~127 GB usable minus 140 GB / tp of weights holds num_gpu_blocks x 16 tokens.
    return EnginePreset(
        f"dense-70b-tp{tp}",
        CacheConfig(groups=(FullAttentionSpec(16),), num_gpu_blocks=num_gpu_blocks, hash_block_size=16),
        SchedulerConfig(max_num_batched_tokens=SERVE_MAX_NUM_BATCHED_TOKENS, max_num_seqs=SERVE_MAX_NUM_SEQS),
        get_cost_model(f"h200-dense-70b-tp{tp}"),
    )


PRESETS = {
    "dense-attention": _dense_attention,
    "dense-70b-tp4": lambda: _dense_70b(4, 70_000),
    "dense-70b-tp8": lambda: _dense_70b(8, 168_000),
    "kimi-hybrid": _kimi_hybrid,
}


def _check_hash_block_size(hbs: object, groups: tuple) -> None:
    if isinstance(hbs, bool) or not isinstance(hbs, int) or hbs < 1:
        raise ConfigError("CacheConfig", "hash_block_size", f"expected a positive token count, got {shown_value(hbs)}")
    for g in groups:
        if g.block_size % hbs:
            raise ConfigError("CacheConfig", "hash_block_size", f"{hbs} does not divide the block size "
                                                                f"{g.block_size}; expected a divisor of every group's")


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
    groups: tuple | None = None,
    scheduler: dict | None = None,
) -> EnginePreset:
    """A named preset with overrides.

    ``capacity_blocks``: the block pool shared by every group (an int, vLLM's
    ``num_gpu_blocks``, the null block included), or one pool per group (a tuple);
    ``capacity_tokens``: the pool in tokens, cdiv(tokens, block size) blocks for each
    attention group plus the null block, shared with Mamba states as any pool is (one
    setting with ``capacity_blocks``: a state budget added to it let attention take it
    too, and 2,000 tokens on kimi-hybrid ran a pool of ~1M);
    ``retention_interval``: None | 0 | k; ``without``: behaviour names to switch off;
    ``external_capacity_blocks``: add an external tier; ``groups``: KV cache group specs
    replacing the preset's; ``block_size``: every group's block size (one group is hashed
    per block, as vLLM does; several in the preset's hash unit, shrunk to divide it);
    ``hash_block_size``: the hash unit; ``scheduler``: SchedulerConfig fields.
    """
    try:
        preset = PRESETS[name]()
    except KeyError:
        raise ConfigError("preset", name, f"unknown; known: {sorted(PRESETS)}") from None
    cc = preset.cache_config
    changes: dict = {}
    base_groups = cc.groups if groups is None else tuple(groups)
    if groups is not None:
        changes["groups"] = base_groups
        if hash_block_size is not None and block_size is None:
            changes["hash_block_size"] = hash_block_size
    groups = base_groups
    if block_size is not None:
        groups = tuple(replace(g, block_size=block_size) for g in base_groups)
    if hash_block_size is not None:  # the user's unit: checked, never shrunk to fit
        _check_hash_block_size(hash_block_size, groups)
    if block_size is not None:
        if hash_block_size is not None:
            hbs = hash_block_size
        elif len(groups) == 1:
            hbs = groups[0].block_size  # vLLM hashes a single group per block
        else:
            hbs = cc.hash_block_size  # the preset's unit, shrunk to divide the new block size
            for g in groups:
                hbs = gcd(hbs, g.block_size)
        changes["groups"], changes["hash_block_size"] = groups, hbs
    elif hash_block_size is not None and "hash_block_size" not in changes:
        changes["hash_block_size"] = hash_block_size
    blocks: int | tuple[int, ...] = cc.num_gpu_blocks
    if capacity_blocks is not None:
        blocks = capacity_blocks if isinstance(capacity_blocks, int) else tuple(capacity_blocks)
    attention = [g for g, spec in enumerate(groups) if not isinstance(spec, MambaSpec)]
    # the preset's budget for Mamba states, where the groups have one to hold them: groups of
    # attention alone (a --config's) took it as 2,048 more attention blocks than asked for
    state_blocks = preset.state_blocks if len(attention) < len(groups) else 0
    if capacity_tokens is not None:
        # in the final groups' block sizes: a --block-size given with it changes them
        per_group = [cdiv(capacity_tokens, groups[g].block_size) for g in attention]
        if isinstance(blocks, int):
            blocks = 1 + sum(per_group)
        else:
            sized = list(blocks)
            for g, n in zip(attention, per_group):
                sized[g] = n + 1
            blocks = tuple(sized)
    elif block_size is not None and capacity_blocks is None:
        # keep the token capacity of the attention groups when their block size changes
        if isinstance(blocks, int):
            share = (blocks - 1 - state_blocks) // max(len(attention), 1)
            blocks = 1 + state_blocks + sum(
                max(1, share * base_groups[g].block_size // groups[g].block_size) for g in attention)
        else:
            sized = list(blocks)
            for g in attention:
                sized[g] = max(2, (sized[g] - 1) * base_groups[g].block_size // groups[g].block_size + 1)
            blocks = tuple(sized)
        scaled = blocks if isinstance(blocks, int) else sum(blocks)
        if scaled > MAX_BLOCKS:  # said of the block size: the user gave no pool (CacheConfig would name it)
            raise ConfigError("CacheConfig", "groups", f"{name}'s pool in {block_size}-token blocks is {scaled:,} "
                                                       f"blocks, beyond what kvtrace can hold (at most {MAX_BLOCKS:,}); "
                                                       "give --capacity-blocks or --capacity-tokens with it")
    changes["num_gpu_blocks"] = blocks
    if not any(isinstance(g, MambaSpec) for g in groups):  # groups without Mamba: its prefill checkpoint goes too
        changes["num_prefill_checkpoint_blocks"] = 0
        changes["prefill_checkpoint_alignment"] = None
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
        try:
            sc.check_vllm_accepts()
        except ConfigError as err:
            if "max_num_seqs" in scheduler or sc.max_num_batched_tokens >= sc.max_num_seqs:
                raise
            # (a budget below 1,024 alone: vLLM refuses it beside its own default too)
            raise ConfigError(err.source, err.key, f"{err.what} (max_num_seqs {sc.max_num_seqs:,} is the preset's, "
                                                   "vllm serve's on an H100 or H200: set max_num_seqs too)") from None
    return replace(preset, cache_config=replace(cc, **changes), scheduler_config=sc, state_blocks=state_blocks)
