"""Stale-hash audit: every cached key's block must hold the content its prefix defines.

When a key is published (``BlockPublished``), the expected fingerprint of its content
is computed from the publishing request's tokens (kv slots of the block's range for
attention, the state after ``num_tokens`` for Mamba). An audit reads the actual blocks
from device storage for every entry of ``cached_entries()`` and reports each mismatch
once. Keys are content-derived, so the expectation does not depend on who published.

Attention content changes only through the storage's writes and copies, each of which
stamps the blocks it touches: an audit reads an attention block again only when its stamp
moved since it last read it (the verdict is otherwise the same), so an audit costs what
changed, not the whole cache.
"""

from __future__ import annotations

import numpy as np

from kvtrace.cache import CacheConfig, MambaSpec
from kvtrace.cache.events import BlockPublished
from kvtrace.cache.hashing import BlockHash
from kvtrace.engine.events import StaleHashFound
from kvtrace.engine.reference import expected_kv_fingerprints, expected_state_fingerprint
from kvtrace.engine.storage import DeviceStorage


class StaleHashAuditor:
    guess_positions = True  # False: every key is looked up in the request's index (tests compare both)

    def __init__(self, cache_config: CacheConfig, storage: DeviceStorage, oracle_for):
        self.cache_config = cache_config
        self.storage = storage
        self.oracle_for = oracle_for  # request -> PrefixOracle (the worker's reference)
        self.is_state = [isinstance(s, MambaSpec) for s in cache_config.groups]
        self.block_size = [s.block_size for s in cache_config.groups]
        self.hbs = cache_config.hash_block_size
        self.expected: dict[tuple[int, BlockHash], tuple[int, int]] = {}  # (group, hash) -> (num_tokens, fp)
        self._hash_index: dict[str, tuple[int, dict[BlockHash, int]]] = {}
        self._reported: set[tuple[int, BlockHash, int]] = set()
        self._checked: dict[tuple[int, BlockHash, int], tuple[int, int]] = {}
        self.num_stale = 0
        self.num_unverified = 0

    def forget_request(self, request_id: str) -> None:
        self._hash_index.pop(request_id, None)

    def _num_tokens_of(self, request, block_hash: BlockHash) -> int | None:
        hashes = request.block_hashes
        cached = self._hash_index.get(request.request_id)
        if cached is None or cached[0] != len(hashes):
            index = cached[1] if cached is not None else {}
            for i in range(len(index), len(hashes)):
                index.setdefault(hashes[i], i)
            cached = (len(hashes), index)
            self._hash_index[request.request_id] = cached
        pos = cached[1].get(block_hash)
        return None if pos is None else (pos + 1) * self.hbs

    def on_published(self, events, requests: dict) -> None:
        """Record expectations for this step's publishes (requests still hold their tokens)."""
        kv_rows: dict[tuple[int, int], list] = {}  # (group, slots) -> [(key, num_tokens, start, tokens)]
        for ev in events:
            if not isinstance(ev, BlockPublished):
                continue
            req = requests.get(ev.request_id)
            if req is None:
                continue
            g = ev.group_id
            # Where each key sits in the request's hashes: first the guess that the keys are
            # a block apart and the last stands for ev.num_tokens (full blocks published in a
            # row, most events), checked; else the request's index of its hashes.
            hashes = req.block_hashes
            step = self.block_size[g]
            last = len(ev.block_hashes) - 1
            for j, h in enumerate(ev.block_hashes):
                if (g, h) in self.expected:  # keys are content-derived: known once, known for good
                    continue
                guess = (ev.num_tokens - (last - j) * step) // self.hbs - 1 if self.guess_positions else -1
                if 0 <= guess < len(hashes) and hashes[guess] == h:  # (a hash chain holds a key once)
                    ntok: int | None = (guess + 1) * self.hbs
                else:
                    ntok = self._num_tokens_of(req, h)
                if ntok is None or ntok > req.num_tokens:
                    continue
                if self.is_state[g]:
                    fp = expected_state_fingerprint(self.oracle_for(req).state_at(ntok))
                    self.expected[(g, h)] = (ntok, fp)
                else:
                    start = (ntok - 1) // self.block_size[g] * self.block_size[g]
                    kv_rows.setdefault((g, ntok - start), []).append(
                        ((g, h), ntok, start, req.get_token_ids(start, ntok))
                    )
                    self.expected[(g, h)] = (ntok, -1)  # its fingerprint follows below
        for (g, _), rows in kv_rows.items():  # one product per group and block fill
            fps = expected_kv_fingerprints(np.stack([r[3] for r in rows]), [r[2] for r in rows], self.block_size[g])
            for (key, ntok, _, _), fp in zip(rows, fps):
                self.expected[key] = (ntok, fp)

    def audit(self, entries, step: int, time_ns: int) -> list[StaleHashFound]:
        """Compare every cached key's block with its expected fingerprint.

        An attention block is read again only when something wrote or copied into it since
        it last matched (the storage stamps every write): its content, and so the verdict,
        is otherwise what it was. State blocks are few and read every time."""
        by_group: dict[int, list[tuple[bytes, int, int]]] = {}
        for g, h, blk, ntok in entries:
            by_group.setdefault(g, []).append((h, blk, ntok))
        found: list[StaleHashFound] = []
        live: dict[tuple[int, bytes | int], tuple[int, int]] = {}
        checked: dict[tuple[int, BlockHash, int], tuple[int, int]] = {}
        xp = self.storage.arrays
        for g in sorted(by_group):
            bs = self.block_size[g]
            rows = []
            for h, blk, ntok in by_group[g]:
                exp = self.expected.get((g, h))
                if exp is None or exp[0] != ntok:
                    self.num_unverified += 1
                    continue
                live[(g, h)] = exp
                rows.append((h, blk, ntok, exp))
            stamp = self.storage.stamp[g]
            if stamp is not None and rows:
                stamps = xp.host(stamp[xp.ints([r[1] for r in rows])]).tolist()
                before = self._checked
                changed = []
                for r, at in zip(rows, stamps):
                    key, seen = (g, r[0], r[1]), (r[2], at)
                    checked[key] = seen
                    if before.get(key) != seen:
                        changed.append(r)
                rows = changed
            if not rows:
                continue
            valid = [ntok - (ntok - 1) // bs * bs for _, _, ntok, _ in rows]
            actual = self.storage.fingerprints(g, [blk for _, blk, _, _ in rows],
                                               None if self.is_state[g] else valid)
            for (h, blk, ntok, exp), fp in zip(rows, actual):
                if exp[1] != fp and (g, h, blk) not in self._reported:
                    self._reported.add((g, h, blk))
                    self.num_stale += 1
                    found.append(StaleHashFound(step, time_ns, g, blk, h, ntok, exp[1], fp, None))
        self.expected = live  # keep expectations only for keys still cached
        self._checked = checked  # (group, key, block) -> (tokens, stamp) when last read
        return found
