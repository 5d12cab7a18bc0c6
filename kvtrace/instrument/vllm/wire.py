"""vLLM's KV-event wire format (vllm/distributed/kv_events.py, ``ZmqEventPublisher``).

- PUB socket, multipart ``(topic, seq, payload)``: ``seq`` is an 8-byte big-endian
  counter from 0; ``payload`` is a msgpack ``EventBatch``: ``[ts, events, dp_rank]``
  (array-like; older versions omit ``dp_rank``) or, in versions without
  ``array_like``, the map ``{"ts", "events", "data_parallel_rank"}``.
- each event is a msgspec tagged struct, either array-like ``["BlockStored", ...fields]``
  or a map ``{"type": "BlockStored", ...}``. Field order: ``STORED_FIELDS`` for
  ``BlockStored``, ``REMOVED_FIELDS`` for ``BlockRemoved``; ``AllBlocksCleared`` has
  none. Older versions stop earlier; decoding takes what is there. Hashes are ints
  (64-bit, possibly negative) or bytes (at most ``MAX_HASH_BYTES``), and are decoded to
  ``hash_hex`` strings.
  Every field is checked against what the store holds (a finite ``ts`` below 2^62 ns, as a trace's times,
  ``block_size`` and ``group_idx`` within int32, token ids within int64, strings where
  strings belong): a batch with one bad value is a ``VllmWireError``, whole.
- replay: a ROUTER socket. A client sends the first missing seq as 8-byte big-endian
  (a DEALER sends ``["", seq]``). vLLM 0.33 answers one ``("", topic, seq, payload)``
  message per buffered batch with seq >= start, then ``("", "", END_SEQ, "")``; older
  versions leave the topic out: ``("", seq, payload)``, then ``("", END_SEQ, "")``.
  ``replay_frame`` reads either.
- data parallelism: DP rank r publishes at ``endpoints.dp_endpoint(endpoint, r)``
  (vLLM's ``offset_endpoint_port``), each rank with its own sequence from 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec

from kvtrace.errors import KVTraceError
from kvtrace.instrument.arrow_columns import hash_hex
from kvtrace.workload.lines import MAX_TIME_NS

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay socket's end-of-batches marker
BLOCK_STORED, BLOCK_REMOVED, ALL_BLOCKS_CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"
MEDIUM_GPU = "GPU"  # vLLM's medium of the GPU's own block pool (MEDIUM_CPU, MEDIUM_STORAGE: offloading tiers)
# A medium's first characters tell its tier apart where tiers are kept (vLLM's are "GPU", "CPU", "STORAGE"):
# the whole string, up to a message's 16 MiB, was kept once per tier and group
MEDIUM_KEY_CHARS = 32
STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                 "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


class VllmWireError(KVTraceError):
    """A ZMQ message that is not a vLLM KV event batch."""


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


_I32 = (-(1 << 31), (1 << 31) - 1)
_I64 = (-(1 << 63), (1 << 63) - 1)
# The latest ts taken: a trace's latest time (2^62 ns, the year 2116; the store's BIGINT holds
# 2^63). One batch timed past it among today's (a clock of another unit) was stored, and the
# trace --trace-out rebuilt held an arrival_ns that replay refuses, after "N requests rebuilt".
_MAX_TS_S = MAX_TIME_NS / 1e9
# Events, hashes and token ids in one batch. vLLM publishes a batch per engine step: its
# stored blocks' hashes and tokens, at most a step's batched tokens (a long-context prefill
# chunk: some 10^5). A 15 MB batch of 15M one-byte ints held the capture 47 s and 3.5 GB,
# deaf to Ctrl-C; past this a batch is a bad message, refused before its values are read.
MAX_BATCH_ELEMENTS = 1 << 21
# Events in one batch: a step's stored and removed blocks (vLLM sends each removed block as
# its own event: some 10^4 for a step evicting a long context). Checked from the events
# array's header before any event is decoded: 2M events of seven empty arrays each (16 MiB)
# were 16M objects, 8-17 s and 1.2 GB to decode before the batch was refused.
MAX_BATCH_EVENTS = 1 << 17

# Only what is read is decoded, and no deeper than it can be: the envelope and each event
# with their values left raw (a field kvtrace does not read, extra_keys say, is never
# decoded), each read value as a scalar or a list of scalars (deeper nesting is refused at
# its first array, before any of it is built: 16M empty arrays inside one event's field,
# or as the ts, were decoded whole, 1.2 GB). Envelopes and events of more fields than any
# vLLM sends (a newer one's trailing fields are still taken) are refused from their header.
_MAX_FIELDS = 64
_Fields = (Annotated[list[msgspec.Raw], msgspec.Meta(max_length=_MAX_FIELDS)]
           | Annotated[dict[str, msgspec.Raw], msgspec.Meta(max_length=_MAX_FIELDS)])
_BATCH = msgspec.msgpack.Decoder(_Fields)
_EVENTS = msgspec.msgpack.Decoder(Annotated[list[msgspec.Raw], msgspec.Meta(max_length=MAX_BATCH_EVENTS)])
_EVENT = msgspec.msgpack.Decoder(_Fields)


def _fields_problem(err: msgspec.ValidationError) -> str | None:
    """What a refused envelope or event is, when its header said so: too many fields, or
    a map keyed by other than strings."""
    text = str(err)
    if "length" in text:
        return f"more than {_MAX_FIELDS} fields"
    if "Expected `str`" in text:
        return "a map keyed by other than strings"
    return None
_Scalar = int | float | str | bool | None
_SCALAR = msgspec.msgpack.Decoder(_Scalar)  # (checked by the field's own reader below: its words)
_DECODERS = {name: msgspec.msgpack.Decoder(kind) for name, kind in {
    "block_hashes": list[int | bytes] | None,  # (vLLM's hashes: ints, or bytes)
    "parent_block_hash": int | bytes | None,
    "token_ids": list[_Scalar] | None,
}.items()}
# the fields each event kind's decoding reads (the others stay raw)
_READ = {BLOCK_STORED: frozenset(("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                                  "lora_name", "group_idx", "kv_cache_spec_kind")),
         BLOCK_REMOVED: frozenset(("block_hashes", "medium", "group_idx"))}
_ORDER = {BLOCK_STORED: STORED_FIELDS, BLOCK_REMOVED: REMOVED_FIELDS}


# The longest bytes hash taken: vLLM's are 32 bytes (sha256, sha256_cbor) or 16 (xxhash's
# xxh3_128). Longer ones were stored whole, and each kept as a chain-depth key until 2^21
# of them: 40 batches of fifteen 1 MiB hashes held 1.5 GB, growing by 30 MB a batch.
MAX_HASH_BYTES = 64


def _hash(h: Any, what: str = "block hash") -> str:
    """A vLLM block hash (int or bytes) as ``hash_hex``; anything else is a wire error."""
    if isinstance(h, (bytes, bytearray)) and len(h) > MAX_HASH_BYTES:
        raise VllmWireError(f"vLLM KV event: {what} of {len(h):,} bytes (vLLM's are at most 32; more than "
                            f"{MAX_HASH_BYTES} is refused)")
    if isinstance(h, (bytes, bytearray)) or (isinstance(h, int) and not isinstance(h, bool)):
        return hash_hex(h)
    raise VllmWireError(f"vLLM KV event: {what} must be int or bytes, got {type(h).__name__}")


def _int(v: Any, what: str, lo: int, hi: int) -> int | None:
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise VllmWireError(f"vLLM KV event: {what} must be an integer from {lo} to {hi}, got {v!r}"[:200])
    return v


def _str(v: Any, what: str) -> str | None:
    if v is not None and not isinstance(v, str):
        raise VllmWireError(f"vLLM KV event: {what} must be a string, got {type(v).__name__}")
    return v


def _ts(v: Any) -> float:
    """A batch's ts (unix seconds) that the store can hold as ns."""
    if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= _MAX_TS_S and \
            (not isinstance(v, float) or math.isfinite(v)):
        seconds = float(v)
        # in ns as the rows make it (round(ts * 1e9)): the largest seconds below the bound
        # may round up to it (below 2^63 they did, which the store refused naming no ts)
        if round(seconds * 1e9) < MAX_TIME_NS:
            return seconds
    raise VllmWireError(f"vLLM KV event batch: ts must be seconds from 0 to {_MAX_TS_S:.4g}, got {v!r}"[:200])


def _hashes(v: Any) -> list[str]:
    if v is None:
        return []
    if not isinstance(v, (list, tuple)):
        raise VllmWireError(f"vLLM KV event: block_hashes must be a list, got {type(v).__name__}")
    return [_hash(h) for h in v]


def _token_ids(v: Any) -> list[int] | None:
    if v is None:
        return None
    if not isinstance(v, (list, tuple)):
        raise VllmWireError(f"vLLM KV event: token_ids must be a list, got {type(v).__name__}")
    for t in v:
        _int(t, "token id", *_I64)
    return list(v)


def _shallow(raw: msgspec.Raw, what: str) -> Any:
    """One read value, as deep as its field can be: a scalar, or a list of them (a deeper
    value is refused at its first array or map, none of it built)."""
    try:
        return _DECODERS.get(what, _SCALAR).decode(raw)
    except msgspec.ValidationError as err:
        raise VllmWireError(f"vLLM KV event batch: {what}: {err}"[:200]) from None
    except (msgspec.DecodeError, RecursionError) as err:
        raise VllmWireError(f"vLLM KV event batch: not msgpack ({err})") from None


def _event_fields(raw: msgspec.Raw) -> tuple[str, dict[str, Any]]:
    """An event's tag and the fields its kind reads, decoded (the others left raw)."""
    try:
        event = _EVENT.decode(raw)
    except msgspec.ValidationError as err:
        problem = _fields_problem(err)
        got = problem if problem is not None else type(_shallow(raw, "event")).__name__
        raise VllmWireError(f"vLLM KV event: expected a tagged array or map, got {got}") from None
    except (msgspec.DecodeError, RecursionError) as err:
        raise VllmWireError(f"vLLM KV event batch: not msgpack ({err})") from None
    if isinstance(event, dict):
        tag = _shallow(event["type"], "type") if "type" in event else None
        if not isinstance(tag, str):  # (a tag this version does not know is a string too)
            raise VllmWireError(f"vLLM KV event: a map whose type is {tag!r}, not an event kind"[:200])
        read = _READ.get(tag, frozenset())
        return tag, {k: _shallow(v, k) for k, v in event.items() if k in read}
    tag = _shallow(event[0], "type") if event else None
    if not isinstance(tag, str):
        raise VllmWireError("vLLM KV event: expected a tagged array or map, got list")
    read = _READ.get(tag, frozenset())
    return tag, {k: _shallow(v, k) for k, v in zip(_ORDER.get(tag, ()), event[1:]) if k in read}


def _decode_event(tag: str, f: dict[str, Any]) -> KVEvent | None:
    if tag == BLOCK_STORED:
        parent = f.get("parent_block_hash")
        return KVEvent(
            BLOCK_STORED, _hashes(f.get("block_hashes")),
            None if parent is None else _hash(parent, "parent_block_hash"),
            _token_ids(f.get("token_ids")), _int(f.get("block_size"), "block_size", 0, _I32[1]),
            _int(f.get("lora_id"), "lora_id", *_I64), _str(f.get("medium"), "medium"),
            _str(f.get("lora_name"), "lora_name"), _int(f.get("group_idx"), "group_idx", *_I32),
            _str(f.get("kv_cache_spec_kind"), "kv_cache_spec_kind"),
        )
    if tag == BLOCK_REMOVED:
        return KVEvent(BLOCK_REMOVED, _hashes(f.get("block_hashes")), medium=_str(f.get("medium"), "medium"),
                       group_idx=_int(f.get("group_idx"), "group_idx", *_I32))
    if tag == ALL_BLOCKS_CLEARED:
        return KVEvent(ALL_BLOCKS_CLEARED)
    return None  # an event kind this version does not know


def decode_kv_batch(payload: bytes) -> tuple[KVEventBatch, int]:
    """Decode one payload; returns the batch and the number of unknown events skipped.

    Raises ``VllmWireError`` for anything that is not an event batch the store can hold."""
    try:
        envelope = _BATCH.decode(payload)
    except msgspec.ValidationError as err:  # (another value than an array or a string-keyed map of 64 fields)
        problem = _fields_problem(err)
        got = f": {problem}" if problem else ""
        raise VllmWireError(f"vLLM KV event batch: expected [ts, events, dp_rank] or a map of string keys{got}"
                            ) from None
    except (msgspec.DecodeError, RecursionError) as err:
        raise VllmWireError(f"vLLM KV event batch: not msgpack ({err})") from None
    if isinstance(envelope, dict):
        parts = envelope.get("ts"), envelope.get("events"), envelope.get("data_parallel_rank")
    elif len(envelope) >= 2:
        parts = envelope[0], envelope[1], envelope[2] if len(envelope) > 2 else None
    else:
        raise VllmWireError("vLLM KV event batch: expected [ts, events, dp_rank] or a map")
    ts, rank = (None if p is None else _shallow(p, what)
                for p, what in ((parts[0], "ts"), (parts[2], "data_parallel_rank")))
    seconds = _ts(ts)
    rank = _int(rank, "data_parallel_rank", 0, _I32[1])
    events = _events(parts[1])
    elements = len(events)
    decoded = []
    try:
        for raw_event in events:  # one at a time: the cap is met before the rest is decoded
            tag, fields = _event_fields(raw_event)
            elements += sum(len(v) for v in fields.values() if isinstance(v, list))
            if elements > MAX_BATCH_ELEMENTS:
                raise VllmWireError(f"vLLM KV event batch: events, hashes and token ids: more than "
                                    f"{MAX_BATCH_ELEMENTS:,} in one batch")
            decoded.append(_decode_event(tag, fields))
    except (TypeError, KeyError, IndexError, AttributeError) as err:
        raise VllmWireError(f"vLLM KV event: malformed fields ({err})") from None
    kept = [e for e in decoded if e is not None]
    return KVEventBatch(seconds, kept, rank), len(decoded) - len(kept)


def _events(raw: msgspec.Raw | None) -> list[msgspec.Raw]:
    """The events array, each event undecoded; its length is read from its header first."""
    if raw is None:
        raise VllmWireError("vLLM KV event batch: events must be a list, got NoneType")
    try:
        return _EVENTS.decode(raw)
    except msgspec.ValidationError as err:
        if "length" in str(err):
            raise VllmWireError(f"vLLM KV event batch: more than {MAX_BATCH_EVENTS:,} events in one batch (a step "
                                "publishes some thousands)") from None
        try:
            got = type(_shallow(raw, "events")).__name__
        except VllmWireError:
            got = "dict"  # (a map, or an array of arrays: not decoded to say which)
        raise VllmWireError(f"vLLM KV event batch: events must be a list, got {got}") from None
    except (msgspec.DecodeError, RecursionError) as err:
        raise VllmWireError(f"vLLM KV event batch: not msgpack ({err})") from None


def replay_frame(frames: list[bytes]) -> tuple[int, bytes] | None:
    """One message from the replay socket (as a DEALER receives it) -> (seq, payload), or
    None for the end marker. Both layouts (see the module docstring); anything else is a
    VllmWireError."""
    if frames and frames[0] == b"":
        frames = frames[1:]  # the DEALER's empty delimiter
    if len(frames) == 3:  # newer vLLM (0.33 here): topic, seq, payload
        frames = frames[1:]
    if len(frames) != 2 or len(frames[0]) != 8:
        raise VllmWireError(f"vLLM replay: expected [topic,] seq, payload frames, got {len(frames)} frames")
    if frames[0] == END_SEQ:
        return None
    return int.from_bytes(frames[0], "big"), frames[1]
