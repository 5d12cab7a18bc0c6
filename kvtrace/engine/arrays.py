"""The engine's int64 arrays: numpy on the host, torch on an accelerator, one code path.

The content model's per-step arrays are small (a batch of a few dozen requests), so what
a step costs is the number of array calls, not the data: numpy's call costs a third of
torch's on the CPU (measured: a decode step's kv append takes 37 us against 110 us), and a
CPU run then never imports torch (seconds of start-up). On a GPU the same code runs on
torch tensors.

So the worker, the storage and the content model use only what numpy arrays and torch
tensors share: ``x[i]`` and ``x[i] = v`` with index arrays, arithmetic and ``%`` (both
floor-mod), ``//``, comparisons, ``&``/``~``, ``.sum(axis)``, ``.cumsum(axis)``, ``.take``
(flat), ``.reshape(-1)`` (a view of a contiguous array), ``.T``,
``.shape``, ``.tolist()``, and ``[:, None]``. Everything else (making arrays, joining,
``unique``, moving to and from the host) goes through :class:`Arrays`. Every value is an
int64 residue kept below 2^63 by construction, so both give the same bits.

Devices: ``cpu`` is numpy; ``cuda`` / ``cuda:N`` is torch; ``torch:cpu`` runs the torch
path on the CPU (what a GPU runs, checked where there is none).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

TORCH_CPU = "torch:cpu"  # the torch code path on the CPU: tests and bench/gpu_check.sh compare it

Array = Any  # an np.ndarray or a torch.Tensor of int64, per the Arrays that made it


class Arrays:
    """Makes the int64 arrays of one device (numpy for ``cpu``, else torch)."""

    def __init__(self, device: Any = "cpu"):
        name = str(device)
        self.name = name
        self.is_numpy = name == "cpu"
        if self.is_numpy:
            self.device = None
            self._torch = None
        else:
            import torch

            self._torch = torch
            self.device = torch.device("cpu" if name == TORCH_CPU else name)

    def __repr__(self) -> str:
        return f"Arrays({self.name!r})"

    @property
    def device_type(self) -> str:
        return "cpu" if self.device is None else self.device.type

    # -- making arrays ------------------------------------------------------------------
    def ints(self, values) -> Array:
        """Host ints (a list, nested lists or an ndarray) as an int64 array. Through numpy:
        ``torch.tensor`` converts a list element by element, about 3x slower at these sizes."""
        a = np.array(values, dtype=np.int64)
        return a if self._torch is None else self._torch.from_numpy(a).to(self.device)

    def from_host(self, a: np.ndarray) -> Array:
        """An int64 ndarray as this device's array (no copy on the host)."""
        a = np.ascontiguousarray(a, dtype=np.int64)
        return a if self._torch is None else self._torch.from_numpy(a).to(self.device)

    def zeros(self, shape: int | tuple[int, ...]) -> Array:
        if self._torch is None:
            return np.zeros(shape, dtype=np.int64)
        return self._torch.zeros(shape, dtype=self._torch.int64, device=self.device)

    def full(self, shape: int | tuple[int, ...], value: int) -> Array:
        if self._torch is None:
            return np.full(shape, value, dtype=np.int64)
        return self._torch.full(shape if isinstance(shape, tuple) else (shape,), value, dtype=self._torch.int64,
                                device=self.device)

    def arange(self, start: int, stop: int | None = None) -> Array:
        if stop is None:
            start, stop = 0, start
        if self._torch is None:
            return np.arange(start, stop, dtype=np.int64)
        return self._torch.arange(start, stop, dtype=self._torch.int64, device=self.device)

    # -- combining ----------------------------------------------------------------------
    def concat(self, arrays: Sequence[Array], axis: int = 0) -> Array:
        if self._torch is None:
            return np.concatenate(arrays, axis=axis)
        return self._torch.cat(list(arrays), dim=axis)

    def unique(self, x: Array) -> Array:
        return np.unique(x) if self._torch is None else self._torch.unique(x)

    def cumsum_into(self, x: Array, out: Array, axis: int) -> None:
        """``out[...] = cumsum(x, axis)``, written in place (``out`` may be a view)."""
        if self._torch is None:
            x.cumsum(axis, out=out)
        else:
            self._torch.cumsum(x, dim=axis, out=out)

    def minimum(self, x: Array, bound: int) -> Array:
        """``min(x, bound)`` elementwise (numpy's ``clip`` costs ten times a ufunc)."""
        return np.minimum(x, bound) if self._torch is None else x.clamp(max=bound)

    def nonzero(self, mask: Array) -> Array:
        """The indices of a 1-D mask's true entries."""
        return np.flatnonzero(mask) if self._torch is None else mask.nonzero().squeeze(1)

    def copy(self, x: Array) -> Array:
        return x.copy() if self._torch is None else x.clone()

    # -- to the host --------------------------------------------------------------------
    def host(self, x: Array) -> np.ndarray:
        return x if self._torch is None else x.cpu().numpy()
