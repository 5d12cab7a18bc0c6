"""The no-cache reference: what the content after any prefix must be, from the tokens alone.

A ``PrefixOracle`` per live request answers "state and token sum after the first e
tokens" by stepping the recurrence from the nearest known point (Python ints for a
few tokens, the closed form in torch for many) and remembering the answer, so
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
import torch

from kvtrace.cache.content import P, ContentModel, fingerprint_rows, kv_sum_closed_form, kv_values
from kvtrace.cache.tokens import block_tokens

_SMALL = 48  # up to this many tokens, step the recurrence in Python


class TraceBlockMemo:
    """(namespace, block size, id) -> (c per lane, token sum): one trace block's state effect."""

    def __init__(self, model: ContentModel, max_entries: int = 1 << 20):
        self.model = model
        self.max_entries = max_entries
        self.entries: dict[tuple[int, int, int], tuple[tuple[int, ...], int]] = {}

    def get_many(self, namespace: int, block_size: int, ids) -> list[tuple[tuple[int, ...], int]]:
        entries = self.entries
        missing = [i for i in dict.fromkeys(ids) if (namespace, block_size, i) not in entries]
        if missing:
            if len(entries) + len(missing) > self.max_entries:
                entries.clear()  # bounded memory; deterministic
            m = self.model
            m.ensure(block_size + 1)
            toks = torch.from_numpy(np.stack([block_tokens(i, block_size, namespace) for i in missing]))
            rel = m.pow[torch.arange(block_size - 1, -1, -1)]  # m^(B-1-i)
            c = ((toks.unsqueeze(2) * rel.unsqueeze(0)) % P).sum(dim=1) % P  # [k, D]
            tsum = toks.sum(dim=1)
            for i, cc, ts in zip(missing, c.tolist(), tsum.tolist()):
                entries[(namespace, block_size, i)] = (tuple(cc), int(ts))
        return [entries[(namespace, block_size, i)] for i in ids]


class PrefixOracle:
    __slots__ = ("model", "request", "_pos", "_states", "_tsums")

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
            mult = [pow(m, bs, P) for m in model.multipliers]
            s, t = zero, 0
            for k, (c, ts) in enumerate(memo.get_many(request.namespace, bs, ids[:nfull])):
                s = tuple((mb * x + cc) % P for mb, x, cc in zip(mult, s, c))
                t += ts
                self._pos.append((k + 1) * bs)
                self._states.append(s)
                self._tsums.append(t)

    def _point(self, e: int) -> tuple[tuple[int, ...], int]:
        i = bisect_right(self._pos, e) - 1
        p = self._pos[i]
        if p == e:
            return self._states[i], self._tsums[i]
        s, t = self._states[i], self._tsums[i]
        tokens = self.request.get_token_ids(p, e)
        if e - p <= _SMALL:
            mults = self.model.multipliers
            for tok in tokens.tolist():
                s = tuple((m * x + tok) % P for m, x in zip(mults, s))
            t += int(tokens.sum())
        else:
            m = self.model
            st = m.advance(
                torch.tensor([s], dtype=torch.int64),
                torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64)),
                torch.arange(p, e, dtype=torch.int64),
                torch.zeros(1, dtype=torch.int64),
                torch.tensor([p], dtype=torch.int64),
                torch.zeros(1, dtype=torch.int64),
                torch.tensor([e], dtype=torch.int64),
            )
            s = tuple(st[0].tolist())
            t += int(tokens.sum())
        self._pos.insert(i + 1, e)
        self._states.insert(i + 1, s)
        self._tsums.insert(i + 1, t)
        return s, t

    def state_at(self, e: int) -> tuple[int, ...]:
        """The state lanes after the first ``e`` tokens."""
        return self._point(e)[0]

    def state_lane_sum(self, e: int) -> int:
        return sum(self._point(e)[0]) % P

    def kv_sum(self, start: int, end: int) -> int:
        """Sum of kv over positions [start, end)."""
        t_end = self._point(end)[1]
        t_start = self._point(start)[1] if start else 0
        return kv_sum_closed_form(t_end - t_start, start, end)


def expected_kv_fingerprint(tokens: np.ndarray, start: int, end: int, width: int) -> int:
    """Fingerprint of kv slots [0, end-start) of a block whose first slot is position ``start``."""
    tok = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64))
    vals = torch.zeros((1, width), dtype=torch.int64)
    vals[0, : end - start] = kv_values(tok, torch.arange(start, end, dtype=torch.int64))
    return int(fingerprint_rows(vals, torch.tensor([end - start]))[0])


def expected_state_fingerprint(state: tuple[int, ...]) -> int:
    return int(fingerprint_rows(torch.tensor([state], dtype=torch.int64))[0])
