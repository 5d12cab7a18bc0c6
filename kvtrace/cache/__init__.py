"""kvtrace.cache: the hybrid prefix-cache manager (vLLM v1 semantics, independent code).

Public API (vLLM-like): ``CacheConfig`` + specs, ``Request``, ``KVCacheManager``
(get_computed_blocks / get_num_external_hit_tokens / allocate_slots / free /
take_block_copies / take_state_writes / new_step_starts / reset_prefix_cache),
``KVCacheBlocks``, ``BlockCopy``, ``StateWrite`` and the behaviour names. The call
order per step is in ``kvtrace.cache.manager``'s docstring.

Modules: config (specs, behaviours), request, hashing (chained hashes, trace memo),
block_pool (null block, free queue, hash map), retention (sparse masks), single_type
(full attention, sliding window, Mamba align), manager (coordinator + facade),
external (second-level tier), plans (copies, state writes), events (typed events,
msgspec Structs). Device tensors and the exact content model live in ``storage`` and
``content``.
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
from kvtrace.cache.plans import STATE_CHECKPOINT, STATE_EXTERNAL, STATE_RUNNING, BlockCopy, KVCacheBlocks, StateWrite
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
    "STATE_EXTERNAL",
    "Request",
]
