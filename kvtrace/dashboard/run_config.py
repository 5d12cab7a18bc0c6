"""What the pages read from a run's stored config (``runs.config``): the kind of each KV
cache group and the prefix cache's capacity. Pure functions of the parsed JSON; they
read only the fields the replay stores and never guess from names or free text.

Stored shapes (``kvtrace.replay.run``):
  engine:     {"cache": {"groups": [{"type": "FullAttentionSpec" | "SlidingWindowSpec" |
              "MambaSpec", "block_size": B, ...}, ...], "num_gpu_blocks": N (the pool all groups
              share) or [N per group] (a pool each), ...}, ...}
  cache-only: {"mode": "cache-only", "policy": "lru" | "belady", "capacity_blocks": N,
              "block_size": B or None}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeGuard

# The KV cache spec types an engine config stores (``cache.groups[g].type``) and the
# label each group gets on the pages.
GROUP_KINDS = {"FullAttentionSpec": "attention", "SlidingWindowSpec": "sliding window", "MambaSpec": "state"}


def stored_groups(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """The KV cache group specs of an engine config (``cache.groups``), [] for any other."""
    cache = cfg.get("cache")
    groups = cache.get("groups") if isinstance(cache, dict) else None
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        return []
    return groups


def group_labels(cfg: dict[str, Any]) -> dict[int, str]:
    """``group g (attention | sliding window | state)`` for each group of an engine config,
    from its stored spec type (GROUP_KINDS); plain ``group g`` for a type not in the table.
    {} for a config that stores no groups (cache-only, live and OTLP runs)."""
    labels = {}
    for gid, spec in enumerate(stored_groups(cfg)):
        kind = GROUP_KINDS.get(str(spec.get("type")))
        labels[gid] = f"group {gid} ({kind})" if kind else f"group {gid}"
    return labels


@dataclass(frozen=True)
class Capacity:
    """A prefix cache's size: ``blocks`` usable blocks of ``block_size`` tokens each."""

    blocks: int
    block_size: int

    def __str__(self) -> str:
        return f"{self.blocks:,} blocks of {self.block_size} tokens"


def _positive(v: Any) -> TypeGuard[int]:
    # (a size a summary can state, up to 2^63-1: a damaged config's 10^30 was listed by runs as
    # its capacity, where the run's summary from spans states none)
    return isinstance(v, int) and not isinstance(v, bool) and 0 < v < 1 << 63


def capacity(cfg: dict[str, Any], summary: dict[str, Any] | None = None) -> Capacity | None:
    """The prefix-cache capacity a stored config gives, or None where it gives none.

    Cache-only configs give ``capacity_blocks`` and ``block_size`` (None when the run used
    the trace's own block size; the run's ``summary`` then says which it was). Engine configs give
    ``cache.num_gpu_blocks`` (vLLM's null block included: one pool every group shares, or
    one per group) and the groups' block sizes: the capacity is the pool the first
    full-attention group allocates from, less the null block, which is what a cache-only
    run's ``capacity_blocks`` counts.
    """
    if cfg.get("mode") == "cache-only":
        blocks, size = cfg.get("capacity_blocks"), cfg.get("block_size") or (summary or {}).get("block_size")
        if _positive(blocks) and _positive(size):
            return Capacity(blocks, size)
        return None
    groups = stored_groups(cfg)
    per_group = cfg["cache"].get("num_gpu_blocks") if groups else None
    if isinstance(per_group, int):  # the pool every group shares
        per_group = [per_group] * len(groups)
    if not isinstance(per_group, list) or len(per_group) != len(groups):
        return None
    for spec, blocks in zip(groups, per_group):
        size = spec.get("block_size")
        if spec.get("type") != "FullAttentionSpec" or not _positive(size):
            continue
        if _positive(blocks) and blocks > 1:
            return Capacity(blocks - 1, size)
    return None


def shared_pool(cfg: dict[str, Any]) -> bool:
    """Whether an engine config's groups share one block pool (``cache.num_gpu_blocks`` an
    int, as vLLM has it): their usage shares then add up to the pool's usage."""
    cache = cfg.get("cache")
    return isinstance(cache, dict) and _positive(cache.get("num_gpu_blocks")) and len(stored_groups(cfg)) > 0
