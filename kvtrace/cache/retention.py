"""Sparse retention masks (vLLM's ``reachable_block_mask``) for Mamba and sliding window.

``retention_interval`` k: None = dense (no mask: every full block is cached); 0 =
latest-only (only reachable boundaries); k > 0 = one checkpoint every k tokens plus the
reachable boundaries. A reachable boundary b (the prompt's replay boundary
``num_prompt_tokens - 1`` and, when pinned, the shared-prefix junction) keeps the
block(s) ending at ``floor(b / align) * align``.

Masks cover blocks [start, end) and return ``(mask, boundary_blocks)`` where
``boundary_blocks`` are the kept indices owed to a boundary (published as "boundary").
"""

from __future__ import annotations

from typing import Sequence


def _boundary_tail_block(b: int, align: int, block_size: int) -> int:
    return (b // align) * align // block_size - 1


def mamba_reachable_mask(
    start: int,
    end: int,
    block_size: int,
    align: int,
    retention_interval: int | None,
    reachable_boundaries: Sequence[int] = (),
) -> tuple[list[bool] | None, set[int]]:
    """A Mamba hit needs one state block: keep each segment tail and each boundary block
    (the sliding-window mask with a window of one block)."""
    return swa_reachable_mask(start, end, block_size, align, 1, retention_interval, reachable_boundaries)


def swa_reachable_mask(
    start: int,
    end: int,
    block_size: int,
    align: int,
    need: int,
    retention_interval: int | None,
    reachable_boundaries: Sequence[int] = (),
) -> tuple[list[bool] | None, set[int]]:
    """A sliding-window hit needs ``need`` contiguous blocks ending at the hit."""
    if retention_interval is None:
        return None, set()
    mask = [False] * (end - start)

    def keep_tail(j: int, owed: set[int] | None) -> None:
        for i in range(max(j - need + 1, start), min(j + 1, end)):
            if owed is not None and not mask[i - start]:
                owed.add(i)
            mask[i - start] = True

    if retention_interval:
        per = retention_interval // block_size
        first = (start // per) * per + per - 1
        # a segment tail may start before `start`; include tails whose window reaches in
        for j in range(first, end + need, per):
            keep_tail(j, None)
    owed: set[int] = set()
    for b in reachable_boundaries:
        j = _boundary_tail_block(b, align, block_size)
        if j >= 0:
            keep_tail(j, owed)
    return mask, owed
