"""vLLM's KV-event wire format (vllm/distributed/kv_events.py, ``ZmqEventPublisher``).

- PUB socket, multipart ``(topic, seq, payload)``: ``seq`` is an 8-byte big-endian
  counter from 0; ``payload`` is a msgpack ``EventBatch``: ``[ts, events, dp_rank]``
  (array-like; older versions omit ``dp_rank``) or, in versions without
  ``array_like``, the map ``{"ts", "events", "data_parallel_rank"}``.
- each event is a msgspec tagged struct, either array-like ``["BlockStored", ...fields]``
  or a map ``{"type": "BlockStored", ...}``. Field order: ``STORED_FIELDS`` for
  ``BlockStored``, ``REMOVED_FIELDS`` for ``BlockRemoved``; ``AllBlocksCleared`` has
  none. Older versions stop earlier; decoding takes what is there. Hashes are ints
  (64-bit, possibly negative) or bytes, and are decoded to ``hash_hex`` strings.
- replay: a ROUTER socket. A client sends the first missing seq as 8-byte big-endian
  (a DEALER sends ``["", seq]``); the server answers one ``("", seq, payload)`` message
  per buffered batch with seq >= start, then ``("", END_SEQ, "")``.
- data parallelism: DP rank r publishes at ``dp_endpoint(endpoint, r)`` (vLLM's
  ``offset_endpoint_port``), each rank with its own sequence from 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvtrace.errors import ConfigError, KVTraceError
from kvtrace.instrument.arrow_columns import hash_hex

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay socket's end-of-batches marker
BLOCK_STORED, BLOCK_REMOVED, ALL_BLOCKS_CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"
STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                 "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


class VllmWireError(KVTraceError):
    """A ZMQ message that is not a vLLM KV event batch."""


def dp_endpoint(endpoint: str | None, rank: int, option: str = "--endpoint") -> str | None:
    """Where vLLM's DP rank ``rank`` publishes when configured with ``endpoint`` (its
    ``ZmqEventPublisher.offset_endpoint_port``): a tcp port plus the rank; an ipc or
    inproc name with ``_dp{rank}`` appended. Rank 0 and None are unchanged."""
    if not endpoint:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{rank}" if rank else endpoint
    base, sep, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not sep or not port.isdigit() or base == "tcp:/":
        raise ConfigError(option, endpoint, "expected tcp://HOST:PORT, ipc://PATH or inproc://NAME")
    if rank == 0:
        return endpoint
    if int(port) + rank > 65_535:
        raise ConfigError(option, endpoint, f"port {port} + DP rank {rank} exceeds 65535")
    return f"{base}:{int(port) + rank}"


@dataclass(slots=True)
class KVEvent:
    kind: str  # BLOCK_STORED | BLOCK_REMOVED | ALL_BLOCKS_CLEARED
    block_hashes: list[str] = field(default_factory=list)  # hash_hex strings
    parent_block_hash: str | None = None
    token_ids: list[int] | None = None
    block_size: int | None = None
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


@dataclass(slots=True)
class KVEventBatch:
    ts: float
    events: list[KVEvent]
    dp_rank: int | None = None


def _hash(h: Any) -> str:
    """A vLLM block hash (int or bytes) as ``hash_hex``; anything else is a wire error."""
    if isinstance(h, (bytes, bytearray)) or (isinstance(h, int) and not isinstance(h, bool)):
        return hash_hex(h)
    raise VllmWireError(f"vLLM KV event: block hash must be int or bytes, got {type(h).__name__}")


def _fields(raw: Any, names: tuple[str, ...]) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    return dict(zip(names, raw[1:]))  # array-like: the tag, then fields in order


def _decode_event(raw: Any) -> KVEvent | None:
    if isinstance(raw, dict):
        tag = raw.get("type")
    elif isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        tag = raw[0]
    else:
        raise VllmWireError(f"vLLM KV event: expected a tagged array or map, got {type(raw).__name__}")
    if tag == BLOCK_STORED:
        f = _fields(raw, STORED_FIELDS)
        parent = f.get("parent_block_hash")
        tokens = f.get("token_ids")
        return KVEvent(
            BLOCK_STORED, [_hash(h) for h in f.get("block_hashes") or ()],
            None if parent is None else _hash(parent),
            list(tokens) if tokens is not None else None, f.get("block_size"), f.get("lora_id"),
            f.get("medium"), f.get("lora_name"), f.get("group_idx"), f.get("kv_cache_spec_kind"),
        )
    if tag == BLOCK_REMOVED:
        f = _fields(raw, REMOVED_FIELDS)
        return KVEvent(BLOCK_REMOVED, [_hash(h) for h in f.get("block_hashes") or ()],
                       medium=f.get("medium"), group_idx=f.get("group_idx"))
    if tag == ALL_BLOCKS_CLEARED:
        return KVEvent(ALL_BLOCKS_CLEARED)
    return None  # an event kind this version does not know


def decode_kv_batch(payload: bytes) -> tuple[KVEventBatch, int]:
    """Decode one payload; returns the batch and the number of unknown events skipped.

    Raises ``VllmWireError`` for anything that is not an event batch."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as err:
        raise VllmWireError(f"vLLM KV event batch: not msgpack ({err})") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, (list, tuple)) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    else:
        raise VllmWireError("vLLM KV event batch: expected [ts, events, dp_rank] or a map")
    if not isinstance(ts, (int, float)) or not isinstance(events, (list, tuple)):
        raise VllmWireError("vLLM KV event batch: bad ts or events")
    try:
        decoded = [_decode_event(e) for e in events]
    except (TypeError, KeyError, IndexError) as err:
        raise VllmWireError(f"vLLM KV event: malformed fields ({err})") from None
    kept = [e for e in decoded if e is not None]
    return KVEventBatch(float(ts), kept, rank), len(decoded) - len(kept)
