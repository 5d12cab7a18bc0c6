"""Mamba/KDA state in vLLM's ``mamba_cache_mode="align"`` (vLLM's ``MambaManager``).

A state summarises exactly the prefix it consumed, so a hit of length L needs a state
stored after exactly L tokens: the scan runs right to left for the last cached state
whose length is a multiple of the alignment. Table slot p holds the state after
``(p + 1) * bs`` tokens; slots skipped over are null. Each step the state after the
step's last token goes to the slot of that token (``StateWrite(kind="running")``;
with speculative blocks, the first of the last ``1 + num_speculative_blocks`` slots),
and the previous state block (``last_state_block_idx``) is freed once consumed (it stays
hashed if cached).

Internal prefill checkpoints (``num_prefill_checkpoint_blocks = 1``; FlashKDA): a chunk
ending at ``query_end`` may export the state at its last reachable hash boundary,
``get_mamba_prefill_checkpoint_position(query_end)``, into a block reserved at slot
``cdiv(query_end, bs) - 2``, when the backend can (``is_mamba_prefill_checkpoint_valid``:
the chunk starts on a hash boundary, the checkpoint slot is past the chunk's initial
state, and the checkpoint is a multiple of ``prefill_checkpoint_alignment`` past the
chunk start). At retention 0 only the chunk reaching the end of prefill reserves one;
the block is then re-keyed at the checkpoint, or, for a transient checkpoint (not the
prompt's, not one the retention mask keeps, not the shared-prefix junction), left
unpublished with the keys it carried evicted (``transient-checkpoint-retention``).

Same-step rule: a state published in this step (``cached_blocks_this_step``) is written
by this step's forward pass, so a request whose hit ends on it cannot be allocated now:
``get_num_blocks_to_allocate`` answers more than the pool holds, ``allocate_slots``
returns None and the scheduler retries the request next step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtrace.cache.blocks import KVCacheBlock
from kvtrace.cache.config import EXTERNAL_HIT_RUNNING_COW, TRANSIENT_CHECKPOINT_RETENTION, MambaSpec
from kvtrace.cache.events import (
    COPY_RUNNING_TAIL,
    EVICT_STALE_HASH,
    PUBLISH_CHECKPOINT,
    PUBLISH_PARTIAL_TAIL,
    StaleHashLeft,
)
from kvtrace.cache.hashing import BlockHash
from kvtrace.cache.managers.base import SingleTypeManager
from kvtrace.cache.plans import STATE_CHECKPOINT, STATE_EXTERNAL, STATE_RUNNING, BlockCopy, StateWrite
from kvtrace.cache.retention import mamba_reachable_mask
from kvtrace.numeric import cdiv

if TYPE_CHECKING:
    from kvtrace.cache.block_pool import BlockPool
    from kvtrace.cache.context import CacheContext
    from kvtrace.cache.request import Request


def mamba_checkpoint_position(num_tokens: int, unit: int) -> int:
    """The last hash boundary a later request can resume at after ``num_tokens`` tokens:
    a resend is capped at ``num_tokens - 1`` (vLLM's ``get_mamba_prefill_checkpoint_position``
    without EAGLE or hash lookahead)."""
    return max((num_tokens - 1) // unit * unit, 0)


def is_checkpoint_exportable(query_start: int, query_end: int, position: int, hash_block_size: int,
                             block_size: int, alignment: int | None) -> bool:
    """Whether the backend can export the state at ``position`` within the chunk
    [query_start, query_end) (vLLM's ``is_mamba_prefill_checkpoint_valid``)."""
    if alignment is None:
        return False
    return (
        query_start % hash_block_size == 0
        and cdiv(query_end, block_size) - 2 > (query_start - 1) // block_size
        and query_start + hash_block_size <= position
        and query_start < position < query_end
        and (position - query_start) % alignment == 0
    )


class MambaRequestState:
    """What the Mamba manager knows of one request, from its first allocation to ``free``.

    Invariants:
    * ``allocated`` (vLLM's ``_allocated_block_reqs``) becomes true at the request's first
      allocation that adds blocks, or (``external-hit-running-cow``) at one that needs
      none; from then on a partial-tail copy takes the running branch;
    * ``handed_out`` becomes true once the worker has seen the request's blocks: it then
      appends new block ids instead of setting the table;
    * ``checkpoint`` is the current allocation's checkpoint (position, slot) or None
      (vLLM's ``_checkpoints``), set by ``get_num_blocks_to_allocate``;
    * ``num_retired`` slots at the front have been freed for good.
    """

    __slots__ = ("allocated", "checkpoint", "handed_out", "last_state_block_idx", "num_retired", "unmarked")

    def __init__(self) -> None:
        self.allocated = False
        self.handed_out = False
        self.last_state_block_idx: int | None = None
        self.checkpoint: tuple[int, int] | None = None
        self.num_retired = 0
        self.unmarked = False  # left unallocated by an allocation needing no block (fix switched off)


class MambaManager(SingleTypeManager):
    is_mamba = True

    def __init__(self, group_id: int, spec: MambaSpec, pool: BlockPool, ctx: CacheContext):
        super().__init__(group_id, spec, pool, ctx)
        self.num_speculative_blocks = ctx.num_speculative_blocks
        self.has_checkpoint_blocks = ctx.num_prefill_checkpoint_blocks > 0
        self.reqs: dict[str, MambaRequestState] = {}
        # hashes published in this step: a hit ending on one waits a step
        self.cached_blocks_this_step: set[BlockHash] = set()

    def _state(self, request_id: str) -> MambaRequestState:
        st = self.reqs.get(request_id)
        if st is None:
            st = self.reqs[request_id] = MambaRequestState()
        return st

    def mark_handed_out(self, request_id: str) -> None:
        """The scheduler is about to hand this request's blocks to the worker."""
        self._state(request_id).handed_out = True

    def new_step_starts(self) -> None:
        self.cached_blocks_this_step.clear()

    # -- lookup -------------------------------------------------------------------
    def find_longest_cache_hit(
        self, fine: Sequence[BlockHash], max_length: int, alignment: int
    ) -> tuple[list[KVCacheBlock], int]:
        bs = self.block_size
        cached = self.cached
        null = self.null_block
        if alignment < bs:  # fine-grained: any hash boundary holding a state
            for fi in range(min(max_length // alignment, len(fine)) - 1, -1, -1):
                b = cached.get(fine[fi])
                if b is not None:
                    if type(b) is not KVCacheBlock:
                        b = next(iter(b.values()))
                    return [null] * (fi // self.scale) + [b], (fi + 1) * alignment
            return [], 0
        coarse = self.coarse(fine)
        for i in range(min(max_length // bs, len(coarse)) - 1, -1, -1):
            b = cached.get(coarse[i])
            if b is not None:
                if ((i + 1) * bs) % alignment:
                    continue
                if type(b) is not KVCacheBlock:
                    b = next(iter(b.values()))
                return [null] * i + [b], (i + 1) * bs
        return [], 0

    # -- allocation ---------------------------------------------------------------
    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens - 1

    def _remove_blocks_in_range(self, request_id: str, first: int, last: int) -> None:
        """Free table slots [first, last) back to front, skipping the null gaps between
        states, past the slots already retired."""
        table = self.req_to_blocks.get(request_id)
        if table is None:
            return
        st = self.reqs.get(request_id)
        if st is not None:
            first = max(first, st.num_retired)
        last = min(last, len(table))
        if first >= last:
            return
        freed = []
        null = self.null_block
        for i in range(last - 1, first - 1, -1):
            b = table[i]
            if b is null:
                continue
            freed.append(b)
            table[i] = null
        if freed:
            self.pool.free_blocks(freed, self.group_id)
        self._state(request_id).num_retired = last

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        super().remove_skipped_blocks(request_id, num_computed_tokens)
        st = self.reqs.get(request_id)
        last = st.last_state_block_idx if st is not None else None
        if last is not None and last < cdiv(num_computed_tokens, self.block_size) - 1:
            table = self.req_to_blocks.get(request_id)
            if table and table[last] is not self.null_block:
                self.pool.free_blocks([table[last]], self.group_id)
                table[last] = self.null_block

    def _needs_checkpoint(self, request_id: str, query_start: int, query_end: int, position: int,
                          prefill_end: int) -> bool:
        """Whether this chunk exports an internal checkpoint (vLLM's ``_needs_internal_checkpoint``)."""
        if not self.has_checkpoint_blocks or query_end < prefill_end:
            return False
        if not is_checkpoint_exportable(query_start, query_end, position, self.ctx.hash_block_size,
                                        self.block_size, self.ctx.prefill_checkpoint_alignment):
            return False
        idx = cdiv(query_end, self.block_size) - 2
        if idx < 0:
            return False
        table = self.req_to_blocks.get(request_id, ())
        if idx >= len(table) or table[idx].is_null:
            return True
        st = self.reqs.get(request_id)
        return st is not None and st.allocated and idx >= len(table) - self.num_speculative_blocks

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed: Sequence[KVCacheBlock],
        total_computed: int, num_local_computed: int, num_tokens_main: int, prefill_end: int,
        apply_admission_cap: bool = False,
    ) -> int:
        """Also decides this allocation's checkpoint. Answers more blocks than the pool
        holds when the hit ends on a state published in this step (the same-step rule).

        ``apply_admission_cap``: the full-sequence admission gate's count, vLLM's align-mode
        one (no cap of its own; the checkpoint is counted, not recorded, and nothing else
        changes: no state is made, no switched-off behaviour acts)."""
        if new_computed and new_computed[-1].block_hash in self.cached_blocks_this_step:
            return self.pool.num_blocks + 1
        bs = self.block_size
        spec_n = self.num_speculative_blocks
        num_tokens = num_tokens_main  # align mode ignores lookahead slots
        table = self.req_to_blocks.get(request_id, ())
        n = cdiv(num_tokens, bs) + spec_n - len(new_computed) - len(table)
        has_partial = bool(new_computed and num_local_computed % bs) or request_id in self.partial_hit_reqs
        if has_partial:
            n = max(n, 0) + 1
        # At retention 0 (prefill_end > 0) only the chunk reaching the end of prefill
        # reserves a checkpoint; switched off, every chunk does (the old behaviour).
        transient_rule = self.ctx.transient_checkpoint_retention
        position = mamba_checkpoint_position(num_tokens, self.ctx.cache_hit_alignment)
        if not self._needs_checkpoint(request_id, total_computed, num_tokens, position,
                                      prefill_end if transient_rule else 0):
            position = 0
        st = self.reqs.get(request_id)
        if not apply_admission_cap:  # (the gate only counts: the chunk's own call records)
            if position > 0:
                if not transient_rule and num_tokens < prefill_end:
                    self.ctx.old_behaviour(TRANSIENT_CHECKPOINT_RETENTION, request_id)
                st = st or self._state(request_id)
                st.checkpoint = (position, cdiv(num_tokens, bs) - 2)
            elif st is not None:
                st.checkpoint = None
        if n > 0:
            cap = 1 + int(has_partial) + int(position > 0)
            if st is None or not st.allocated:
                cap += spec_n
            n = min(n, cap)
            if (not apply_admission_cap and total_computed > num_local_computed
                    and cdiv(num_tokens, bs) > cdiv(total_computed, bs)):
                # kvtrace only: an external load takes a block of its own before the chunk's
                # state block, which vLLM 0.33's count leaves out (its get_new_blocks would
                # then raise with exactly that many blocks free); the admission gate's count
                # is vLLM's as it is
                n += 1
        return n + sum([b.ref_cnt == 0 and not b.is_null for b in new_computed])

    def _swap_in_running_copy(self, request_id: str, src: KVCacheBlock, dst: KVCacheBlock) -> None:
        """Running branch of a partial-tail copy: the worker's table is append-only, so
        the live block stays and the cache entry moves to the copy."""
        self.pool.move_block_hashes(src, dst, request_id)
        src.ref_cnt += 1
        self.ctx.retained.append((self.pool, src))
        self.ctx.retained.append((self.pool, dst))
        self.ctx.queue_copy(BlockCopy(self.group_id, src.block_id, dst.block_id, request_id, COPY_RUNNING_TAIL))
        if dst.block_hash is not None:  # filled by this step's copy: same-step hits wait
            self.cached_blocks_this_step.add(dst.block_hash)

    def allocate_new_blocks(self, request: Request, num_tokens: int, num_tokens_main: int,
                            step_start: int) -> list[KVCacheBlock]:
        rid = request.request_id
        st = self._state(rid)
        table = self.req_to_blocks.setdefault(rid, [])
        bs = self.block_size
        spec_n = self.num_speculative_blocks
        required = cdiv(num_tokens_main, bs) + spec_n
        checkpoint = st.checkpoint
        partial = self.partial_hit_reqs.pop(rid, None)
        if required <= len(table) and partial is None and checkpoint is None:
            # No new state block (e.g. the first continuation after an external hit
            # stays inside the loaded block). The fix marks the request allocated, so a
            # later partial-tail copy takes the running branch.
            if self.ctx.external_hit_running_cow:
                st.allocated = True
            elif not st.allocated:
                st.unmarked = True  # the old behaviour; it shows when a partial-tail copy follows
            return []
        prev_len = len(table)
        allocated = st.allocated
        if allocated:  # the running state sits in the first of the last 1 + spec_n blocks
            st.last_state_block_idx = prev_len - 1 - spec_n
        elif prev_len > 0:  # a new request's hit state is its last block
            st.last_state_block_idx = prev_len - 1
        num_skipped = required - spec_n - 1
        ckpt = int(checkpoint is not None)
        null = self.null_block
        if prev_len < num_skipped - ckpt:
            table.extend([null] * (num_skipped - ckpt - prev_len))
        if allocated:  # relocate this request's speculative blocks the step leaves behind
            for idx in range(prev_len - spec_n, prev_len):
                if idx >= num_skipped - ckpt:
                    break
                table.append(table[idx])
                table[idx] = null
        n_new = max(required - len(table), 0) + (1 if partial is not None else 0)
        blocks = self.pool.get_new_blocks(n_new, self.group_id, rid)
        out = table[prev_len:]
        if partial is not None:
            idx, src = partial
            dst, blocks = blocks[0], blocks[1:]
            if allocated:
                assert table[idx] is src
                self._swap_in_running_copy(rid, src, dst)
            else:
                if st.unmarked:
                    self.ctx.old_behaviour(EXTERNAL_HIT_RUNNING_COW, rid)
                if st.handed_out:
                    # First-prefill branch on a request the worker already runs: the
                    # worker will append the copy and keep writing the old block, which
                    # keeps its key.
                    self._stale_left(rid, src)
                self._swap_in_copy(rid, idx, src, dst)
                out = [dst, *out]
        table.extend(blocks)
        out.extend(blocks)
        st.allocated = True
        if checkpoint is not None:
            pos, slot = checkpoint
            self.ctx.state_writes.append(StateWrite(rid, self.group_id, table[slot].block_id, pos, STATE_CHECKPOINT))
        return out

    def _stale_left(self, request_id: str, src: KVCacheBlock) -> None:
        sink = self.ctx.sink
        self.ctx.stats.stale_hash_left += 1
        if src.block_hash is not None and sink.enabled:
            sink.events.append(
                StaleHashLeft(sink.step, request_id, self.group_id, src.block_id, src.block_hash, src.hash_num_tokens)
            )

    def allocate_external_blocks(self, request: Request, num_local: int, num_external: int) -> None:
        rid = request.request_id
        table = self.req_to_blocks.setdefault(rid, [])
        total = num_local + num_external
        n = cdiv(total, self.block_size) - len(table)
        if num_external <= 0 or n <= 0:
            return
        blocks = self.pool.get_new_blocks(n, self.group_id, rid)
        table.extend(blocks)
        b = table[-1]
        self.ctx.state_writes.append(StateWrite(rid, self.group_id, b.block_id, total, STATE_EXTERNAL))
        self.ctx.note_external_load(rid, self.group_id, b)

    def queue_external_tail_write(self, request: Request, num_local: int, num_external: int) -> None:
        return  # the loaded state is one block, written by allocate_external_blocks

    def queue_running_state(self, request: Request, num_tokens_main: int) -> None:
        """Queue the write of the state after the step's last token into its slot."""
        table = self.req_to_blocks.get(request.request_id)
        if not table:
            return
        slot = cdiv(num_tokens_main, self.block_size) - 1
        if 0 <= slot < len(table) and table[slot] is not self.null_block:
            self.ctx.state_writes.append(
                StateWrite(request.request_id, self.group_id, table[slot].block_id, num_tokens_main, STATE_RUNNING)
            )

    # -- caching ------------------------------------------------------------------
    def reachable_mask(self, request: Request, start: int, end: int) -> tuple[list[bool] | None, set[int]]:
        # Like vLLM, a kept slot takes its block-end key whatever state it holds: the
        # scheduler's block-aligned split is what makes that state the block end's.
        return mamba_reachable_mask(
            start, end, self.block_size, self.ctx.cache_hit_alignment,
            self.ctx.retention_interval, self.reachable_boundaries(request),
        )

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        rid = request.request_id
        before = self.num_cached_block.get(rid, 0)
        super().cache_blocks(request, num_tokens)
        after = self.num_cached_block.get(rid, 0)
        published = self._cache_partial_tail_block(request, num_tokens)
        this_step = self.cached_blocks_this_step
        if published is not None:
            this_step.add(published)
        if after > before:
            table = self.req_to_blocks[rid]
            for b in table[before:after]:
                if not b.is_null and b.block_hash is not None:
                    this_step.add(b.block_hash)

    def _is_transient(self, request: Request, position: int) -> bool:
        """A checkpoint no later request resumes at: not the prompt's, not one the
        retention mask keeps, not the shared-prefix junction."""
        if position == mamba_checkpoint_position(request.num_prompt_tokens, self.ctx.cache_hit_alignment):
            return False
        if position % self.block_size == 0:
            j = position // self.block_size - 1
            mask, _ = mamba_reachable_mask(j, j + 1, self.block_size, self.ctx.cache_hit_alignment,
                                           self.ctx.retention_interval)
            if mask is None or mask[0]:
                return False
        return not (self.ctx.pinning and position == request.shared_prefix_boundary)

    def _cache_partial_tail_block(self, request: Request, num_tokens: int) -> BlockHash | None:
        """Key this step's checkpoint, or the prompt's partial tail when the step ends there.
        Returns the key published (or already there), None otherwise."""
        rid = request.request_id
        hbs = self.ctx.hash_block_size
        table = self.req_to_blocks[rid]
        st = self.reqs.get(rid)
        checkpoint = st.checkpoint if st is not None else None
        if checkpoint is not None:
            pos, slot = checkpoint
            b = table[slot]
            if self._is_transient(request, pos):
                if self.ctx.transient_checkpoint_retention:
                    # Request-local checkpoint: not published. The state about to be
                    # written overwrites the slot, so a key it carries would go stale.
                    self.pool.evict_block_keys(b, EVICT_STALE_HASH, rid)
                    return None
                self.ctx.old_behaviour(TRANSIENT_CHECKPOINT_RETENTION, rid)
            if b.block_hash is not None and b.hash_num_tokens == pos:
                return None
            return self.pool.cache_partial_block(
                self.group_id, rid, b, request.block_hashes[pos // hbs - 1], pos, PUBLISH_CHECKPOINT,
                replace_existing_hashes=True,
            )
        if num_tokens <= 0 or num_tokens % hbs:
            return None
        if num_tokens != mamba_checkpoint_position(request.num_prompt_tokens, hbs):
            return None  # a state exists only at the step's last token
        slot = cdiv(num_tokens, self.block_size) - 1
        if slot >= len(table) or table[slot].is_null:
            return None
        b = table[slot]
        if b.block_hash is not None and b.hash_num_tokens == num_tokens:
            return None  # keyed here already (a hit, or an earlier step)
        h = self.pool.cache_partial_block(
            self.group_id, rid, b, request.block_hashes[num_tokens // hbs - 1], num_tokens, PUBLISH_PARTIAL_TAIL
        )
        if h is not None and num_tokens % self.block_size:
            # The producer keeps writing this block in place: copy before it does.
            self.partial_hit_reqs[rid] = (slot, b)
            self.num_cached_block[rid] = slot
        return h

    # -- release ------------------------------------------------------------------
    def free(self, request_id: str) -> list[KVCacheBlock]:
        self.reqs.pop(request_id, None)
        return super().free(request_id)
