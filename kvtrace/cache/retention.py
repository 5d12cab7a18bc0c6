"""Sparse retention masks (vLLM's ``reachable_block_mask``) for Mamba and sliding window.

``retention_interval`` k: None = dense; 0 = latest-only (only reachable boundaries);
k > 0 = one checkpoint every k tokens plus the reachable boundaries. A reachable
boundary b (the prompt's replay boundary ``num_prompt_tokens - 1`` and, when pinned,
the shared-prefix junction) keeps the block(s) ending at ``floor(b / align) * align``,
``align`` being the cache-hit alignment (the hash block with fine-grained hits, else the
scheduler block).

Masks cover blocks [start, end) and return ``(mask, boundary_blocks)``: ``mask`` None
keeps every block; ``boundary_blocks`` are the kept indices owed to a boundary only
(published as "boundary").
"""

from __future__ import annotations

from collections.abc import Sequence


def mamba_reachable_mask(
    start: int,
    end: int,
    block_size: int,
    align: int,
    retention_interval: int | None,
    reachable_boundaries: Sequence[int] = (),
) -> tuple[list[bool] | None, set[int]]:
    """A Mamba hit needs the one state block ending at the hit: keep each segment's
    last block and each boundary's block. An interval of at most one block is dense."""
    if retention_interval is None:
        return None, set()
    mask = [False] * (end - start)
    if retention_interval:
        per = retention_interval // block_size
        if per <= 1:
            return None, set()
        first = (start + per) // per * per - 1
        for i in range(first - start, len(mask), per):
            mask[i] = True
    owed: set[int] = set()
    for b in reachable_boundaries:
        j = (b // align) * align // block_size - 1
        if start <= j < end and not mask[j - start]:
            mask[j - start] = True
            owed.add(j)
    return mask, owed


def swa_reachable_mask(
    start: int,
    end: int,
    block_size: int,
    align: int,
    need: int,
    retention_interval: int | None,
    reachable_boundaries: Sequence[int] = (),
) -> tuple[list[bool] | None, set[int]]:
    """A sliding-window hit needs ``need`` contiguous blocks ending at the hit: keep the
    last ``need`` blocks of each segment (an ``align`` segment when dense, a
    ``retention_interval`` one when sparse, none at 0) and the ``need`` blocks ending at
    each reachable boundary (sparse only). Dense when every block would be kept, or when
    ``align`` is finer than a block (the mask cannot express it)."""
    if align % block_size:
        return None, set()
    segment = align if retention_interval is None else retention_interval
    mask = [False] * (end - start)
    if segment:
        per = segment // block_size
        if need >= per:
            return None, set()
        for i in range(start, end):
            if i % per >= per - need:
                mask[i - start] = True
    owed: set[int] = set()
    if retention_interval is not None:
        for b in reachable_boundaries:
            e = (b // align) * align // block_size
            for j in range(max(start, e - need), min(end, e)):
                if not mask[j - start]:
                    mask[j - start] = True
                    owed.add(j)
    return mask, owed
