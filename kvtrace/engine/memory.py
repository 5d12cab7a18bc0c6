"""How much memory the engine's device storage needs, and whether it fits (torch-free).

Replay checks a configuration before anything runs, so that a user error is reported at
once; this module answers without importing torch (seconds of start-up) unless a CUDA
device is named, where only torch can say whether it is there and how much memory it has.
"""

from __future__ import annotations

import os
import re
from typing import Any

from kvtrace.cache.config import CacheConfig, MambaSpec
from kvtrace.errors import ConfigError

# int64 values an attention block holds in ``DeviceStorage`` besides its slots: the block sum,
# the write stamp, and the remembered prefix (the stamp it holds at, its slot count, its sum)
ATTENTION_BLOCK_EXTRAS = 5


def storage_bytes(cache_config: CacheConfig, *, state_only: bool = False) -> int:
    """Bytes of device tensors ``DeviceStorage`` allocates for ``cache_config`` (of its
    Mamba groups' states alone with ``state_only``). (Slots and block sums alone understated
    a pool of 16-token blocks by a fifth: 17 values a block where it holds 21.)"""
    total = 0
    for spec, num_blocks in zip(cache_config.groups, cache_config.pool_sizes):
        state = isinstance(spec, MambaSpec)
        if state_only and not state:
            continue
        per_block = spec.num_lanes if isinstance(spec, MambaSpec) else spec.block_size + ATTENTION_BLOCK_EXTRAS
        total += num_blocks * per_block * 8
    return total


DEVICE_ENV = "KVTRACE_DEVICE"  # cpu | cuda[:N] | torch:cpu (kvtrace.engine.arrays): when the caller names none


def default_device_type() -> str:
    """``$KVTRACE_DEVICE`` if set, else ``cpu`` (numpy), also where a GPU is there.

    A step's arrays are a batch of a few dozen rows, so a step costs array calls, not
    arithmetic, and a GPU's kernel launches cost more than numpy's calls: on an H200 machine
    the whole Mooncake trace took 10.6 s on numpy, 23.6 s on torch's CPU path and 32.2 s on
    cuda, with equal digests (bench/gpu_check.sh; README, GPU). ``cuda`` stays for
    whoever names it. (Content is bit-identical on every device.)"""
    chosen = os.environ.get(DEVICE_ENV, "").strip()
    return check_device(chosen) if chosen else "cpu"


def check_device(chosen: str, source: str = DEVICE_ENV) -> str:
    """``chosen`` if it names a device the engine can use, else a ConfigError from ``source``
    (an Engine's own ``device`` argument too: torch's RuntimeError or CUDA assertion otherwise)."""
    if chosen not in ("cpu", "cuda", "torch:cpu") and re.fullmatch(r"cuda:[0-9]+", chosen) is None:
        raise ConfigError(source, chosen, "expected cpu, cuda, cuda:N or torch:cpu")
    if chosen.startswith("cuda"):
        _check_cuda(chosen, source)
    return chosen


def _check_cuda(chosen: str, source: str = DEVICE_ENV) -> None:
    """A ConfigError unless this torch can use the CUDA device ``chosen`` names (rather
    than torch's assertion at the first allocation)."""
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(source, chosen, "this torch sees no CUDA device (a CPU build or no GPU); use cpu")
    index = chosen.partition(":")[2]
    if index and (not (index.isascii() and index.isdigit()) or int(index) >= torch.cuda.device_count()):
        raise ConfigError(source, chosen, f"expected cuda:N with N below {torch.cuda.device_count()}, "
                                              "the number of CUDA devices torch sees")


def device_memory_bytes(device: Any) -> int:
    """Memory of ``device`` (a torch device or its type name): the GPU's, or the machine's
    physical memory for the CPU."""
    kind = (device if isinstance(device, str) else device.type).split(":")[0]
    if kind == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(device).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


STATE_LANES = "state lanes"  # the key of state_lanes' refusal: the groups alone make it


def state_lanes(cache_config: CacheConfig) -> int:
    """The lanes of every Mamba group's state (4 without one), or a ConfigError where the
    groups differ: the content model advances one recurrent state a request, written to
    every state group alike (the worker refused them with a ValueError and a traceback)."""
    lanes = sorted({s.num_lanes for s in cache_config.groups if isinstance(s, MambaSpec)})
    if len(lanes) > 1:
        raise ConfigError("KV storage", STATE_LANES,
                          f"expected one num_lanes for every Mamba group (the content model keeps one recurrent "
                          f"state a request), got {', '.join(map(str, lanes))}")
    return lanes[0] if lanes else 4


# The share of the device's memory the KV storage may take: the rest is the process's own,
# torch's workspace and the content model's per-step tensors.
STORAGE_SHARE = 0.8


def check_storage_fits(cache_config: CacheConfig, device: Any = None) -> None:
    """A ConfigError naming the flags to lower when the storage would not fit in memory
    (rather than letting torch try to allocate terabytes), or the Mamba groups' lanes
    where the content model cannot hold them (``state_lanes``)."""
    state_lanes(cache_config)
    dev = device if device is not None else default_device_type()
    kind = (dev if isinstance(dev, str) else dev.type).split(":")[0]
    need, have = storage_bytes(cache_config), device_memory_bytes(dev)
    if need > have * STORAGE_SHARE:
        # the Mamba groups' num_lanes alone can make it (no flag sets them): name what to lower
        states = storage_bytes(cache_config, state_only=True)
        lower = ("num_lanes of the Mamba groups in --config" if states > have * 0.4 else
                 "--block-size or --capacity-blocks / --capacity-tokens (or num_gpu_blocks in --config)")
        raise ConfigError("KV storage", f"{need / 2**30:,.1f} GiB",
                          f"more than the {STORAGE_SHARE:.0%} of {kind} memory a run may take "
                          f"({have * STORAGE_SHARE / 2**30:,.1f} of {have / 2**30:,.1f} GiB); lower {lower}")
