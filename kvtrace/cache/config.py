"""Cache configuration: one spec per KV cache group, the block pool, retention, behaviours.

Block sizes are in tokens. Every group's block size is a multiple of
``hash_block_size``; a coarse block reuses the fine hash at its last unit.

``num_gpu_blocks`` is the block pool as vLLM counts it (``KVCacheConfig.num_blocks``,
the null block included): one int is ONE pool shared by every group, as vLLM v1 has it
(block ids unique across groups, one LRU in which attention blocks and Mamba states
compete). A tuple, one size per group, gives each group a pool of its own instead: the
layout of SGLang, whose Mamba states live in a separate pool sized by
``--max-mamba-cache-size``. vLLM has no such option; the conformance check refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvtrace.errors import ConfigError

# The three switchable behaviours, all on by default as in current vLLM. BEHAVIOURS has a
# fixed order, for anything that lists them (a frozenset's order varies per process).
from kvtrace.names import BEHAVIOURS, shown_count, shown_value
from kvtrace.names import EXTERNAL_HIT_RUNNING_COW as EXTERNAL_HIT_RUNNING_COW
from kvtrace.names import SHARED_PREFIX_PINNING as SHARED_PREFIX_PINNING
from kvtrace.names import TRANSIENT_CHECKPOINT_RETENTION as TRANSIENT_CHECKPOINT_RETENTION

ALL_BEHAVIOURS: frozenset[str] = frozenset(BEHAVIOURS)

HASH_FUNCTIONS = ("sha256_cbor", "xxhash")
# A block is a Python object of the pool, made up front (~150 bytes, under a µs): 4M blocks
# take some 0.6 GB and 2-3 s before the first request (2^25 took 4.8 GB and 19 s). No GPU
# holds more: an H200's 141 GB over 4M blocks is 35 KB a block, less than one 16-token
# block of any model's KV (MLA's included). Cache-only mode's unbounded cache (inf)
# allocates nothing up front, for a capacity beyond this.
MAX_BLOCKS = 1 << 22
_SOURCE = "CacheConfig"


@dataclass(frozen=True, slots=True)
class FullAttentionSpec:
    block_size: int


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec:
    block_size: int
    sliding_window: int


@dataclass(frozen=True, slots=True)
class MambaSpec:
    """A recurrent (Mamba/KDA) state group in vLLM's ``mamba_cache_mode="align"``."""

    block_size: int
    num_lanes: int = 4  # D lanes of the recurrent state vector (content model)


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec | MambaSpec


@dataclass(frozen=True, slots=True)
class ExternalTierConfig:
    """A second-level cache (CPU / store / another node): LRU keyed by (hash, group)."""

    capacity_blocks: int


@dataclass(frozen=True)
class CacheConfig:
    """See the module docstring for ``num_gpu_blocks``.

    ``num_prefill_checkpoint_blocks`` (0 or 1) and ``prefill_checkpoint_alignment`` are
    vLLM's ``MambaSpec`` fields of the same names: with a checkpoint block, a prefill
    chunk may export the state at its last hash boundary into a reserved block (FlashKDA,
    alignment 16; Mamba2 and GDN, alignment 1, the default when checkpoints are on).
    """

    groups: tuple[KVCacheSpec, ...]
    num_gpu_blocks: int | tuple[int, ...]  # the shared pool (int), or one pool per group (tuple); null block included
    hash_block_size: int
    hash_fn: str = "sha256_cbor"
    retention_interval: int | None = None  # None dense | 0 latest-only | k tokens
    enable_partial_hits: bool = False
    num_speculative_blocks: int = 0
    num_prefill_checkpoint_blocks: int = 0
    prefill_checkpoint_alignment: int | None = None  # tokens; None: 1 when checkpoints are on
    external: ExternalTierConfig | None = None
    enable_caching: bool = True
    behaviours: frozenset[str] = field(default=ALL_BEHAVIOURS)

    def __post_init__(self) -> None:
        groups = tuple(self.groups)
        object.__setattr__(self, "groups", groups)
        object.__setattr__(self, "behaviours", frozenset(self.behaviours))
        if not groups:
            raise ConfigError(_SOURCE, "groups", "expected at least one KV cache group spec")
        hbs = self.hash_block_size
        if not isinstance(hbs, int) or hbs <= 0:
            raise ConfigError(_SOURCE, "hash_block_size", f"expected a positive int, got {shown_value(hbs)}")
        for gid, spec in enumerate(groups):
            if not isinstance(spec, (FullAttentionSpec, SlidingWindowSpec, MambaSpec)):
                raise ConfigError(_SOURCE, f"groups[{gid}]", f"unknown spec {shown_value(spec)}")
            for name in ("block_size", "sliding_window", "num_lanes"):  # (an API caller's: of any type)
                v = getattr(spec, name, 1)
                if isinstance(v, bool) or not isinstance(v, int):
                    raise ConfigError(_SOURCE, f"groups[{gid}].{name}", f"expected an int, got {shown_value(v)}")
            if spec.block_size <= 0 or spec.block_size % hbs:
                raise ConfigError(
                    _SOURCE, f"groups[{gid}].block_size",
                    f"expected a positive multiple of hash_block_size {shown_value(hbs)}, got "
                    f"{shown_value(spec.block_size)}",
                )
            if isinstance(spec, SlidingWindowSpec) and spec.sliding_window < 1:
                raise ConfigError(_SOURCE, f"groups[{gid}].sliding_window", "expected >= 1")
            if isinstance(spec, MambaSpec) and spec.num_lanes < 1:
                raise ConfigError(_SOURCE, f"groups[{gid}].num_lanes", "expected >= 1")
        nb = self.num_gpu_blocks
        if isinstance(nb, bool) or not isinstance(nb, (int, tuple, list)):
            raise ConfigError(_SOURCE, "num_gpu_blocks", f"expected an int >= 2 (one shared pool) or one int per "
                                                         f"group ({len(groups)} separate pools), got {shown_value(nb)}")
        nbs = (nb,) if isinstance(nb, int) else tuple(nb)
        if (not isinstance(nb, int) and len(nbs) != len(groups)) or any(
            isinstance(n, bool) or not isinstance(n, int) or n < 2 for n in nbs
        ):
            # (said of what was given: "1 separate pools" answered a single int)
            what = ("expected an int >= 2 (a pool holds vLLM's null block and at least one to use)"
                    if isinstance(nb, int) else
                    f"expected one int >= 2 per group ({len(groups)} groups, each its own pool), or one int for "
                    "one shared pool")
            raise ConfigError(_SOURCE, "num_gpu_blocks", f"{what}, got {shown_value(nb)}")
        if sum(nbs) > MAX_BLOCKS:
            raise ConfigError(_SOURCE, "num_gpu_blocks", f"{shown_count(sum(nbs))} blocks is beyond what kvtrace "
                                                         f"can hold (at most {MAX_BLOCKS:,})")
        object.__setattr__(self, "num_gpu_blocks", nb if isinstance(nb, int) else nbs)
        if self.hash_fn not in HASH_FUNCTIONS:
            raise ConfigError(_SOURCE, "hash_fn", f"expected one of {HASH_FUNCTIONS}, got {shown_value(self.hash_fn)}")
        k = self.retention_interval
        if k is not None:
            if not isinstance(k, int) or k < 0:
                raise ConfigError(_SOURCE, "retention_interval", f"expected None, 0 or k > 0, got {shown_value(k)}")
            if not any(isinstance(spec, (SlidingWindowSpec, MambaSpec)) for spec in groups):
                # vLLM's _validate_prefix_cache_retention_interval: full attention keeps
                # every block, so a retention interval would silently do nothing.
                raise ConfigError(
                    _SOURCE, "retention_interval",
                    f"{k} has no effect without a sliding-window or Mamba group (full attention caches every "
                    "block); set it to none (--retention none, or retention_interval = \"none\" in [cache]: a "
                    "preset's own interval too)",
                )
            for gid, spec in enumerate(groups):
                if k % spec.block_size:
                    raise ConfigError(
                        _SOURCE, "retention_interval",
                        f"{k} is not a multiple of group {gid}'s block size {spec.block_size}",
                    )
        for name in ("num_speculative_blocks", "num_prefill_checkpoint_blocks"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ConfigError(_SOURCE, name, f"expected an int >= 0, got {shown_value(v)}")
        pool = self.num_gpu_blocks if isinstance(self.num_gpu_blocks, int) else min(self.num_gpu_blocks)
        if self.num_speculative_blocks >= pool:  # (every request holds them: none could ever be scheduled)
            raise ConfigError(_SOURCE, "num_speculative_blocks",
                              f"{shown_count(self.num_speculative_blocks)} is not below the pool's {pool:,} blocks")
        if self.num_prefill_checkpoint_blocks > 1:
            raise ConfigError(_SOURCE, "num_prefill_checkpoint_blocks",
                              f"expected 0 or 1 (vLLM reserves one checkpoint block per chunk), "
                              f"got {shown_value(self.num_prefill_checkpoint_blocks)}")
        if self.num_prefill_checkpoint_blocks and not any(isinstance(s, MambaSpec) for s in groups):
            raise ConfigError(_SOURCE, "num_prefill_checkpoint_blocks", "needs a MambaSpec group")
        align = self.prefill_checkpoint_alignment
        if align is not None:
            if isinstance(align, bool) or not isinstance(align, int) or align < 1:
                raise ConfigError(_SOURCE, "prefill_checkpoint_alignment",
                                  f"expected tokens >= 1, got {shown_value(align)}")
            if not self.num_prefill_checkpoint_blocks:
                raise ConfigError(_SOURCE, "prefill_checkpoint_alignment",
                                  "has no effect without num_prefill_checkpoint_blocks = 1; leave it unset")
        elif self.num_prefill_checkpoint_blocks:
            object.__setattr__(self, "prefill_checkpoint_alignment", 1)
        if self.external is not None and self.external.capacity_blocks < 1:
            raise ConfigError(_SOURCE, "external.capacity_blocks", "expected >= 1")
        unknown = sorted(self.behaviours - ALL_BEHAVIOURS)
        if unknown:
            raise ConfigError(_SOURCE, "behaviours", f"unknown {unknown}; known: {sorted(ALL_BEHAVIOURS)}")

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def partial_hits(self) -> bool:
        """Fine-grained (hash-unit) hits in effect: asked for, and caching on (vLLM's
        coordinator has none without caching, whatever was asked). The cache's alignment and
        the scheduler's split both read this."""
        return self.enable_partial_hits and self.enable_caching

    @property
    def unit_group(self) -> int | None:
        """The group whose blocks a run's block counts are in (``block_size``,
        ``capacity_blocks``, ``hit_blocks``, ``total_blocks``): the first full-attention
        group; None without one."""
        return next((g for g, s in enumerate(self.groups) if isinstance(s, FullAttentionSpec)), None)

    @property
    def shared_pool(self) -> bool:
        """One block pool for every group (vLLM), rather than one per group (SGLang)."""
        return isinstance(self.num_gpu_blocks, int)

    @property
    def pool_sizes(self) -> tuple[int, ...]:
        """Per group, the size of the pool it allocates from (the same pool when shared)."""
        nb = self.num_gpu_blocks
        return (nb,) * len(self.groups) if isinstance(nb, int) else tuple(nb)

    @property
    def total_blocks(self) -> int:
        """Blocks of every pool together, null blocks included."""
        nb = self.num_gpu_blocks
        return nb if isinstance(nb, int) else sum(nb)

    def without(self, *names: str) -> CacheConfig:
        """A copy with the named behaviours switched off (to reproduce the old bug)."""
        unknown = sorted(set(names) - ALL_BEHAVIOURS)
        if unknown:
            raise ConfigError(_SOURCE, "behaviours", f"unknown {unknown}; known: {sorted(ALL_BEHAVIOURS)}")
        return replace(self, behaviours=self.behaviours - frozenset(names))

    def with_(self, **changes) -> CacheConfig:
        return replace(self, **changes)
