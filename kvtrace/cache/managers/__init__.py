"""Per-group managers, one per KV cache spec kind (vLLM's single-type managers)."""

from kvtrace.cache.config import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from kvtrace.cache.managers.base import SingleTypeManager
from kvtrace.cache.managers.full_attention import FullAttentionManager
from kvtrace.cache.managers.mamba import MambaManager, MambaRequestState
from kvtrace.cache.managers.sliding_window import SlidingWindowManager

MANAGER_FOR_SPEC: dict[type, type[SingleTypeManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    MambaSpec: MambaManager,
}

__all__ = [
    "MANAGER_FOR_SPEC", "FullAttentionManager", "MambaManager", "MambaRequestState", "SingleTypeManager",
    "SlidingWindowManager",
]
