"""The no-cache reference: what the content after any prefix must be, from the tokens alone.

A ``PrefixOracle`` per live request answers "state and token sum after the first e
tokens" by stepping the recurrence from the nearest known point (Python ints for a
few tokens, the closed form on the host for many) and remembering the answer, so
sampling at every decode step costs one token. For trace requests (hash ids), each
trace block's effect on the state is an affine map ``s -> m^B s + c`` that does not
depend on where the block sits, so ``TraceBlockMemo`` computes ``c`` once per block id
and the prompt's block boundaries come for free.

It never looks at a block table, a cache key or device storage, so a run with caching
is checked against the run without it.
"""

from __future__ import annotations

from bisect import bisect_right

import numpy as np

from kvtrace.engine.content import (
    FINGERPRINT_BASE,
    KV_A,
    KV_B,
    KV_C,
    ContentModel,
    P,
    kv_sum_closed_form,
    modular_matmul,
)
from kvtrace.workload.tokens import blocks_tokens

_SMALL = 48  # up to this many tokens, step the recurrence in Python


class TraceBlockMemo:
    """(namespace, block size, id) -> one trace block's state effect: c per lane, then the
    block's token sum, as a row of one int64 table, so a prompt's effects are one gather."""

    def __init__(self, model: ContentModel, max_entries: int = 1 << 20):
        self.model = model
        self.max_entries = max_entries
        self.rows: dict[tuple[int, int], dict[int, int]] = {}  # (namespace, block size) -> id -> row
        self.num_rows = 0
        self.table = np.zeros((1024, model.num_lanes + 1), dtype=np.int64)

    def get_many(self, namespace: int, block_size: int, ids, tokens: np.ndarray | None = None) -> np.ndarray:
        """Effects ``[len(ids), D + 1]`` of trace blocks ``ids`` (``tokens``: their concatenated
        tokens, if at hand)."""
        index = self.rows.setdefault((namespace, block_size), {})
        first: dict[int, int] = {}  # each id not held yet -> its first position in ids
        for k, i in enumerate(ids):
            if i not in index and i not in first:
                first[i] = k
        if first:
            if self.num_rows + len(first) > self.max_entries:
                index.clear()  # bounded memory; deterministic
                self.rows = {(namespace, block_size): index}
                self.num_rows = 0
                first = dict(zip(reversed(ids), range(len(ids) - 1, -1, -1)))
            missing = list(first.values())
            if tokens is not None:
                toks = tokens[: len(ids) * block_size].reshape(len(ids), block_size)[missing]
            else:
                toks = blocks_tokens([ids[k] for k in missing], block_size, namespace)
            lo, hi = self.num_rows, self.num_rows + len(missing)
            while self.table.shape[0] < hi:  # grow by doubling
                self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self.table[lo:hi, :-1] = modular_matmul(toks, self.model.descending_powers(block_size))
            self.table[lo:hi, -1] = toks.sum(axis=1)
            index.update(zip(first, range(lo, hi)))
            self.num_rows = hi
        return self.table[[index[i] for i in ids]]


class PrefixOracle:
    __slots__ = ("_pos", "_states", "_tsums", "model", "request")

    def __init__(self, model: ContentModel, request, memo: TraceBlockMemo | None = None):
        self.model = model  # a CPU content model
        self.request = request
        zero = (0,) * model.num_lanes
        self._pos: list[int] = [0]
        self._states: list[tuple[int, ...]] = [zero]
        self._tsums: list[int] = [0]
        ids = getattr(request, "trace_block_ids", None)
        if memo is not None and ids:
            bs = request.trace_block_size
            nfull = min(len(ids), request.num_prompt_tokens // bs)
            effects = memo.get_many(request.namespace, bs, ids[:nfull], request.prompt_token_ids)
            if k := effects.shape[0]:
                # s_k = M s_(k-1) + c_k with M = m^bs, all k at once: s_k = M^k sum_(j<=k) c_j M^-j
                lift = model.strided_powers(bs, k + 1)[1:]
                drop = model.strided_powers(bs, k + 1, inverse=True)[1:]
                acc = np.cumsum(effects[:, :-1] * drop % P, axis=0) % P  # K < 2^32 residues sum below 2^63
                self._states.extend(map(tuple, (lift * acc % P).tolist()))
                self._pos.extend(range(bs, (k + 1) * bs, bs))
                self._tsums.extend(np.cumsum(effects[:, -1]).tolist())

    def _extend_by_one(self, e: int) -> tuple[tuple[int, ...], int]:
        """Append the point ``e`` when it is one token past the furthest (the decode step)."""
        req = self.request
        q = e - 1 - req.num_prompt_tokens
        tok = req.output_token_ids[q] if q >= 0 else int(req.prompt_token_ids[e - 1])
        s = tuple([(m * x + tok) % P for m, x in zip(self.model.multipliers, self._states[-1])])
        t = self._tsums[-1] + tok
        self._pos.append(e)
        self._states.append(s)
        self._tsums.append(t)
        return s, t

    def _point(self, e: int) -> tuple[tuple[int, ...], int]:
        pos = self._pos
        if pos[-1] == e - 1:
            return self._extend_by_one(e)
        i = bisect_right(pos, e) - 1
        p = pos[i]
        if p == e:
            return self._states[i], self._tsums[i]
        s, t = self._states[i], self._tsums[i]
        tokens = self.request.get_token_ids(p, e)
        if e - p <= _SMALL:
            mults = self.model.multipliers
            for tok in tokens.tolist():
                s = tuple((m * x + tok) % P for m, x in zip(mults, s))
            t += int(tokens.sum())
        else:  # the closed form: s(e) = m^L s(p) + sum_i token_(p+i) m^(L-1-i), L = e - p
            L = e - p
            c = modular_matmul(np.asarray(tokens, dtype=np.int64)[None, :], self.model.descending_powers(L))[0]
            decay = self.model.power(L)
            s = tuple((int(dk) * x + int(ck)) % P for dk, x, ck in zip(decay, s, c))
            t += int(tokens.sum())
        self._pos.insert(i + 1, e)
        self._states.insert(i + 1, s)
        self._tsums.insert(i + 1, t)
        return s, t

    def point(self, e: int) -> tuple[tuple[int, ...], int]:
        """(state lanes, token sum) after the first ``e`` tokens."""
        return self._point(e)

    def state_at(self, e: int) -> tuple[int, ...]:
        """The state lanes after the first ``e`` tokens."""
        return self._point(e)[0]

    def state_lane_sum(self, e: int) -> int:
        return sum(self._point(e)[0]) % P

    def decode_token(self, e: int, num_state_groups: int, num_attention_groups: int) -> int | None:
        """The reference token after ``e`` tokens when ``e`` is one past the furthest point
        (the decode step); None otherwise."""
        if self._pos[-1] != e - 1:
            return None
        s, t = self._extend_by_one(e)
        kv = (KV_A * (t % P) + KV_B * ((e - 1) * e // 2 % P) + KV_C * e) % P
        return (sum(s) % P * num_state_groups + kv * num_attention_groups) % P

    def sample_parts(self, e: int) -> tuple[int, int]:
        """(sum of state lanes, kv sum over [0, e)) after the first ``e`` tokens."""
        s, t = self._point(e)
        return sum(s) % P, kv_sum_closed_form(t, 0, e)

    def kv_sum(self, start: int, end: int) -> int:
        """Sum of kv over positions [start, end)."""
        t_end = self._point(end)[1]
        t_start = self._point(start)[1] if start else 0
        return kv_sum_closed_form(t_end - t_start, start, end)


_FP_TABLES: dict[int, tuple[np.ndarray, list[int], list[int]]] = {}


def _fp_tables(width: int) -> tuple[np.ndarray, list[int], list[int]]:
    """R^i, and the prefix sums G0[L] = sum_{i<L} R^i and G1[L] = sum_{i<L} i*R^i (mod P)."""
    t = _FP_TABLES.get(width)
    if t is None:
        r = [1] * width
        for i in range(1, width):
            r[i] = r[i - 1] * FINGERPRINT_BASE % P
        g0, g1 = [0] * (width + 1), [0] * (width + 1)
        for i in range(width):
            g0[i + 1] = (g0[i] + r[i]) % P
            g1[i + 1] = (g1[i] + i * r[i]) % P
        t = _FP_TABLES[width] = (np.asarray(r, dtype=np.int64), g0, g1)
    return t


def expected_kv_fingerprint(tokens: np.ndarray, start: int, end: int, width: int) -> int:
    """Fingerprint of kv slots [0, end-start) of a block whose first slot is position ``start``.

    The storage fingerprint is sum_i kv_i R^i mod P with kv_i = a*t_i + b*(start+i) + c
    (mod P), which is linear, so only the token part needs the tokens.
    """
    return expected_kv_fingerprints(np.asarray(tokens, dtype=np.int64)[None, :], [start], width)[0]


def expected_kv_fingerprints(tokens: np.ndarray, starts: list[int], width: int) -> list[int]:
    """``expected_kv_fingerprint`` of blocks holding ``n`` slots each: ``tokens`` ``[k, n]``,
    the blocks' first positions ``starts``."""
    n = tokens.shape[1]
    r, g0, g1 = _fp_tables(width)
    t = modular_matmul(tokens, r[:n]).tolist()
    return [(KV_A * tt + KV_B * ((s % P) * g0[n] + g1[n]) + KV_C * g0[n]) % P for tt, s in zip(t, starts)]


def expected_state_fingerprint(state: tuple[int, ...]) -> int:
    r = _fp_tables(max(len(state), 1))[0]
    return sum(int(x) * int(y) for x, y in zip(state, r)) % P
