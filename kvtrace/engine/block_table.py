"""The worker's block tables as a device array (vLLM's worker-side ``BlockTable``)."""

from __future__ import annotations

from kvtrace.engine.arrays import Arrays


class BlockTableTensor:
    """A device copy of the worker's tables for one group, one row per running request
    (vLLM's worker-side ``BlockTable``): sampling gathers a whole batch's blocks at once."""

    def __init__(self, arrays: Arrays, rows: int = 64, width: int = 64):
        self.arrays = arrays
        self.t = arrays.zeros((rows, width))

    def _fit(self, row: int, width: int) -> None:
        r, w = self.t.shape
        if row < r and width <= w:
            return
        nr, nw = r, w
        while nr <= row:
            nr *= 2
        while nw < width:
            nw *= 2
        grown = self.arrays.zeros((nr, nw))
        grown[:r, :w] = self.t
        self.t = grown

    def set_row(self, row: int, ids: list[int]) -> None:
        """Row ``row`` holds ``ids`` and then the null block (a reused row forgets its old ids)."""
        self._fit(row, len(ids))
        if ids:
            self.t[row, : len(ids)] = self.arrays.ints(ids)
        self.t[row, len(ids):] = 0

    def append(self, row: int, start: int, ids: list[int]) -> None:
        self._fit(row, start + len(ids))
        self.t[row, start : start + len(ids)] = self.arrays.ints(ids)
