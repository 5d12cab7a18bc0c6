"""The worker's block tables as a device tensor (vLLM's worker-side ``BlockTable``)."""

from __future__ import annotations

import torch

from kvtrace.engine.storage import int64_tensor


class BlockTableTensor:
    """A device copy of the worker's tables for one group, one row per running request
    (vLLM's worker-side ``BlockTable``): sampling gathers a whole batch's blocks at once."""

    def __init__(self, device: torch.device, rows: int = 64, width: int = 64):
        self.device = device
        self.t = torch.zeros((rows, width), dtype=torch.int64, device=device)

    def _fit(self, row: int, width: int) -> None:
        r, w = self.t.shape
        if row < r and width <= w:
            return
        nr, nw = r, w
        while nr <= row:
            nr *= 2
        while nw < width:
            nw *= 2
        grown = torch.zeros((nr, nw), dtype=torch.int64, device=self.device)
        grown[:r, :w] = self.t
        self.t = grown

    def set_row(self, row: int, ids: list[int]) -> None:
        self._fit(row, len(ids))
        if ids:
            self.t[row, : len(ids)] = int64_tensor(ids, self.device)

    def append(self, row: int, start: int, ids: list[int]) -> None:
        self._fit(row, start + len(ids))
        self.t[row, start : start + len(ids)] = int64_tensor(ids, self.device)
