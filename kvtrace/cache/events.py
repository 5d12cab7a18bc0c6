"""Typed cache events.

The manager appends these to a per-step buffer and hands the whole batch to its
listeners once per scheduler step (``KVCacheManager.subscribe``). Events are plain
data: the cache never formats them, and nothing here knows about OpenTelemetry.

Block hashes are ``bytes`` (sha256_cbor: 32 bytes; xxhash: 8 bytes), except in
cache-only replay, where a block's key is its trace id (an ``int``, see
``kvtrace.replay.cache_only.block_keys``), as vLLM's own KV events carry ``bytes | int``.
Steps are scheduler step indices (the cache has no clock; the engine maps steps to
virtual time).

Events are frozen ``msgspec.Struct``s, not dataclasses: a run creates one per step and
kind, and a Struct is built in C (about 4x faster than a frozen dataclass), is not
tracked by the garbage collector (``gc=False``: events hold no cycles), and encodes as a
tagged array ``["BlockPublished", step, ...]`` (``array_like``, ``tag``), which is what
the run digest hashes. Positional arguments follow the field order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec


class Event(msgspec.Struct, frozen=True, array_like=True, tag=True, gc=False):
    """Base of every cache and engine event (see the module docstring).

    Subclasses repeat ``frozen=True``: msgspec inherits it at run time, but type
    checkers (dataclass_transform) read each class's own keywords."""

# Publish kinds (why a block became reachable by hash).
PUBLISH_FULL = "full"  # a full block at a retained position
PUBLISH_PARTIAL_TAIL = "partial_tail"  # the prompt's last hash boundary inside a block
PUBLISH_CHECKPOINT = "checkpoint"  # an internal prefill checkpoint re-keyed at its position
PUBLISH_BOUNDARY = "boundary"  # a semantic boundary kept by a sparse retention mask
PUBLISH_MOVED = "moved"  # a key re-pointed to a copy block (move_block_hashes; vLLM emits no event)

# Eviction reasons.
EVICT_LRU = "lru"  # popped from the free-queue head by an allocation
EVICT_STALE_HASH = "stale_hash"  # the slot is about to be overwritten by request-local state
EVICT_REPLACED = "replaced"  # a partial key promoted, or the block's content replaced (a checkpoint re-key)
EVICT_MOVED = "moved"  # a key re-pointed to a copy block (the other half of PUBLISH_MOVED; not an eviction)
EVICT_CONNECTOR = "connector"  # dropped from the external tier
EVICT_RESET = "reset"  # reset_prefix_cache()

# Copy reasons.
COPY_PARTIAL_HIT = "partial_hit"  # new request whose hit ends mid-block: fresh copy block
COPY_RUNNING_TAIL = "running_tail"  # partial-tail entry of a running request moved to a copy
COPY_EXTERNAL = "external"  # external tier loaded into a local block


class BlockPublished(Event, frozen=True):
    step: int
    request_id: str
    group_id: int
    kind: str  # PUBLISH_*
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes | int, ...]
    num_tokens: int  # prefix length (tokens) the last published key stands for


class BlockEvicted(Event, frozen=True):
    step: int
    group_id: int
    reason: str  # EVICT_*
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes | int, ...]
    ages: tuple[int, ...]  # steps since each entry was published
    idle: tuple[int, ...]  # steps since each entry was last used (hit or freed)
    request_id: str | None  # the request whose allocation or checkpoint caused it


class BlockCopied(Event, frozen=True):
    step: int
    request_id: str
    group_id: int
    src: int
    dst: int
    why: str  # COPY_*


class PrefixLookup(Event, frozen=True):
    step: int
    request_id: str
    num_query_tokens: int
    # local hit after the coordinator's fixed point, less a sub-block tail an external load
    # replaced (external.connector_hit)
    num_hit_tokens: int
    hit_tokens_per_group: tuple[int, ...]
    shared_prefix_boundary: int
    num_external_hit_tokens: int
    root_hash: bytes | int | None  # hash of the first full block: identifies the prefix family
    first_miss_hash: bytes | int | None  # hash of the first full block that missed (group 0)
    first_miss_index: int  # its block index, -1 when everything hit


def first_miss(coarse: Sequence[bytes | int], hit: int, block_size: int,
               num_tokens: int) -> tuple[bytes | int | None, int]:
    """A lookup's ``first_miss_hash`` and ``first_miss_index`` (both backends): the first full
    block of ``coarse`` (group 0's hashes) past a ``hit`` of ``num_tokens``, or (None, -1).
    A block past the prompt's last token but one, which is always recomputed, was never
    looked up: no miss (a resend's lookup named a block it found cached, and the miss
    attribution blamed an old eviction of it)."""
    i = hit // block_size
    if i < len(coarse) and (i + 1) * block_size <= num_tokens - 1:
        return coarse[i], i
    return None, -1


def note_external_hits(events: list, at: int, request_id: str, num_external_hit_tokens: int,
                       num_hit_tokens: int = -1) -> None:
    """Give the lookup of ``request_id`` at ``events[at]`` its external hit tokens, which a
    manager learns after the lookup event (both backends; it said 0 for every lookup), and
    its local hit when the connector rule cut it (``num_hit_tokens`` >= 0)."""
    if num_external_hit_tokens and 0 <= at < len(events):
        ev = events[at]
        if isinstance(ev, PrefixLookup) and ev.request_id == request_id:
            hit = ev.num_hit_tokens if num_hit_tokens < 0 else num_hit_tokens
            events[at] = msgspec.structs.replace(ev, num_hit_tokens=hit,
                                                 num_external_hit_tokens=num_external_hit_tokens)


class BlocksFreed(Event, frozen=True):
    step: int
    request_id: str
    group_id: int
    block_ids: tuple[int, ...]  # in free order (tail first)


class StaleHashLeft(Event, frozen=True):
    """A hashed block was overwritten by state that does not match its key.

    Emitted when the behaviour that would have evicted the key is switched off, so
    the stale entry is visible as data and not only as a later wrong hit.
    """

    step: int
    request_id: str
    group_id: int
    block_id: int
    block_hash: bytes | int
    num_tokens: int  # the prefix length the stale key claims


CacheEvent = BlockPublished | BlockEvicted | BlockCopied | PrefixLookup | BlocksFreed | StaleHashLeft
CacheListener = Callable[[list[CacheEvent]], None]
