"""Typed engine events (virtual time in integer nanoseconds).

Like cache events, these are frozen, tagged, array-like ``msgspec.Struct``s (see
``kvtrace.cache.events``). The engine delivers, once per step, a ``StepExecuted``
together with that step's cache events, so a listener can place cache events on the
virtual time line.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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
