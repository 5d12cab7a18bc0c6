"""Run digest: sha256 over a canonical encoding of the event stream.

Two runs with the same trace, config and seed must give the same digest; any difference
in any event (a field, the order, which step an event belongs to) changes it.

Canonical encoding (version 3). The hash starts with the line ``kvtrace-digest/3\\n``;
then each delivery is one MessagePack array (self-delimiting, so deliveries cannot run
into each other):

- cache-only (``on_cache_events``): the step's ``[event, ...]``;
- engine (``on_step``): ``[step, cache_events, engine_events]``;

and each event is the array ``[type name, field1, field2, ...]``, its fields in
declaration order (events are tagged, array-like ``msgspec.Struct``s). Values: ints in
MessagePack's shortest form, str as UTF-8, bytes (block hashes) as raw ``bin``, floats
as big-endian IEEE-754 doubles (exact, never formatted by locale), None as nil,
tuples/lists as arrays; numpy scalars are taken as Python ints/floats. MessagePack (via
msgspec, in C) is ~5x faster than any text encoding here, which matters because the
digest sees every event of a run. (Version 2 encoded dataclass events as maps keyed by
field name, behind a list of type names: the same information in twice the bytes.)

For humans, :func:`encode_event` gives a canonical *text* line per event (bytes as hex,
floats as ``float.hex()``), and :func:`first_difference` finds where two event streams
part, e.g. to explain a digest mismatch.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence

import msgspec

VERSION_LINE = b"kvtrace-digest/3\n"


def _enc_hook(obj):
    if hasattr(obj, "__index__"):  # numpy integers
        return int(obj)
    if hasattr(obj, "__float__") and hasattr(obj, "dtype"):  # numpy floats
        return float(obj)
    raise TypeError(f"digest: cannot encode {type(obj).__name__}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_encode_into = _encoder.encode_into
_FLUSH_BYTES = 1 << 20  # hash the buffer when it grows past this (sha256 is as fast on 1 MiB as on more)


class Digest:
    """A listener that folds every event it is handed into one sha256.

    Use it as a step listener (``on_step``, engine mode) or a cache listener
    (``on_cache_events``, or the object itself, cache-only mode), not both on one run.

    Deliveries are encoded back to back into one buffer that is hashed every MiB (and
    by ``hexdigest``): the bytes hashed are the same as one ``update`` per delivery, but
    an encode into a buffer costs about half of an encode that allocates its own bytes
    (the digest sees one delivery per step).
    """

    __slots__ = ("_buf", "_h", "num_events", "num_steps")

    def __init__(self) -> None:
        self._h = hashlib.sha256(VERSION_LINE)
        self._buf = bytearray()
        self.num_events = 0
        self.num_steps = 0

    def on_cache_events(self, events: Sequence) -> None:
        self.num_events += len(events)
        buf = self._buf
        _encode_into(events, buf, -1)  # -1: append at the end
        if len(buf) > _FLUSH_BYTES:
            self._flush()

    __call__ = on_cache_events  # so it can be passed to KVCacheManager.subscribe directly

    def on_step(self, batch) -> None:
        """A ``StepBatch``: the step record, then its cache events, then engine events."""
        self.num_steps += 1
        cache, engine = batch.cache_events, batch.engine_events
        self.num_events += 1 + len(cache) + len(engine)
        buf = self._buf
        _encode_into((batch.step, cache, engine), buf, -1)
        if len(buf) > _FLUSH_BYTES:
            self._flush()

    def on_events(self, events: Sequence) -> None:
        """Events delivered outside a step (e.g. a final audit)."""
        self.on_cache_events(events)

    def _flush(self) -> None:
        self._h.update(self._buf)
        self._buf.clear()

    def hexdigest(self) -> str:
        self._flush()
        return self._h.hexdigest()


# -- human-readable canonical text -----------------------------------------------------

_dumps_str = json.JSONEncoder(ensure_ascii=True).encode


def _value(v) -> str:
    t = type(v)
    if t is bool:
        return "T" if v else "F"
    if t is int:
        return str(v)
    if t is str:
        return _dumps_str(v)
    if t is bytes:
        return "x" + v.hex()
    if t is tuple or t is list:
        return "[" + ",".join(map(_value, v)) + "]"
    if v is None:
        return "~"
    if t is float:
        return v.hex()
    if hasattr(v, "__index__"):
        return str(int(v))
    if hasattr(v, "__struct_fields__"):
        return "{" + encode_event(v)[:-1] + "}"
    raise TypeError(f"digest: cannot encode {t.__name__}")


def encode_event(event) -> str:
    """``Type|field1|field2|...\\n``: ints decimal, str JSON, bytes ``x``+hex, None ``~``,
    floats ``float.hex()``, sequences ``[a,b]``."""
    return type(event).__name__ + "|" + "|".join(_value(getattr(event, f)) for f in event.__struct_fields__) + "\n"


def first_difference(a: Iterable, b: Iterable) -> tuple[int, str | None, str | None] | None:
    """(index, text of a's event, text of b's event) where two event streams first differ,
    or None when they are equal."""
    i = -1
    sentinel = object()
    ia, ib = iter(a), iter(b)
    while True:
        i += 1
        ea, eb = next(ia, sentinel), next(ib, sentinel)
        if ea is sentinel and eb is sentinel:
            return None
        ta = None if ea is sentinel else encode_event(ea)
        tb = None if eb is sentinel else encode_event(eb)
        if ta != tb:
            return i, ta, tb
