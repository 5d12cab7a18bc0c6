"""Full attention (vLLM's ``FullAttentionManager``): every earlier token is attended to,
so a hit is the longest run of cached blocks from the start (scanned left to right,
stopping at the first miss); with fine-grained hits (an alignment below the block
size) the hash units inside the first block that missed are probed too, high to low.

Whenever its block is wider than a hash unit, the prompt's partial tail gets a key of
its own, at the last hash boundary a resend can reach:
``(num_prompt_tokens - 1) // hash_block_size * hash_block_size`` (a resend matches at
most ``num_prompt_tokens - 1`` tokens, the last one being recomputed for its logits).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtrace.cache.blocks import KVCacheBlock
from kvtrace.cache.events import PUBLISH_PARTIAL_TAIL
from kvtrace.cache.hashing import BlockHash
from kvtrace.cache.managers.base import SingleTypeManager
from kvtrace.numeric import cdiv

if TYPE_CHECKING:
    from kvtrace.cache.request import Request


class FullAttentionManager(SingleTypeManager):
    def find_longest_cache_hit(
        self, fine: Sequence[BlockHash], max_length: int, alignment: int
    ) -> tuple[list[KVCacheBlock], int]:
        bs = self.block_size
        scale = self.scale
        coarse = fine if scale == 1 else fine[scale - 1::scale]  # self.coarse, inlined (per lookup)
        cached = self.cached
        blocks: list[KVCacheBlock] = []
        append = blocks.append
        for h in coarse[: max_length // bs]:
            b = cached.get(h)
            if b is None:
                break
            if type(b) is not KVCacheBlock:  # duplicates: the first holder
                b = next(iter(b.values()))
            append(b)
        hit = len(blocks) * bs
        if alignment < bs:  # fine-grained: probe hash boundaries inside the next block
            first = len(blocks) * scale
            last = min(first + scale - 1, max_length // alignment, len(fine))
            for fi in range(last - 1, first - 1, -1):
                b = cached.get(fine[fi])
                if b is not None:
                    if type(b) is not KVCacheBlock:
                        b = next(iter(b.values()))
                    blocks.append(b)
                    hit = (fi + 1) * alignment
                    break
        if hit % alignment:
            hit -= hit % alignment
            del blocks[cdiv(hit, bs):]
        return blocks, hit

    def free(self, request_id: str) -> list[KVCacheBlock]:
        # full-attention tables hold no null blocks: free the reversed table as is
        table = self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        if self.partial_hit_reqs:
            self.partial_hit_reqs.pop(request_id, None)
        if not table:
            return []
        ordered = table[::-1]
        self.pool.free_blocks(ordered, self.group_id)
        return ordered

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        super().cache_blocks(request, num_tokens)
        if self.scale > 1:
            self._cache_partial_tail_block(request, num_tokens)

    def _cache_partial_tail_block(self, request: Request, num_tokens: int) -> None:
        """Key the block holding the prompt's last reachable hash boundary at that boundary
        (vLLM does so whenever the block is wider than a hash unit, fine-grained hits on
        or not)."""
        hbs = self.ctx.hash_block_size
        boundary = min((request.num_prompt_tokens - 1) // hbs, len(request.block_hashes)) * hbs
        if boundary == 0 or boundary > num_tokens or boundary % self.block_size == 0:
            return
        table = self.req_to_blocks[request.request_id]
        idx = boundary // self.block_size
        if idx >= len(table):
            return
        self.pool.cache_partial_block(
            self.group_id, request.request_id, table[idx], request.block_hashes[boundary // hbs - 1], boundary,
            PUBLISH_PARTIAL_TAIL,
        )
