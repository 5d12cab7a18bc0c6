"""The external tier: a second-level cache (CPU, store, another node) keyed by (group, hash).

Write-through: every key published on the GPU is stored here too. It has its own
capacity (in blocks) and LRU; entries dropped for room are ``connector`` evictions.
An entry is used when it is stored (again) and when a request loads it (``touch``): the
LRU's order, and what a ``connector`` eviction's ``idle`` counts from (its ``ages`` from
the entry's first store).
"""

from __future__ import annotations

from collections import OrderedDict

from kvtrace.cache.events import EVICT_CONNECTOR, BlockEvicted
from kvtrace.cache.hashing import BlockHash
from kvtrace.cache.sink import EventSink


class ExternalTier:
    __slots__ = ("capacity", "entries", "sink", "stored_step", "used_step")

    def __init__(self, capacity_blocks: int, sink: EventSink):
        self.capacity = capacity_blocks
        self.entries: OrderedDict[tuple[int, BlockHash], int] = OrderedDict()  # key -> num_tokens
        self.stored_step: dict[tuple[int, BlockHash], int] = {}  # key -> the step it was first stored
        self.used_step: dict[tuple[int, BlockHash], int] = {}  # key -> the step it was last stored or loaded
        self.sink = sink

    def __contains__(self, key: tuple[int, BlockHash]) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def store(self, group_id: int, block_hash: BlockHash, num_tokens: int) -> None:
        key = (group_id, block_hash)
        step = self.sink.step
        self.used_step[key] = step
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        self.entries[key] = num_tokens
        self.stored_step[key] = step
        while len(self.entries) > self.capacity:
            (gid, h), _ = self.entries.popitem(last=False)
            born = self.stored_step.pop((gid, h), step)
            used = self.used_step.pop((gid, h), born)
            self.sink.evictions += 1
            self.sink.evictions_by_reason[EVICT_CONNECTOR] += 1
            if self.sink.enabled:
                self.sink.events.append(
                    BlockEvicted(step, gid, EVICT_CONNECTOR, (-1,), (h,), (step - born,), (step - used,), None)
                )

    def touch(self, group_id: int, block_hash: BlockHash) -> None:
        key = (group_id, block_hash)
        if key in self.entries:
            self.entries.move_to_end(key)
            self.used_step[key] = self.sink.step
