"""What the per-group managers and the coordinator of one manager share.

(The step's event buffer, shared by the pools too, is ``kvtrace.cache.sink.EventSink``.)

* ``CacheStats``: lookup, hit and allocation counters of the manager;
* ``CacheContext``: the settings every per-group manager reads (hash block size,
  retention, the hit alignment, checkpoints, the behaviour switches) and the per-step
  queues they fill (copy plans, state writes, references held until the copies are
  handed out).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import lcm

from kvtrace.cache.block_pool import BlockPool
from kvtrace.cache.blocks import KVCacheBlock
from kvtrace.cache.config import (
    EXTERNAL_HIT_RUNNING_COW,
    SHARED_PREFIX_PINNING,
    TRANSIENT_CHECKPOINT_RETENTION,
    CacheConfig,
)
from kvtrace.cache.events import COPY_EXTERNAL, BlockCopied
from kvtrace.cache.plans import BlockCopy, StateWrite
from kvtrace.cache.sink import EventSink


@dataclass(slots=True)
class CacheStats:
    """Counters of one manager; ``publishes`` and ``evictions`` come from its sink."""

    queries: int = 0  # get_computed_blocks calls
    query_tokens: int = 0
    hit_tokens: int = 0  # local hits after the fixed point
    hit_requests: int = 0
    external_hit_tokens: int = 0
    copies: int = 0
    stale_hash_left: int = 0
    failed_allocations: int = 0
    freed_requests: int = 0
    # (step, request id, behaviour): each time a switched-off behaviour acted otherwise
    # than vLLM 0.33 does (empty with every behaviour on)
    old_behaviour_acted: list[tuple[int, str, str]] = field(default_factory=list, repr=False)
    sink: EventSink | None = field(default=None, repr=False)

    @property
    def publishes(self) -> int:
        return self.sink.publishes if self.sink else 0

    @property
    def evictions(self) -> dict[str, int]:
        return dict(sorted(self.sink.evictions_by_reason.items())) if self.sink else {}

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def as_dict(self) -> dict:
        return {
            "queries": self.queries, "query_tokens": self.query_tokens, "hit_tokens": self.hit_tokens,
            "hit_requests": self.hit_requests, "external_hit_tokens": self.external_hit_tokens,
            "publishes": self.publishes, "evictions": self.evictions, "copies": self.copies,
            "stale_hash_left": self.stale_hash_left, "failed_allocations": self.failed_allocations,
        }


class CacheContext:
    """Settings and per-step queues shared by the per-group managers of one manager.

    ``copies``, ``state_writes`` and ``retained`` are filled during ``allocate_slots``
    and emptied by ``take_block_copies`` / ``take_state_writes``: a copy's endpoints stay
    referenced (``retained``) until the copy list is handed to the worker, so neither
    block can be reallocated before the copy runs.
    """

    __slots__ = (
        "cache_hit_alignment", "copies", "enable_partial_hits", "external_hit_running_cow", "hash_block_size",
        "num_groups", "num_prefill_checkpoint_blocks", "num_speculative_blocks", "pinning",
        "prefill_checkpoint_alignment", "retained", "retention_interval", "scheduler_block_size", "sink",
        "state_writes", "stats", "transient_checkpoint_retention",
    )

    def __init__(self, config: CacheConfig, sink: EventSink, stats: CacheStats):
        self.num_groups = config.num_groups
        self.hash_block_size = config.hash_block_size
        self.retention_interval = config.retention_interval
        self.enable_partial_hits = config.partial_hits
        self.num_speculative_blocks = config.num_speculative_blocks
        self.num_prefill_checkpoint_blocks = config.num_prefill_checkpoint_blocks
        self.prefill_checkpoint_alignment = config.prefill_checkpoint_alignment
        self.scheduler_block_size = lcm(*(s.block_size for s in config.groups))
        # Hits land on hash units with partial hits on, else on the scheduler block size
        # (vLLM's ``_cache_hit_alignment_tokens``, pushed into every manager).
        self.cache_hit_alignment = config.hash_block_size if self.enable_partial_hits else self.scheduler_block_size
        self.pinning = SHARED_PREFIX_PINNING in config.behaviours
        self.transient_checkpoint_retention = TRANSIENT_CHECKPOINT_RETENTION in config.behaviours
        self.external_hit_running_cow = EXTERNAL_HIT_RUNNING_COW in config.behaviours
        self.sink = sink
        self.stats = stats
        self.retained: list[tuple[BlockPool, KVCacheBlock]] = []  # copy endpoints, in copy order
        self.copies: list[BlockCopy] = []
        self.state_writes: list[StateWrite] = []

    def old_behaviour(self, behaviour: str, request_id: str) -> None:
        """Record that switched-off ``behaviour`` just acted as the old code did (so a
        disagreement with vLLM can be traced to the switch that explains it)."""
        self.stats.old_behaviour_acted.append((self.sink.step, request_id, behaviour))

    def queue_copy(self, copy: BlockCopy) -> None:
        self.copies.append(copy)
        self.stats.copies += 1
        if self.sink.enabled:
            self.sink.events.append(
                BlockCopied(self.sink.step, copy.request_id, copy.group_id, copy.src, copy.dst, copy.why)
            )

    def note_external_load(self, request_id: str, group_id: int, block: KVCacheBlock) -> None:
        if self.sink.enabled:
            self.sink.events.append(
                BlockCopied(self.sink.step, request_id, group_id, -1, block.block_id, COPY_EXTERNAL)
            )
