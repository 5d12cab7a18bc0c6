"""Sliding window (vLLM's ``SlidingWindowManager``): a token attends to the last
``sliding_window`` tokens, so a hit of length L needs the ``cdiv(window - 1, bs)``
blocks ending at L cached (at least one) (scanned right to left), and blocks wholly outside the
window are freed once computed (they keep their keys).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtrace.cache.blocks import KVCacheBlock
from kvtrace.cache.config import SlidingWindowSpec
from kvtrace.cache.hashing import BlockHash
from kvtrace.cache.managers.base import SingleTypeManager
from kvtrace.cache.retention import swa_reachable_mask
from kvtrace.numeric import cdiv

if TYPE_CHECKING:
    from kvtrace.cache.block_pool import BlockPool
    from kvtrace.cache.context import CacheContext
    from kvtrace.cache.request import Request


class SlidingWindowManager(SingleTypeManager):
    def __init__(self, group_id: int, spec: SlidingWindowSpec, pool: BlockPool, ctx: CacheContext):
        super().__init__(group_id, spec, pool, ctx)
        self.sliding_window = spec.sliding_window
        self.need = cdiv(spec.sliding_window - 1, spec.block_size)  # contiguous blocks for a hit

    def find_longest_cache_hit(
        self, fine: Sequence[BlockHash], max_length: int, alignment: int
    ) -> tuple[list[KVCacheBlock], int]:
        bs = self.block_size
        align = max(alignment, bs)
        coarse = self.coarse(fine)
        cached = self.cached

        def lookup(h: BlockHash) -> KVCacheBlock | None:
            b = cached.get(h)
            return b if b is None or type(b) is KVCacheBlock else next(iter(b.values()))

        n_max = min(max_length // bs, len(coarse))
        seen: list = [None] * n_max  # None: not looked up yet; False: a miss
        # A window of one token needs no earlier block (need 0), yet vLLM's scan still ends a
        # hit at its rightmost cached block: at least one, or no hit (kvtrace took a whole
        # lookup as a hit with none cached)
        need = max(self.need, 1)
        for end in range(n_max, 0, -1):  # right to left over candidate hit ends
            if (end * bs) % align:
                continue
            lo = max(0, end - need)
            ok = True
            for i in range(end - 1, lo - 1, -1):
                b = seen[i]
                if b is None:
                    b = seen[i] = lookup(coarse[i]) or False
                if b is False:
                    ok = False
                    break
            if ok:
                return [self.null_block] * lo + seen[lo:end], end * bs
        return [], 0

    def admission_cap(self, max_model_len: int, max_in_flight_tokens: int) -> int | None:
        # vLLM's SlidingWindowSpec.max_admission_blocks_per_request: blocks outside the window
        # are freed on the processed-token basis, so a request holds at most the window plus
        # the tokens in flight (+1: the window may start mid-block). kvtrace's windows retain
        # no extra trailing tokens (vLLM's extra_retained_tokens = 0).
        return cdiv(min(self.sliding_window - 1 + max_in_flight_tokens, max_model_len), self.block_size) + 1

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(num_computed_tokens - self.sliding_window + 1, 0)

    def reachable_mask(self, request: Request, start: int, end: int) -> tuple[list[bool] | None, set[int]]:
        return swa_reachable_mask(
            start, end, self.block_size, self.ctx.cache_hit_alignment, self.need,
            self.ctx.retention_interval, self.reachable_boundaries(request),
        )
