"""Cache configuration: one spec per KV cache group, retention, behaviours.

Block sizes are in tokens. Every group's block size is a multiple of
``hash_block_size``; a coarse block reuses the fine hash at its last unit.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvtrace.errors import ConfigError

# The three switchable behaviours: vLLM cache changes a study isolates. All on by default, as in current vLLM.
TRANSIENT_CHECKPOINT_RETENTION = "transient-checkpoint-retention"
SHARED_PREFIX_PINNING = "shared-prefix-pinning"
EXTERNAL_HIT_RUNNING_COW = "external-hit-running-cow"
# In a fixed order, for anything that lists them (a frozenset's order varies per process).
BEHAVIOURS = (TRANSIENT_CHECKPOINT_RETENTION, SHARED_PREFIX_PINNING, EXTERNAL_HIT_RUNNING_COW)
ALL_BEHAVIOURS: frozenset[str] = frozenset(BEHAVIOURS)

HASH_FUNCTIONS = ("sha256_cbor", "xxhash")
# A block is a Python object of the pool (~150 bytes); beyond this a pool alone would not
# fit a machine's memory, and no GPU holds that many blocks.
MAX_BLOCKS = 1 << 25
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
    groups: tuple[KVCacheSpec, ...]
    num_gpu_blocks: int | tuple[int, ...]  # per group, null block included
    hash_block_size: int
    hash_fn: str = "sha256_cbor"
    retention_interval: int | None = None  # None dense | 0 latest-only | k tokens
    enable_partial_hits: bool = False
    num_speculative_blocks: int = 0
    num_prefill_checkpoint_blocks: int = 0
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
            raise ConfigError(_SOURCE, "hash_block_size", f"expected a positive int, got {hbs!r}")
        for gid, spec in enumerate(groups):
            if not isinstance(spec, (FullAttentionSpec, SlidingWindowSpec, MambaSpec)):
                raise ConfigError(_SOURCE, f"groups[{gid}]", f"unknown spec {spec!r}")
            if spec.block_size <= 0 or spec.block_size % hbs:
                raise ConfigError(
                    _SOURCE, f"groups[{gid}].block_size",
                    f"expected a positive multiple of hash_block_size {hbs}, got {spec.block_size}",
                )
            if isinstance(spec, SlidingWindowSpec) and spec.sliding_window < 1:
                raise ConfigError(_SOURCE, f"groups[{gid}].sliding_window", "expected >= 1")
            if isinstance(spec, MambaSpec) and spec.num_lanes < 1:
                raise ConfigError(_SOURCE, f"groups[{gid}].num_lanes", "expected >= 1")
        nb = self.num_gpu_blocks
        nbs = (nb,) * len(groups) if isinstance(nb, int) else tuple(nb)
        if len(nbs) != len(groups) or any((not isinstance(n, int)) or n < 2 for n in nbs):
            raise ConfigError(
                _SOURCE, "num_gpu_blocks",
                f"expected an int >= 2 or one per group ({len(groups)}), got {nb!r}",
            )
        if sum(nbs) > MAX_BLOCKS:
            raise ConfigError(_SOURCE, "num_gpu_blocks", f"{sum(nbs):,} blocks is beyond what kvtrace can hold "
                                                         f"(at most {MAX_BLOCKS:,})")
        object.__setattr__(self, "num_gpu_blocks", nbs)
        if self.hash_fn not in HASH_FUNCTIONS:
            raise ConfigError(_SOURCE, "hash_fn", f"expected one of {HASH_FUNCTIONS}, got {self.hash_fn!r}")
        k = self.retention_interval
        if k is not None:
            if not isinstance(k, int) or k < 0:
                raise ConfigError(_SOURCE, "retention_interval", f"expected None, 0 or k > 0, got {k!r}")
            if not any(isinstance(spec, (SlidingWindowSpec, MambaSpec)) for spec in groups):
                # vLLM's _validate_prefix_cache_retention_interval: full attention keeps
                # every block, so a retention interval would silently do nothing.
                raise ConfigError(
                    _SOURCE, "retention_interval",
                    f"{k} has no effect without a sliding-window or Mamba group (full attention caches every "
                    "block); leave it unset (none)",
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
                raise ConfigError(_SOURCE, name, f"expected an int >= 0, got {v!r}")
        if self.num_prefill_checkpoint_blocks and not any(isinstance(s, MambaSpec) for s in groups):
            raise ConfigError(_SOURCE, "num_prefill_checkpoint_blocks", "needs a MambaSpec group")
        if self.external is not None and self.external.capacity_blocks < 1:
            raise ConfigError(_SOURCE, "external.capacity_blocks", "expected >= 1")
        unknown = sorted(self.behaviours - ALL_BEHAVIOURS)
        if unknown:
            raise ConfigError(_SOURCE, "behaviours", f"unknown {unknown}; known: {sorted(ALL_BEHAVIOURS)}")

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def without(self, *names: str) -> CacheConfig:
        """A copy with the named behaviours switched off (to reproduce the old bug)."""
        unknown = sorted(set(names) - ALL_BEHAVIOURS)
        if unknown:
            raise ConfigError(_SOURCE, "behaviours", f"unknown {unknown}; known: {sorted(ALL_BEHAVIOURS)}")
        return replace(self, behaviours=self.behaviours - frozenset(names))

    def with_(self, **changes) -> CacheConfig:
        return replace(self, **changes)
