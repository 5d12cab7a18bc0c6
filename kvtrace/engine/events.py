"""Typed engine events (virtual time in integer nanoseconds).

Like cache events, these are frozen, tagged, array-like ``msgspec.Struct``s (see
``kvtrace.cache.events``). The engine delivers, once per step, a ``StepExecuted``
together with that step's cache events, so a listener can place cache events on the
virtual time line.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, overload

import msgspec

from kvtrace.cache.events import CacheEvent, Event


class StepExecuted(Event, frozen=True):
    step: int
    start_ns: int
    end_ns: int
    num_prefill_tokens: int
    num_decode_seqs: int
    num_running: int
    num_waiting: int
    num_copies: int
    num_preempted: int
    # per KV cache group, the share of its block pool's usable blocks the group holds
    # (0..1; with the shared pool the shares sum to the pool's usage, vLLM's kv_cache_usage)
    usage: tuple[float, ...]


class RequestFinished(Event, frozen=True):
    request_id: str
    session_id: str | None
    arrival_ns: int
    first_scheduled_ns: int
    first_token_ns: int
    finish_ns: int
    num_prompt_tokens: int
    num_output_tokens: int
    num_local_hit_tokens: int  # prefix-cache hit at first schedule
    num_external_hit_tokens: int
    num_computed_prompt_tokens: int  # prompt tokens actually prefilled (all chunks, incl. recompute)
    num_preemptions: int
    num_divergent_tokens: int
    itl_ns: tuple[int, ...]  # every inter-token gap
    prefill_chunks: tuple[tuple[int, int, int], ...]  # (start_ns, end_ns, num_tokens)
    # vLLM's hit counters of this request (kvtrace.metrics.PER_REQUEST)
    num_external_query_tokens: int = 0
    num_preempted_query_tokens: int = 0
    num_preempted_hit_tokens: int = 0


class FinishedRequests(Sequence[RequestFinished]):
    """A run's finished requests in finish order, as ``Engine.run`` keeps them to the end:
    each one's ``RequestFinished`` without its inter-token gaps, and every gap of the run in
    one ``array('q')``: 8 bytes a gap, where a tuple held an int object of 28-32 bytes and its
    8-byte slot (most of what a finished request left behind: 6 KB of a Mooncake request's).
    Reading one (index, slice, iteration) gives its whole ``RequestFinished`` back, its gaps
    the tuple of ints the event carried; ``gaps``, ``all_gaps`` and ``without_gaps`` read them
    without making an int object a gap."""

    __slots__ = ("_ends", "_gaps", "_records")

    def __init__(self, records: Iterable[RequestFinished] = ()):
        self._records: list[RequestFinished] = []  # (itl_ns empty: the gaps are in _gaps)
        self._gaps = array("q")
        self._ends = array("q")  # request i's gaps: _gaps[_ends[i - 1]:_ends[i]] (0 for i = 0)
        for record in records:
            self.append(record)

    def append(self, record: RequestFinished) -> None:
        self._gaps.extend(record.itl_ns)
        self._ends.append(len(self._gaps))
        self._records.append(msgspec.structs.replace(record, itl_ns=()))

    def gaps(self, index: int) -> array:
        """Request ``index``'s inter-token gaps (ns), a copy as an ``array('q')``."""
        i = range(len(self._ends))[index]  # (an IndexError past either end)
        return self._gaps[self._ends[i - 1] if i else 0:self._ends[i]]

    @property
    def all_gaps(self) -> array:
        """Every inter-token gap of the run (ns), request after request in finish order (the
        array itself: not to be changed)."""
        return self._gaps

    def without_gaps(self) -> list[RequestFinished]:
        """The records with ``itl_ns`` empty (the list itself: not to be changed), for what
        reads every other field: ``gaps`` and ``all_gaps`` hold the gaps."""
        return self._records

    def _whole(self, index: int) -> RequestFinished:
        return msgspec.structs.replace(self._records[index], itl_ns=tuple(self.gaps(index)))  # (gaps: IndexError)

    @overload
    def __getitem__(self, index: int) -> RequestFinished: ...

    @overload
    def __getitem__(self, index: slice) -> list[RequestFinished]: ...

    def __getitem__(self, index: int | slice) -> RequestFinished | list[RequestFinished]:
        if isinstance(index, slice):
            return [self._whole(i) for i in range(*index.indices(len(self._records)))]
        return self._whole(index)

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[RequestFinished]:
        return (self._whole(i) for i in range(len(self._records)))

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"FinishedRequests({len(self):,} requests, {len(self._gaps):,} gaps)"


class StaleHashFound(Event, frozen=True):
    step: int
    time_ns: int
    group_id: int
    block_id: int
    block_hash: bytes | int
    num_tokens: int  # the prefix length the key claims
    expected_fingerprint: int
    actual_fingerprint: int
    request_id: str | None  # the request that last wrote the block, when known


class DivergentOutput(Event, frozen=True):
    step: int
    time_ns: int
    request_id: str
    position: int  # output index
    expected_token: int
    actual_token: int


EngineEvent = StepExecuted | RequestFinished | StaleHashFound | DivergentOutput


class StepBatch(msgspec.Struct, gc=False):
    """What listeners receive once per step (a container, not an event)."""

    step: StepExecuted
    cache_events: Sequence[CacheEvent]
    engine_events: Sequence[EngineEvent] = ()


StepListener = Callable[[StepBatch], None]
