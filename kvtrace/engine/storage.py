"""Device storage for block content: one int64 array per KV cache group.

The manager never touches this; the worker does. Attention groups hold kv slots
``[num_blocks, block_size]`` plus a per-block sum of all its slots (kept current on
every write and copy, so sampling reads a long context as a few block sums); Mamba
groups hold state lanes ``[num_blocks, D]``. Values follow ``kvtrace.cache.content``.
Copy-on-write is a device copy. The arrays are numpy on the CPU, torch on a GPU
(:mod:`kvtrace.engine.arrays`).

Each group's tensor has a row per block of the pool the group allocates from: with the
shared pool (vLLM's layout) every group's tensor spans all ``num_gpu_blocks`` ids, as a
block of the pool may serve any group; with one pool per group, that pool's size.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from kvtrace.cache.config import CacheConfig, MambaSpec
from kvtrace.engine.arrays import Array, Arrays
from kvtrace.engine.content import P, fingerprint_rows
from kvtrace.engine.memory import check_storage_fits, default_device_type


def first_sums(xp: Arrays, values: Array, counts: Array) -> Array:
    """Per row, the sum of its first ``counts`` values (``values`` [B, W] of residues,
    ``counts`` [B], clamped to W): one cumsum and a gather, not a [B, W] mask."""
    b, w = values.shape
    lead = xp.zeros((b, w + 1))
    xp.cumsum_into(values, lead[:, 1:], axis=1)  # residues < 2^31: W < 2^32 of them fit
    return lead[xp.arange(b), xp.minimum(counts, w)]


def default_device() -> str:
    return default_device_type()


class DeviceStorage:
    def __init__(self, cache_config: CacheConfig, device=None):
        self.arrays = xp = Arrays(device if device is not None else default_device())
        self.device = xp.name
        check_storage_fits(cache_config, xp.device_type)
        self.is_state: list[bool] = []
        self.block_size: list[int] = []
        self.data: list[Array] = []
        self.block_sum: list[Array | None] = []
        for spec, num_blocks in zip(cache_config.groups, cache_config.pool_sizes):
            if isinstance(spec, MambaSpec):
                self.is_state.append(True)
                self.data.append(xp.zeros((num_blocks, spec.num_lanes)))
                self.block_sum.append(None)
            else:
                self.is_state.append(False)
                self.data.append(xp.zeros((num_blocks, spec.block_size)))
                self.block_sum.append(xp.zeros(num_blocks))
            self.block_size.append(spec.block_size)
        self.num_copies = 0
        # Every write or copy into an attention block stamps it with a fresh number. A
        # remembered prefix sum of a block (``append_kv``) holds while its stamp does.
        # (memory.ATTENTION_BLOCK_EXTRAS counts these arrays and the block sum: the size
        # check before a run reads it)
        self._last_stamp = 0
        zeros = [None if st else xp.zeros(n) for st, n in zip(self.is_state, (t.shape[0] for t in self.data))]
        self.stamp: list[Array | None] = zeros
        self._prefix: list[tuple[Array, Array, Array] | None] = [
            None if z is None else (xp.full(z.shape[0], -1), xp.zeros(z.shape[0]), xp.zeros(z.shape[0]))
            for z in zeros]  # (stamp it holds at, number of slots, their sum) per block

    def _restamp(self, group_id: int, block_ids: Array) -> int:
        stamp = self.stamp[group_id]
        self._last_stamp += 1
        if stamp is not None:
            stamp[block_ids] = self._last_stamp
        return self._last_stamp

    # -- copies ---------------------------------------------------------------------------
    def copy_blocks(self, copies: Iterable) -> int:
        """Execute ``(group_id, src, dst, ...)`` copies in order; returns how many ran.

        A run of copies with no block read after being written is one batched device copy.
        """
        n = 0
        batch: dict[int, tuple[list[int], list[int], set[int]]] = {}
        for c in copies:
            g, src, dst = c[0], c[1], c[2]
            srcs, dsts, written = batch.setdefault(g, ([], [], set()))
            if src in written or dst in written:  # ordering matters: flush what is pending
                self._flush_copies(g, srcs, dsts)
                srcs.clear()
                dsts.clear()
                written.clear()
            srcs.append(src)
            dsts.append(dst)
            written.add(dst)
            n += 1
        for g, (srcs, dsts, _) in batch.items():
            self._flush_copies(g, srcs, dsts)
        self.num_copies += n
        return n

    def _flush_copies(self, group_id: int, srcs: list[int], dsts: list[int]) -> None:
        if not srcs:
            return
        s = self.arrays.ints(srcs)
        d = self.arrays.ints(dsts)
        t = self.data[group_id]
        t[d] = t[s]
        bs = self.block_sum[group_id]
        if bs is not None:
            bs[d] = bs[s]
            self._restamp(group_id, d)

    # -- attention ------------------------------------------------------------------------
    def write_kv(
        self,
        group_id: int,
        block_ids: Array,
        slots: Array,
        values: Array,
        touched: Array | None = None,
    ) -> None:
        """Write kv ``values`` into (block, slot) pairs and refresh the touched blocks' sums.

        ``touched`` (the distinct blocks written, if the caller knows them) saves a unique().
        """
        if values.shape[0] == 0:
            return
        if touched is None:
            touched = self.arrays.unique(block_ids)
        self.write_kv_flat(group_id, block_ids * self.data[group_id].shape[1] + slots, values, touched)

    def write_kv_flat(self, group_id: int, flat: Array, values: Array, touched: Array) -> None:
        """``write_kv`` with the slots given as flat indices ``block * block_size + slot``."""
        t, block_sum = self.data[group_id], self.block_sum[group_id]
        assert block_sum is not None, "write_kv on a state group"
        t.reshape(-1)[flat] = values
        block_sum[touched] = t[touched].sum(1) % P
        self._restamp(group_id, touched)

    def append_kv(self, group_id: int, block_ids: Array, slots: Array, values: Array) -> Array:
        """The decode step's write: one kv value into (block, slot) per row, the blocks all
        distinct (the caller checks). Returns each block's sum over slots [0, slot] after
        the write.

        O(rows), not O(rows x block_size): the block sums move by the difference, and each
        block's prefix sum is remembered with the write's stamp, so the next token's costs
        one addition when nothing else wrote or copied into the block since (which would
        restamp it); any other prefix is read back from the slots.
        """
        t, block_sum, stamp, prefix = self.data[group_id], self.block_sum[group_id], \
            self.stamp[group_id], self._prefix[group_id]
        assert block_sum is not None and stamp is not None and prefix is not None, "append_kv on a state group"
        held_at, held_n, held_sum = prefix
        flat = block_ids * t.shape[1] + slots
        kept = (held_at[block_ids] == stamp[block_ids]) & (held_n[block_ids] == slots)
        view = t.reshape(-1)
        old = view[flat]
        view[flat] = values
        block_sum[block_ids] = (block_sum[block_ids] + values - old) % P
        now = self._restamp(group_id, block_ids)
        out = held_sum[block_ids] + values
        if not bool(kept.all()):
            lost = self.arrays.nonzero(~kept)
            out[lost] = first_sums(self.arrays, t[block_ids[lost]], slots[lost] + 1)
        out %= P
        held_sum[block_ids] = out
        held_n[block_ids] = slots + 1
        held_at[block_ids] = now
        return out

    def append_kv_rows(self, kernels, group_id: int, table: np.ndarray, rows: np.ndarray, pos: np.ndarray,
                       toks: np.ndarray, total: np.ndarray) -> bool:
        """``append_kv`` for the decode batch by one C loop (``kernels``: the compiled
        ``kvtrace.engine._decode``, host arrays only): each request's token at its position
        into the block its ``table`` row names, each block's prefix sum added to ``total``.
        False, with nothing written, when two requests name one block."""
        held_at, held_n, held_sum = self._prefix[group_id]  # type: ignore[misc]  # an attention group
        now = self._last_stamp + 1
        if not kernels.attention_append(self.data[group_id], self.block_sum[group_id], self.stamp[group_id],
                                        held_at, held_n, held_sum, now, table, rows, pos, toks, total):
            return False
        self._last_stamp = now
        return True

    def prefill_kv_rows(self, kernels, group_id: int, table: np.ndarray, rows: np.ndarray, starts: np.ndarray,
                        lens: np.ndarray, toks: np.ndarray) -> None:
        """``write_kv`` of prefill chunks by one C loop (``kernels``: the compiled
        ``kvtrace.engine._decode``, host arrays only): chunk i's ``lens[i]`` tokens from
        position ``starts[i]`` into the blocks its ``table`` row names; the touched blocks'
        sums refreshed and restamped."""
        now = self._last_stamp + 1
        kernels.attention_prefill(self.data[group_id], self.block_sum[group_id], self.stamp[group_id], now,
                                  table, rows, starts, lens, toks)
        self._last_stamp = now

    def read_kv(self, group_id: int, block_ids: Array) -> Array:
        return self.data[group_id][block_ids]

    def block_sums(self, group_id: int, block_ids: Array) -> Array:
        block_sum = self.block_sum[group_id]
        assert block_sum is not None, "block_sums on a state group"
        return block_sum[block_ids]

    def slot_values(self, group_id: int, block_ids: Array, slots: Array) -> Array:
        t = self.data[group_id]
        return t.reshape(-1)[block_ids * t.shape[1] + slots]

    # -- recurrent state ------------------------------------------------------------------
    def write_states(self, group_id: int, block_ids: Array, states: Array) -> None:
        if block_ids.shape[0]:
            self.data[group_id][block_ids] = states

    def read_states(self, group_id: int, block_ids: Array) -> Array:
        return self.data[group_id][block_ids]

    # -- fingerprints ---------------------------------------------------------------------
    def fingerprints(
        self, group_id: int, block_ids: Sequence[int], num_valid: Sequence[int] | None = None
    ) -> list[int]:
        """One residue per block: kv slots [0, num_valid) for attention, all lanes for state."""
        if not block_ids:
            return []
        ids = self.arrays.ints(list(block_ids))
        nv = None
        if num_valid is not None and not self.is_state[group_id]:
            nv = self.arrays.ints(list(num_valid))
        return fingerprint_rows(self.arrays, self.data[group_id], nv, rows=ids).tolist()
