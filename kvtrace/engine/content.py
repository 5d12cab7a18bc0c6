"""The exact int64 content model (docs/cache_semantics.md, "The exact content model").

Every value is an int64 in [0, P) with P = 2^31 - 1, and every product is reduced
mod P before anything else touches it (two residues multiply to < 2^62), so results
are bit-identical on any device and for any chunking of the same tokens.

- Attention: the token at position p stores kv = (a*token + b*p + c) mod P.
- Recurrent state: D lanes, lane d updated per token as s <- (m_d*s + token) mod P.
  Over a chunk of positions [p0, p1) this has the closed form
      s(p1) = m^(p1-p0) * s(p0) + m^(p1-1) * sum_{p0<=q<p1} token_q * m^(-q)
  so a whole step's chunks are one cumsum over precomputed power tables.
- Sampling: next token = (sum of the state lanes + sum of kv over the request's
  attention positions) mod VOCAB_SIZE.
- Fingerprints: a block's kv slots or state lanes folded with powers of R, so a stale
  block shows up as one differing integer.
"""

from __future__ import annotations

import numpy as np

from kvtrace.engine.arrays import Array, Arrays
from kvtrace.workload.lines import VOCAB_SIZE

P = 2**31 - 1
_UNREDUCED_TERMS = 1 << 13  # up to this many unreduced 2^49 terms sum below 2^63
KV_A = 1_103_515_245 % P
KV_B = 12_345_679
KV_C = 2_654_435_761 % P
FINGERPRINT_BASE = 1_000_003
# Lane multipliers: fixed primitive-looking residues, distinct per lane (lane d uses the d-th).
_LANE_MULTIPLIERS = (48_271, 69_621, 16_807, 39_373, 742_938_285, 950_706_376, 1_226_874_159, 62_089_911)


def lane_multipliers(num_lanes: int) -> tuple[int, ...]:
    base = list(_LANE_MULTIPLIERS)
    while len(base) < num_lanes:  # more lanes than listed: derive further ones deterministically
        base.append((base[-1] * 48_271 + len(base)) % P or 7)
    return tuple(base[:num_lanes])


def mulmod(x: Array, y: Array | int) -> Array:
    """(x * y) mod P for residues x, y in [0, P)."""
    return (x * y) % P


def reduce_inplace(x: Array) -> Array:
    """``x % P`` for a fresh int64 array, written into it. On numpy as x - (x // P) * P
    (the same floor-mod): numpy divides by a scalar several times faster than it takes a
    remainder, which pays on the long arrays (prompt tokens, power tables)."""
    if not isinstance(x, np.ndarray):
        x %= P  # torch: one kernel
        return x
    q = x // P
    q *= P
    x -= q
    return x


_MATMUL_TERMS = 1 << 13  # token (< 2^18) x residue (< 2^31) products: this many sum below 2^63


def modular_matmul(tokens: np.ndarray, residues: np.ndarray) -> np.ndarray:
    """``(tokens @ residues) mod P``, exact in int64: tokens ``[k, n]`` below 2^18,
    residues ``[n, ...]`` below P (summed in chunks short enough not to overflow)."""
    n = tokens.shape[1]
    out = np.zeros((tokens.shape[0], *residues.shape[1:]), dtype=np.int64)
    for i in range(0, n, _MATMUL_TERMS):
        out = (out + tokens[:, i:i + _MATMUL_TERMS] @ residues[i:i + _MATMUL_TERMS]) % P
    return out


def kv_values(tokens: Array, positions: Array) -> Array:
    """Attention content of each token at its absolute position.

    One reduction suffices: token < 2^18 and position < 2^32 keep the sum below 2^63.
    """
    return reduce_inplace(tokens * KV_A + positions * KV_B + KV_C)


def kv_sum_closed_form(token_sum: int, start: int, end: int) -> int:
    """Sum of kv over positions [start, end) given the sum of their tokens (mod P)."""
    n = end - start
    pos_sum = (start + end - 1) * n // 2
    return (KV_A * (token_sum % P) + KV_B * (pos_sum % P) + KV_C * n) % P


class ContentModel:
    """Power tables for ``num_lanes`` recurrent lanes on one device (grown on demand);
    ``device`` is a device name or the :class:`Arrays` of one (numpy for ``cpu``)."""

    def __init__(self, num_lanes: int = 4, device: Arrays | str = "cpu"):
        self.num_lanes = num_lanes
        self.arrays = xp = device if isinstance(device, Arrays) else Arrays(device)
        self.device = xp.name
        self.multipliers = lane_multipliers(num_lanes)
        self._m = xp.ints(self.multipliers)
        self._m_inv = xp.ints([pow(m, P - 2, P) for m in self.multipliers])
        self.pow = xp.full((1, num_lanes), 1)
        self.inv_pow = xp.full((1, num_lanes), 1)
        self._pow_host: np.ndarray | None = None
        self._inv_pow_t: Array | None = None
        self.ensure(4096)

    def ensure(self, n: int) -> None:
        """Make ``pow[k]`` = m^k and ``inv_pow[k]`` = m^-k available for k < n (doubling)."""
        have = self.pow.shape[0]
        if have >= n:
            return
        pw, ipw = self.pow, self.inv_pow
        while pw.shape[0] < n:
            k = pw.shape[0]
            step, istep = self._powk(self._m, k), self._powk(self._m_inv, k)
            pw = self.arrays.concat([pw, reduce_inplace(pw * step)])
            ipw = self.arrays.concat([ipw, reduce_inplace(ipw * istep)])
        self.pow, self.inv_pow = pw, ipw

    def descending_powers(self, n: int) -> np.ndarray:
        """``[n, D]`` host view whose row i is m^(n-1-i): a chunk's weights in the closed
        form (its last token weighs m^0). A view of the table's host copy, no copy."""
        self.ensure(n + 1)
        if self._pow_host is None or self._pow_host.shape[0] != self.pow.shape[0]:
            self._pow_host = self.arrays.host(self.pow)
        return self._pow_host[n - 1::-1] if n else self._pow_host[:0]

    def _inv_pow_lanes(self) -> Array:
        """``inv_pow`` lane-major ``[D, n]`` (a contiguous copy, redone when the table grows)."""
        t = self._inv_pow_t
        if t is None or t.shape[1] != self.inv_pow.shape[0]:
            t = self._inv_pow_t = self.arrays.copy(self.inv_pow.T)
        return t

    def strided_powers(self, step: int, count: int, inverse: bool = False) -> np.ndarray:
        """``[count, D]`` host array of m^(step*j) (or m^-(step*j)), j = 0..count-1."""
        self.ensure(step * (count - 1) + 1)
        table = self.inv_pow if inverse else self.pow
        return self.arrays.host(table[: step * (count - 1) + 1 : step])

    def power(self, k: int) -> np.ndarray:
        """m^k per lane, on the host."""
        return self.descending_powers(k + 1)[0]

    @staticmethod
    def _powk(base: Array, k: int) -> Array:
        out = base * 0 + 1
        b = base
        while k:
            if k & 1:
                out = (out * b) % P
            b = (b * b) % P
            k >>= 1
        return out

    # -- recurrent state ----------------------------------------------------------------
    def advance(
        self,
        start_states: Array,  # [B, D] state at each segment's start position
        tokens: Array,  # [N] all segments' tokens, concatenated
        positions: Array,  # [N] absolute position of each token
        seg_offsets: Array,  # [B] flat index of each segment's first token
        seg_starts: Array,  # [B] absolute start position of each segment
        query_seg: Array,  # [Q] segment of each query
        query_end: Array,  # [Q] absolute position the state is wanted after (> seg start)
        max_end: int | None = None,  # every position < max_end and every query end <= it, if known
        ranges: list[tuple[int, int]] | None = None,  # each segment's [start, end) positions, if known
    ) -> Array:
        """States [Q, D] after ``query_end`` tokens, for queries inside the segments.

        ``max_end`` spares reading the bound back from the device; with ``ranges`` the
        weights are slices of the power table instead of a gather. The terms are laid
        out lane-major ``[D, N]``: the running sum then runs along contiguous memory."""
        if max_end is not None:
            self.ensure(max_end + 1)
            if ranges is not None and self.arrays.is_numpy:
                return self._advance_by_dot(start_states, tokens, seg_offsets, seg_starts, query_seg, query_end)
        elif tokens.shape[0]:
            self.ensure(int(positions.max()) + 2)
        else:
            self.ensure(int(query_end.max()) + 2 if query_end.shape[0] else 1)
        n = tokens.shape[0]
        table = self._inv_pow_lanes()
        if ranges is not None and len(ranges) > 1:
            terms = self.arrays.concat([table[:, a:e] for a, e in ranges], axis=1)
            terms *= tokens
        elif ranges is not None:
            terms = table[:, ranges[0][0]:ranges[0][1]] * tokens
        else:
            terms = table[:, positions] * tokens  # each < 2^18 * 2^31 = 2^49
        if n > _UNREDUCED_TERMS:  # keep the running sum below 2^63
            reduce_inplace(terms)
        csum = self.arrays.zeros((self.num_lanes, n + 1))
        self.arrays.cumsum_into(terms, csum[:, 1:], axis=1)  # csum[:, i] = sum of terms[:, :i]
        start = seg_starts[query_seg]
        lo = seg_offsets[query_seg]
        hi = lo + (query_end - start)
        seg_sum = ((csum[:, hi] - csum[:, lo]) % P).T
        decay = self.pow[query_end - start]
        lift = self.pow[query_end - 1]
        return ((decay * start_states[query_seg]) % P + (lift * seg_sum) % P) % P

    def _advance_by_dot(self, start_states: np.ndarray, tokens: np.ndarray, seg_offsets: np.ndarray,
                        seg_starts: np.ndarray, query_seg: np.ndarray, query_end: np.ndarray) -> np.ndarray:
        """``advance`` on the host: per query s0 m^n + sum_i token_i m^(n-1-i), n the query's
        tokens, as one exact dot product with the descending powers. Fewer passes over a
        step's chunks than the running sum (which torch needs: it has no int64 matmul on
        CUDA) for the few queries a step asks (each chunk's end and its checkpoints)."""
        offsets, starts = seg_offsets.tolist(), seg_starts.tolist()
        out = np.empty((query_seg.shape[0], self.num_lanes), dtype=np.int64)
        for q, (seg, end) in enumerate(zip(query_seg.tolist(), query_end.tolist())):
            n = end - starts[seg]
            lo = offsets[seg]
            acc = modular_matmul(tokens[None, lo:lo + n], self.descending_powers(n))[0]
            out[q] = (self.pow[n] * start_states[seg] % P + acc) % P
        return out

    def step_one(self, states: Array, tokens: Array) -> Array:
        """States [B, D] after one more token each (the decode step)."""
        return (states * self._m + tokens[:, None]) % P

    def states_from_scratch(self, tokens: Array, ends: Array) -> Array:
        """States [Q, D] after ``ends[q]`` tokens of one sequence, starting from zero."""
        xp = self.arrays
        return self.advance(xp.zeros((1, self.num_lanes)), tokens, xp.arange(tokens.shape[0]), xp.zeros(1),
                            xp.zeros(1), xp.zeros(ends.shape[0]), ends)

    def step_state(self, state: list[int], token: int) -> list[int]:
        """One token on a Python-int state (the reference's decode path)."""
        return [(m * s + token) % P for m, s in zip(self.multipliers, state)]


def sample_token(state_lane_sum: int, kv_sum: int) -> int:
    return (state_lane_sum + kv_sum) % P % VOCAB_SIZE


def fingerprint_rows(xp: Arrays, values: Array, num_valid: Array | None = None, rows: Array | None = None) -> Array:
    """Fold each row [.., W] (of ``values[rows]`` if given) to one residue:
    sum_i v_i * R^i mod P over the first num_valid.

    Exact for |v| < 2^32 without reducing each term (int64 ``%`` was most of the cost):
    R^i = hi_i * 2^16 + lo_i with both halves below 2^16, so a value times a half is below
    2^48 and up to 2^15 of them sum below 2^63; a row is two plain dot products (one matmul
    on numpy), reduced once. When ``rows`` pick most of ``values``, all rows are folded
    where they lie, which is cheaper than gathering them. Rows cut short by ``num_valid``
    (few: most blocks are full) are folded again with their tail zeroed."""
    width = values.shape[-1]
    halves = _fp_power_halves(xp, width)
    if rows is None:
        fp = _fold(xp, values, halves)
    elif 2 * rows.shape[0] >= values.shape[0]:
        fp = _fold(xp, values, halves)[rows]
    else:
        fp = _fold(xp, values[rows], halves)
    if num_valid is not None:
        cut = xp.nonzero(num_valid < width)
        if cut.shape[0]:
            kept = values[cut if rows is None else rows[cut]] * (xp.arange(width)[None, :] < num_valid[cut][:, None])
            fp[cut] = _fold(xp, kept, halves)
    return fp


_FOLD_TERMS = 1 << 15  # values (< 2^32) times 16-bit halves: this many sum below 2^63


def _fold(xp: Arrays, values: Array, halves: Array) -> Array:
    """Per row, sum_i v_i * (hi_i * 2^16 + lo_i) mod P, in slices of ``_FOLD_TERMS`` columns."""
    lo: Array = 0
    hi: Array = 0
    for a in range(0, max(values.shape[-1], 1), _FOLD_TERMS):
        part, h = values[..., a:a + _FOLD_TERMS], halves[:, a:a + _FOLD_TERMS]
        if xp.is_numpy:  # torch has no int64 matmul on CUDA
            s = part @ h.T
            s_lo, s_hi = s[..., 0], s[..., 1]
        else:
            s_lo, s_hi = (part * h[0]).sum(-1), (part * h[1]).sum(-1)
        lo = (lo + s_lo % P) % P
        hi = (hi + s_hi % P) % P
    return (hi * (1 << 16) + lo) % P


_FP_CACHE: dict[tuple[int, str], Array] = {}


def _fp_power_halves(xp: Arrays, width: int) -> Array:
    """``[2, width]``: the low and high 16 bits of R^i, i < width."""
    key = (width, xp.name)
    t = _FP_CACHE.get(key)
    if t is None:
        vals = [1] * width
        for i in range(1, width):
            vals[i] = vals[i - 1] * FINGERPRINT_BASE % P
        t = _FP_CACHE[key] = xp.ints([[v & 0xFFFF for v in vals], [v >> 16 for v in vals]])
    return t
