"""The step's event buffer and event counters, shared by a manager's pools, its
per-group managers and its external tier (every one of them appends here; the manager
hands the buffer to its listeners once per step)."""

from __future__ import annotations

from collections import Counter

from kvtrace.cache.events import CacheEvent


class EventSink:
    """The manager's per-step event buffer and counters, shared by all pools.

    Counters run whether or not anyone listens; events are built only when
    ``enabled`` (a listener subscribed), because building them is most of their cost.
    """

    __slots__ = ("enabled", "events", "evictions", "evictions_by_reason", "publishes", "step")

    def __init__(self, enabled: bool = True):
        self.events: list[CacheEvent] = []
        self.step = 0
        self.enabled = enabled
        self.publishes = 0
        self.evictions = 0
        self.evictions_by_reason: Counter[str] = Counter()
