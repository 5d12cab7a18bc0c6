"""Deterministic span and trace ids.

Replays must store identical rows, so ids come from a seeded counter (splitmix64), not
from ``random``. The bulk span path reserves a block of ordinals per flush and computes
the ids with numpy; the SDK path (``generate_span_id``) draws from the same counter, so
spans made either way never collide. Request spans are keyed by request id instead,
because cache spans (lookups, copies) link to a request before it has finished.
"""

from __future__ import annotations

import hashlib
import numbers

import numpy as np
from opentelemetry.sdk.trace.id_generator import IdGenerator

from kvtrace.errors import ConfigError
from kvtrace.names import shown_value

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB

# Stream keys: each id kind mixes its own key into the counter.
_SPAN, _TRACE_HI, _TRACE_LO = 1, 2, 3


def _mix(x: int) -> int:
    z = (x + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser over a uint64 array (wrapping arithmetic)."""
    z = x + np.uint64(_GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
    return z ^ (z >> np.uint64(31))


# The largest seed the ids can key on (a request's key hashes it as 16 signed bytes): above
# --seed's MAX_SEED, as a capture's DP rank r takes seed + r * 2^32
MAX_ID_SEED = (1 << 127) - 1


def check_id_seed(seed: object, where: str) -> int:
    """A span-id seed (an int from 0 to MAX_ID_SEED), refused at ``where`` otherwise (a str or
    None was a TypeError or ValueError traceback, 1.5 cut to 1, 2^200 an OverflowError)."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= int(seed) <= MAX_ID_SEED:
        raise ConfigError(where, "seed", f"expected an int from 0 to 2^127 - 1, got {shown_value(seed)}")
    return int(seed)


class SeededIdGenerator(IdGenerator):
    """An OTel ``IdGenerator`` whose ids are a pure function of (seed, ordinal)."""

    def __init__(self, seed: int = 0):
        self.seed = check_id_seed(seed, "SeededIdGenerator")
        self._next = 0
        base = _mix(self.seed & _MASK64)
        self._keys = {k: _mix(base ^ k) for k in (_SPAN, _TRACE_HI, _TRACE_LO)}
        self._request_key = hashlib.blake2b(
            self.seed.to_bytes(16, "big", signed=True), digest_size=16
        ).digest()

    # -- SDK interface (one id at a time) --------------------------------------------------
    def generate_span_id(self) -> int:
        return self._span_id_at(self.reserve(1))

    def generate_trace_id(self) -> int:
        ordinal = self.reserve(1)
        hi = _mix((self._keys[_TRACE_HI] + ordinal) & _MASK64)
        lo = _mix((self._keys[_TRACE_LO] + ordinal) & _MASK64)
        return ((hi << 64) | lo) or 1

    def is_trace_id_random(self) -> bool:
        return False  # derived from a counter, not uniformly random

    def _span_id_at(self, ordinal: int) -> int:
        return _mix((self._keys[_SPAN] + ordinal) & _MASK64) or 1

    # -- bulk interface ----------------------------------------------------------------------
    def reserve(self, n: int) -> int:
        """Claim ``n`` consecutive ordinals; returns the first."""
        first = self._next
        self._next += n
        return first

    def _stream(self, key: int, ordinals: np.ndarray) -> np.ndarray:
        ids = mix64(ordinals.astype(np.uint64) + np.uint64(self._keys[key]))
        ids[ids == 0] = 1  # 0 is the invalid id
        return ids

    def span_ids(self, ordinals: np.ndarray) -> np.ndarray:
        """uint64 span ids for the given ordinals."""
        return self._stream(_SPAN, ordinals)

    def trace_ids(self, ordinals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(high, low) uint64 halves of the 128-bit trace ids for the given ordinals."""
        return self._stream(_TRACE_HI, ordinals), self._stream(_TRACE_LO, ordinals)

    def request_ids(self, request_id: str) -> tuple[int, int, int]:
        """(trace id high, low, span id) of a request's span, keyed by its id."""
        digest = hashlib.blake2b(request_id.encode("utf-8"), digest_size=24, key=self._request_key).digest()
        hi, lo, span = (int.from_bytes(digest[i:i + 8], "big") for i in (0, 8, 16))
        if not (hi or lo):  # 0 is the invalid id
            lo = 1
        return hi, lo, span or 1
