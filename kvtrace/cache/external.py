"""The external tier: a second-level cache (CPU, store, another node) keyed by (group, hash).

Write-through: every key published on the GPU is stored here too. It has its own
capacity (in blocks) and LRU; entries dropped for room are ``connector`` evictions.
An entry is used when it is stored (again) and when a request loads it (``touch``): the
LRU's order, and what a ``connector`` eviction's ``idle`` counts from (its ``ages`` from
the entry's first store).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

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
        self.store_all(group_id, ((block_hash, num_tokens),))

    def store_all(self, group_id: int, keys: Iterable[tuple[BlockHash, int]]) -> None:
        """Store one publish's keys (hash, num_tokens), in order; then report, after that
        publish's event, the entries the stores dropped for room (``connector`` evictions).
        Only entries gone at the end are reported, each once: storing the publish's earlier
        keys could drop one of its later keys the tier held, which its own store then put back
        (keeping its first store's step, its age), and "publish X, evict X" read as X gone while
        the tier held it."""
        step = self.sink.step
        entries = self.entries
        # entries dropped for room -> (first stored, last used); one stored again by this publish
        # is no drop, and keeps its first store (its age)
        dropped: dict[tuple[int, BlockHash], tuple[int, int]] = {}
        for block_hash, num_tokens in keys:
            key = (group_id, block_hash)
            self.used_step[key] = step
            if key in entries:
                entries.move_to_end(key)
                continue
            entries[key] = num_tokens
            undone = dropped.pop(key, None)
            self.stored_step[key] = step if undone is None else undone[0]
            while len(entries) > self.capacity:
                gone, _ = entries.popitem(last=False)
                born = self.stored_step.pop(gone, step)
                dropped[gone] = (born, self.used_step.pop(gone, born))
        sink = self.sink
        for (gid, h), (born, used) in dropped.items():
            sink.evictions += 1
            sink.evictions_by_reason[EVICT_CONNECTOR] += 1
            if sink.enabled:
                sink.events.append(
                    BlockEvicted(step, gid, EVICT_CONNECTOR, (-1,), (h,), (step - born,), (step - used,), None))

    def touch(self, group_id: int, block_hash: BlockHash) -> None:
        key = (group_id, block_hash)
        if key in self.entries:
            self.entries.move_to_end(key)
            self.used_step[key] = self.sink.step


def connector_hit(num_local: int, block_size: int, ask: Callable[[int], int]) -> tuple[int, int]:
    """vLLM 0.33's connector rule (``Scheduler.schedule``'s waiting loop): the (local, external)
    hit tokens a new request is admitted with, from its local hit ``num_local``.

    The connector is asked from the local hit cut down to a scheduler block of ``block_size``
    tokens (``ask(start)``: the tokens past ``start`` it can load). A local hit ending mid-block
    keeps its sub-block tail and loads nothing, unless the load is longer than that tail: then
    the tail is dropped (no copy-on-write of it races the load) and the load covers it.
    """
    tail = num_local % block_size
    aligned = num_local - tail
    external = ask(aligned)
    if not tail:
        return num_local, external
    if external > tail:
        return aligned, external
    return num_local, 0
