"""Deterministic token synthesis for traces that carry block ids instead of tokens.

Mooncake, Bailian and WEKA traces give prefix-chained block ids. Each id gets its own
fixed token list, derived from (namespace, id) alone, so the same id always expands to
the same tokens and the cache can memoise per-id hashes (cost grows with unique blocks).
"""

from __future__ import annotations

import functools

import numpy as np

from kvtrace import compiled
from kvtrace.workload.lines import VOCAB_SIZE

KERNELS = "kvtrace.workload._tokens"  # the C pass (compiled.CYTHON); the numpy one below otherwise


@functools.cache
def _kernel():
    """The compiled C pass, or None (decided once, on first use)."""
    return compiled.kernels(KERNELS)

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = 0x9E3779B97F4A7C15
_VOCAB = np.uint64(VOCAB_SIZE)


def block_tokens(block_id: int, block_size: int, namespace: int = 0) -> np.ndarray:
    """The fixed token list (int64, length ``block_size``) of one trace block id."""
    return blocks_tokens((block_id,), block_size, namespace)[0]


def blocks_tokens(block_ids: tuple[int, ...] | list[int], block_size: int, namespace: int = 0) -> np.ndarray:
    """``block_tokens`` of each id, as rows ``[len(block_ids), block_size]`` (one vectorised pass).

    Token j of id b is splitmix64(seed_b + j) mod VOCAB_SIZE, seed_b = (namespace * 0x1F123BB5
    + b * 0x5851F42D4C957F2D) mod 2^64. One C pass (``_tokens.pyx``) when the install compiled
    it, else ``blocks_tokens_numpy``: the same values (tests/workload/test_tokens_kernel.py)."""
    out = np.empty((len(block_ids), block_size), dtype=np.int64)
    _fill(block_ids, namespace, out)
    return out


def _fill(block_ids: tuple[int, ...] | list[int], namespace: int, out: np.ndarray) -> None:
    """Row i of ``out`` (C-contiguous, int64): the first ``out.shape[1]`` tokens of id i."""
    seeds = _seeds(block_ids, namespace)
    kernel = _kernel()
    if kernel is not None:
        kernel.fill_blocks(seeds, out, VOCAB_SIZE)
    else:
        out[...] = blocks_tokens_numpy(seeds, out.shape[1])


def _seeds(block_ids: tuple[int, ...] | list[int], namespace: int) -> np.ndarray:
    ns = int(namespace) * 0x1F123BB5 + _GOLDEN
    return np.fromiter(((ns + int(b) * 0x5851F42D4C957F2D) & 0xFFFFFFFFFFFFFFFF for b in block_ids),
                       dtype=np.uint64, count=len(block_ids))


def blocks_tokens_numpy(seeds: np.ndarray, block_size: int) -> np.ndarray:
    """``blocks_tokens`` from the ids' seeds by numpy (the kernel's fallback, and its check).

    In place in the output (tens of millions of tokens per trace: fresh temporaries cost as
    much as the arithmetic), the modulo as x - (x // V) * V, as numpy divides by a scalar far
    faster than it takes a remainder."""
    x = np.empty((seeds.shape[0], block_size), dtype=np.uint64)
    t = np.empty_like(x)
    with np.errstate(over="ignore"):
        np.add(np.arange(block_size, dtype=np.uint64)[None, :], seeds[:, None], out=x)
        np.right_shift(x, np.uint64(30), out=t)  # splitmix64's finaliser
        x ^= t
        x *= _M1
        np.right_shift(x, np.uint64(27), out=t)
        x ^= t
        x *= _M2
        np.right_shift(x, np.uint64(31), out=t)
        x ^= t
    np.floor_divide(x, _VOCAB, out=t)
    t *= _VOCAB
    x -= t
    return x.view(np.int64)  # below VOCAB_SIZE: the same values as int64


def tokens_for_block_ids(
    block_ids: tuple[int, ...] | list[int], block_size: int, input_length: int, namespace: int = 0
) -> np.ndarray:
    """Expand prefix-chained block ids to ``input_length`` tokens (fewer when the ids run out);
    the last block is cut. Only the tokens kept are made: a trace's block size of 2^31 once
    allocated 16 GiB for a 5-token prompt."""
    full = min(len(block_ids), input_length // block_size)
    cut = input_length - full * block_size if full < len(block_ids) else 0  # (< block_size)
    out = np.empty(full * block_size + cut, dtype=np.int64)
    if full:
        _fill(block_ids[:full], namespace, out[:full * block_size].reshape(full, block_size))
    if cut:
        _fill(block_ids[full:full + 1], namespace, out[full * block_size:].reshape(1, cut))
    return out
