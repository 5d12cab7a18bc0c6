"""Device storage for block content: one torch tensor per KV cache group.

The manager never touches this; the worker does. Attention groups hold kv slots
``[num_blocks, block_size]`` plus a per-block sum of all its slots (kept current on
every write and copy, so sampling reads a long context as a few block sums); Mamba
groups hold state lanes ``[num_blocks, D]``. Values follow ``kvtrace.cache.content``.
Copy-on-write is a device copy (``index_copy_``).

Each group's tensor has a row per block of the pool the group allocates from: with the
shared pool (vLLM's layout) every group's tensor spans all ``num_gpu_blocks`` ids, as a
block of the pool may serve any group; with one pool per group, that pool's size.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from kvtrace.cache.config import CacheConfig, MambaSpec
from kvtrace.engine.content import P, fingerprint_rows
from kvtrace.engine.memory import check_storage_fits, default_device_type


def int64_tensor(values, device: torch.device | str) -> torch.Tensor:
    """Host ints (a list, or nested lists) as an int64 tensor on ``device``. Through numpy:
    ``torch.tensor`` converts a list element by element, about 3x slower at these sizes."""
    return torch.from_numpy(np.array(values, dtype=np.int64)).to(device)


def first_sums(values: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per row, the sum of its first ``counts`` values (``values`` [B, W] of residues,
    ``counts`` [B], clamped to W): one cumsum and a gather, not a [B, W] mask."""
    w = values.shape[1]
    lead = torch.zeros((values.shape[0], w + 1), dtype=torch.int64, device=values.device)
    torch.cumsum(values, dim=1, out=lead[:, 1:])  # residues < 2^31: W < 2^32 of them fit
    return lead.gather(1, counts.clamp(max=w).unsqueeze(1)).squeeze(1)


def default_device() -> torch.device:
    return torch.device(default_device_type())


class DeviceStorage:
    def __init__(self, cache_config: CacheConfig, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else default_device()
        check_storage_fits(cache_config, self.device)
        self.is_state: list[bool] = []
        self.block_size: list[int] = []
        self.data: list[torch.Tensor] = []
        self.block_sum: list[torch.Tensor | None] = []
        for spec, num_blocks in zip(cache_config.groups, cache_config.pool_sizes):
            if isinstance(spec, MambaSpec):
                self.is_state.append(True)
                self.data.append(torch.zeros((num_blocks, spec.num_lanes), dtype=torch.int64, device=self.device))
                self.block_sum.append(None)
            else:
                self.is_state.append(False)
                self.data.append(torch.zeros((num_blocks, spec.block_size), dtype=torch.int64, device=self.device))
                self.block_sum.append(torch.zeros(num_blocks, dtype=torch.int64, device=self.device))
            self.block_size.append(spec.block_size)
        self.num_copies = 0
        # Every write or copy into an attention block stamps it with a fresh number. A
        # remembered prefix sum of a block (``append_kv``) holds while its stamp does.
        self._last_stamp = 0
        zeros = [None if st else torch.zeros(n, dtype=torch.int64, device=self.device)
                 for st, n in zip(self.is_state, (t.shape[0] for t in self.data))]
        self.stamp: list[torch.Tensor | None] = zeros
        self._prefix: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = [
            None if z is None else (torch.full_like(z, -1), torch.zeros_like(z), torch.zeros_like(z))
            for z in zeros]  # (stamp it holds at, number of slots, their sum) per block

    def _restamp(self, group_id: int, block_ids: torch.Tensor) -> int:
        stamp = self.stamp[group_id]
        self._last_stamp += 1
        if stamp is not None:
            stamp.index_fill_(0, block_ids, self._last_stamp)
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
        s = int64_tensor(srcs, self.device)
        d = int64_tensor(dsts, self.device)
        t = self.data[group_id]
        t.index_copy_(0, d, t.index_select(0, s))
        bs = self.block_sum[group_id]
        if bs is not None:
            bs.index_copy_(0, d, bs.index_select(0, s))
            self._restamp(group_id, d)

    # -- attention ------------------------------------------------------------------------
    def write_kv(
        self,
        group_id: int,
        block_ids: torch.Tensor,
        slots: torch.Tensor,
        values: torch.Tensor,
        touched: torch.Tensor | None = None,
    ) -> None:
        """Write kv ``values`` into (block, slot) pairs and refresh the touched blocks' sums.

        ``touched`` (the distinct blocks written, if the caller knows them) saves a unique().
        """
        if values.numel() == 0:
            return
        if touched is None:
            touched = torch.unique(block_ids)
        self.write_kv_flat(group_id, block_ids * self.data[group_id].shape[1] + slots, values, touched)

    def write_kv_flat(self, group_id: int, flat: torch.Tensor, values: torch.Tensor, touched: torch.Tensor) -> None:
        """``write_kv`` with the slots given as flat indices ``block * block_size + slot``."""
        t, block_sum = self.data[group_id], self.block_sum[group_id]
        assert block_sum is not None, "write_kv on a state group"
        t.view(-1).index_copy_(0, flat, values)
        block_sum.index_copy_(0, touched, t.index_select(0, touched).sum(dim=1) % P)
        self._restamp(group_id, touched)

    def append_kv(self, group_id: int, block_ids: torch.Tensor, slots: torch.Tensor,
                  values: torch.Tensor) -> torch.Tensor:
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
        kept = (held_at.index_select(0, block_ids) == stamp.index_select(0, block_ids)) & (
            held_n.index_select(0, block_ids) == slots)
        view = t.view(-1)
        old = view.index_select(0, flat)
        view.index_copy_(0, flat, values)
        block_sum.index_copy_(0, block_ids, (block_sum.index_select(0, block_ids) + values - old) % P)
        now = self._restamp(group_id, block_ids)
        out = held_sum.index_select(0, block_ids) + values
        if not bool(kept.all()):
            lost = (~kept).nonzero().squeeze(1)
            out[lost] = first_sums(t.index_select(0, block_ids[lost]), slots[lost] + 1)
        out %= P
        held_sum.index_copy_(0, block_ids, out)
        held_n.index_copy_(0, block_ids, slots + 1)
        held_at.index_fill_(0, block_ids, now)
        return out

    def read_kv(self, group_id: int, block_ids: torch.Tensor) -> torch.Tensor:
        return self.data[group_id].index_select(0, block_ids)

    def block_sums(self, group_id: int, block_ids: torch.Tensor) -> torch.Tensor:
        block_sum = self.block_sum[group_id]
        assert block_sum is not None, "block_sums on a state group"
        return block_sum.index_select(0, block_ids)

    def slot_values(self, group_id: int, block_ids: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        t = self.data[group_id]
        return t.view(-1).index_select(0, block_ids * t.shape[1] + slots)

    # -- recurrent state ------------------------------------------------------------------
    def write_states(self, group_id: int, block_ids: torch.Tensor, states: torch.Tensor) -> None:
        if block_ids.numel():
            self.data[group_id].index_copy_(0, block_ids, states)

    def read_states(self, group_id: int, block_ids: torch.Tensor) -> torch.Tensor:
        return self.data[group_id].index_select(0, block_ids)

    # -- fingerprints ---------------------------------------------------------------------
    def fingerprints(
        self, group_id: int, block_ids: Sequence[int], num_valid: Sequence[int] | None = None
    ) -> list[int]:
        """One residue per block: kv slots [0, num_valid) for attention, all lanes for state."""
        if not block_ids:
            return []
        ids = int64_tensor(list(block_ids), self.device)
        rows = self.data[group_id].index_select(0, ids)
        nv = None
        if num_valid is not None and not self.is_state[group_id]:
            nv = int64_tensor(list(num_valid), self.device)
        return fingerprint_rows(rows, nv).tolist()
