"""kvtrace.cache: the tensor-free core of the hybrid prefix-cache manager.

Public API (vLLM-like): ``CacheConfig`` + specs, ``Request``, ``KVCacheManager``
(get_computed_blocks / allocate_slots / free / take_block_copies / take_state_writes /
new_step_starts), ``KVCacheBlocks``, ``BlockCopy``, ``StateWrite`` and the behaviour names.
Device tensors live in ``kvtrace.cache.storage`` (owned by the engine side).
"""

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
from kvtrace.cache.plans import STATE_CHECKPOINT, STATE_RUNNING, BlockCopy, KVCacheBlocks, StateWrite
from kvtrace.cache.request import Request

__all__ = [
    "ALL_BEHAVIOURS",
    "EXTERNAL_HIT_RUNNING_COW",
    "SHARED_PREFIX_PINNING",
    "TRANSIENT_CHECKPOINT_RETENTION",
    "CacheConfig",
    "ExternalTierConfig",
    "FullAttentionSpec",
    "MambaSpec",
    "SlidingWindowSpec",
    "KVCacheManager",
    "KVCacheBlocks",
    "BlockCopy",
    "StateWrite",
    "STATE_RUNNING",
    "STATE_CHECKPOINT",
    "Request",
]
