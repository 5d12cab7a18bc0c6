"""Small Arrow builders for the bulk span path (vectorised; no per-row Python where avoidable)."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import cast

import numpy as np
import pyarrow as pa

from kvtrace.numeric import sorted_percentile

_I64 = pa.int64()
_STR = pa.string()
_HEX_DIGITS = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
# byte -> its two hex digits, as one uint16 in memory order (one gather per byte)
_HEX_PAIRS = (np.stack([_HEX_DIGITS[np.arange(256) >> 4], _HEX_DIGITS[np.arange(256) & 15]], axis=1)
              .copy().view(np.uint16).reshape(256))


def hex_fixed(raw: np.ndarray) -> np.ndarray:
    """(n, k) uint8 -> (n, 2k) uint8 of lowercase hex digits."""
    return _HEX_PAIRS[raw].view(np.uint8).reshape(raw.shape[0], raw.shape[1] * 2)


def strings_from_fixed(digits: np.ndarray) -> pa.StringArray:
    """(n, w) uint8 ASCII rows -> StringArray of n strings of width w (zero-copy layout)."""
    n, width = digits.shape
    offsets = np.arange(0, n * width + 1, width, dtype=np.int32)
    data = np.ascontiguousarray(digits).reshape(-1)
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(data))


def constant(value, n: int, type_: pa.DataType = _STR) -> pa.Array:
    """The same value on each of n rows."""
    return pa.repeat(pa.scalar(value, type_), n)


def offsets_from_lengths(lengths: Sequence[int]) -> np.ndarray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    offsets[1:] = np.cumsum(np.asarray(lengths, dtype=np.int64))
    return offsets


class Ragged:
    """A sequence of int tuples as one flat int64 array and offsets, and what several
    columns compute from it (a request's ITL list, mean, percentiles and max): made once
    per value list (``of``), sorted once per list for all its percentiles.

    A value beyond int64 raises OverflowError, as pyarrow's conversion does.
    """

    __slots__ = ("_sorted", "flat", "lengths", "offsets", "values")
    _last: Ragged | None = None  # the list last seen: the columns of one segment share it

    def __init__(self, values: Sequence[Sequence[int]]):
        n = len(values)
        self.values = values
        self.lengths = np.fromiter(map(len, values), np.int64, count=n)
        self.offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=self.offsets[1:])
        self.flat = np.fromiter(chain.from_iterable(values), np.int64, count=int(self.offsets[-1]))
        self._sorted: np.ndarray | None = None

    @classmethod
    def of(cls, values: Sequence[Sequence[int]]) -> Ragged:
        """The ``Ragged`` of this very list (identity: the builder hands each column of a
        segment the same value list; the cache holds it, so its id is not reused). For
        lists made once and never changed, as the builder's are; others use ``Ragged``."""
        last = cls._last
        if last is None or last.values is not values:
            last = cls._last = cls(values)
        return last

    def list_array(self) -> pa.ListArray:
        return pa.ListArray.from_arrays(pa.array(self.offsets.astype(np.int32)), pa.array(self.flat))

    @property
    def exact_in_float(self) -> bool:
        """Every sum and difference of one list's values is an exact float64 (below 2**53),
        so numpy's float arithmetic gives Python's results to the last bit."""
        if not len(self.flat):
            return True
        largest = max(abs(int(self.flat.max())), abs(int(self.flat.min())))  # (np.abs wraps at -2**63)
        bound = largest * max(2, int(self.lengths.max()))
        return bound < (1 << 53)

    def _nonempty_starts(self) -> tuple[np.ndarray, np.ndarray]:
        has = self.lengths > 0
        return has, self.offsets[:-1][has]

    def means(self) -> pa.Array:
        """``sum(v) / len(v)`` per list (float64; NULL for an empty one)."""
        if not self.exact_in_float:
            return pa.array([sum(v) / len(v) if len(v) else None for v in self.values], pa.float64())
        has, starts = self._nonempty_starts()
        out = np.zeros(len(self.values), dtype=np.float64)
        if len(starts):  # (reduceat over the non-empty lists' starts: each runs to the next)
            out[has] = np.add.reduceat(self.flat, starts).astype(np.float64) / self.lengths[has]
        return pa.array(out, pa.float64(), mask=~has)

    def maxima(self) -> pa.Array:
        """``max(v)`` per list (int64; NULL for an empty one)."""
        has, starts = self._nonempty_starts()
        out = np.zeros(len(self.values), dtype=np.int64)
        if len(starts):
            out[has] = np.maximum.reduceat(self.flat, starts)
        return pa.array(out, pa.int64(), mask=~has)

    def percentiles(self, q: float) -> pa.Array:
        """``numeric.sorted_percentile(sorted(v), q)`` per list, the same floats (float64;
        NULL for an empty one)."""
        if not self.exact_in_float:
            return pa.array([float(sorted_percentile(sorted(v), q)) if len(v) else None for v in self.values],
                            pa.float64())
        if self._sorted is None:
            self._sorted = self.flat.copy()
            for a, b in zip(self.offsets[:-1].tolist(), self.offsets[1:].tolist()):
                if b - a > 1:
                    self._sorted[a:b].sort()
        has = self.lengths > 0
        if not has.any():
            return pa.nulls(len(self.values), pa.float64())
        n = np.where(has, self.lengths, 1)
        pos = (n - 1).astype(np.float64) * (q / 100.0)  # sorted_percentile's float ops, one per list
        lo = pos.astype(np.int64)
        hi = np.minimum(lo + 1, n - 1)
        start = self.offsets[:-1]
        a = self._sorted[np.where(has, start + lo, 0)]  # (an empty list reads any value: masked below)
        b = self._sorted[np.where(has, start + hi, 0)]
        t = pos - lo.astype(np.float64)
        step = (b - a).astype(np.float64)
        out = np.where(t < 0.5, a.astype(np.float64) + step * t, b.astype(np.float64) - step * (1.0 - t))
        return pa.array(out, pa.float64(), mask=~has)


def int_lists(lists: Sequence[Sequence[int]]) -> pa.ListArray:
    """list<int64> from a sequence of int tuples (through numpy: no interim Python list;
    a value beyond int64 raises OverflowError, as pyarrow's conversion does)."""
    return Ragged(lists).list_array()


_MASK64 = (1 << 64) - 1


def hash_hex(h: bytes | bytearray | int) -> str:
    """A block hash as lowercase hex: the one rendering of hashes in kvtrace's spans.

    - bytes (kvtrace's sha256_cbor / xxhash keys, vLLM's bytes hashes): their hex;
    - ints that fit in 64 bits, signed or not (vLLM's int hashes, which may be negative;
      cache-only replay's trace-id keys): 16 hex digits of their 64-bit two's
      complement, as vLLM's KV events are shown, so -1 and 2**64 - 1 are the same key;
    - wider ints (scoped or interned cache-only keys): plain signed hex (``-1f``),
      never truncated, so distinct keys stay distinct.

    :func:`hex_strings` is the vectorised form and gives the same strings.
    """
    if type(h) is bytes:
        return h.hex()
    if isinstance(h, (bytes, bytearray)):
        return bytes(h).hex()
    if -(1 << 63) <= h <= _MASK64:
        return f"{h & _MASK64:016x}"
    return f"{h:x}"


def hex_strings(hashes: Sequence[bytes | int]) -> pa.StringArray:
    """:func:`hash_hex` of each hash; vectorised when all are bytes of one width or int64s."""
    if not hashes:
        return pa.array([], pa.string())
    first = hashes[0]
    if type(first) is int:
        try:
            raw = np.fromiter(hashes, dtype=np.int64, count=len(hashes))
        except (OverflowError, TypeError, ValueError):  # (ValueError: bytes among the ints)
            return pa.array([hash_hex(h) for h in hashes], pa.string())
        return strings_from_fixed(hex_fixed(raw.astype(">i8").view(np.uint8).reshape(-1, 8)))
    blobs = cast(Sequence[bytes], hashes)  # bytes from here on (a stray int: TypeError below)
    width = len(blobs[0])
    try:
        blob = b"".join(blobs)
    except TypeError:  # bytes and ints mixed
        return pa.array([hash_hex(h) for h in hashes], pa.string())
    # all widths equal <=> none is shorter than the first and they sum to n * width
    if width and len(blob) == width * len(blobs) and min(map(len, blobs)) == width:
        digits = np.frombuffer(blob, dtype=np.uint8).reshape(-1, width)
        return strings_from_fixed(hex_fixed(digits))
    return pa.array([h.hex() for h in blobs], pa.string())


def hex_lists(lists: Sequence[Sequence[bytes | int]]) -> pa.ListArray:
    """list<string> of :func:`hash_hex` hashes from a sequence of hash tuples."""
    lengths = list(map(len, lists))
    flat = hex_strings(list(chain.from_iterable(lists)))
    return pa.ListArray.from_arrays(pa.array(offsets_from_lengths(lengths)), flat)


def optional_hex(values: Sequence[bytes | int | None]) -> pa.StringArray:
    return pa.array([None if v is None else hash_hex(v) for v in values], pa.string())


def single_item_lists(values: pa.Array) -> pa.ListArray:
    """Wrap each value into a one-element list."""
    return pa.ListArray.from_arrays(pa.array(np.arange(len(values) + 1, dtype=np.int32)), values)


def constant_map(items: Sequence[tuple[str, str]], n: int, type_: pa.MapType) -> pa.MapArray:
    """The same string map on each of n rows."""
    k = len(items)
    offsets = pa.array(np.arange(0, (n + 1) * k, k, dtype=np.int32) if k else np.zeros(n + 1, np.int32))
    pick = pa.array(np.tile(np.arange(k, dtype=np.int64), n))
    keys = pa.array([key for key, _ in items], pa.string()).take(pick)
    vals = pa.array([val for _, val in items], pa.string()).take(pick)
    return pa.MapArray.from_arrays(offsets, keys, vals, type=type_)
