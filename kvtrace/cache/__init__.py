"""kvtrace.cache: the hybrid prefix-cache manager (vLLM v1 semantics, independent code).

Tensor-free, like vLLM's scheduler side: it hands out block ids, copy plans and state
writes; the content lives in the engine's device storage.

Public API (vLLM-like): ``CacheConfig`` + specs, ``Request``, ``KVCacheManager``
(get_computed_blocks / get_num_external_hit_tokens / allocate_slots / free /
take_block_copies / take_state_writes / new_step_starts / reset_prefix_cache),
``KVCacheBlocks``, ``BlockCopy``, ``StateWrite`` and the behaviour names. The call
order per step is in ``kvtrace.cache.manager``'s docstring.

Modules, bottom up: config (specs, behaviours), events (typed events, msgspec
Structs), hashing (chained hashes, trace memo), request, blocks (block, free queue),
sink (the step's event buffer), block_pool (null block, LRU, hash map), external (a
second-level tier), retention (sparse masks), plans (copies, state writes), context
(what the per-group managers share), managers/ (full attention, sliding window, Mamba
align), coordinator (the fixed point across groups), manager (the scheduler-facing
facade).
"""

from typing import TYPE_CHECKING

from kvtrace.lazy import lazy_exports

# The public names and their modules, loaded on first use: the CLI's choices and the
# engine's presets read the config classes without loading the manager and its hashing.
_EXPORTS = {
    "ALL_BEHAVIOURS": "config", "EXTERNAL_HIT_RUNNING_COW": "config", "SHARED_PREFIX_PINNING": "config",
    "TRANSIENT_CHECKPOINT_RETENTION": "config", "CacheConfig": "config", "ExternalTierConfig": "config",
    "FullAttentionSpec": "config", "MambaSpec": "config", "SlidingWindowSpec": "config",
    "KVCacheManager": "manager", "STATE_CHECKPOINT": "plans", "STATE_EXTERNAL": "plans", "STATE_RUNNING": "plans",
    "BlockCopy": "plans", "KVCacheBlocks": "plans", "StateWrite": "plans", "Request": "request",
}

__all__ = [
    "ALL_BEHAVIOURS",
    "EXTERNAL_HIT_RUNNING_COW",
    "SHARED_PREFIX_PINNING",
    "STATE_CHECKPOINT",
    "STATE_EXTERNAL",
    "STATE_RUNNING",
    "TRANSIENT_CHECKPOINT_RETENTION",
    "BlockCopy",
    "CacheConfig",
    "ExternalTierConfig",
    "FullAttentionSpec",
    "KVCacheBlocks",
    "KVCacheManager",
    "MambaSpec",
    "Request",
    "SlidingWindowSpec",
    "StateWrite",
]


__getattr__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from kvtrace.cache.config import (
        ALL_BEHAVIOURS,
        EXTERNAL_HIT_RUNNING_COW,
        SHARED_PREFIX_PINNING,
        TRANSIENT_CHECKPOINT_RETENTION,
        CacheConfig,
        ExternalTierConfig,
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
    )
    from kvtrace.cache.manager import KVCacheManager
    from kvtrace.cache.plans import (
        STATE_CHECKPOINT,
        STATE_EXTERNAL,
        STATE_RUNNING,
        BlockCopy,
        KVCacheBlocks,
        StateWrite,
    )
    from kvtrace.cache.request import Request
