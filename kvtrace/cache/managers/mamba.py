"""Mamba/KDA state in vLLM's ``mamba_cache_mode="align"`` (vLLM's ``MambaManager``).

A state summarises exactly the prefix it consumed, so a hit of length L needs a state
stored after exactly L tokens: the scan runs right to left for the last cached state
whose length is a multiple of the alignment. Table slot p holds the state after
``(p + 1) * bs`` tokens; slots skipped over are null. Each step the state after the
step's last token goes to the slot of that token (``StateWrite(kind="running")``), and
the previous state block (``last_state_block_idx``) is freed once consumed (it stays
hashed if cached). With ``num_prefill_checkpoint_blocks`` a prefill chunk also writes
internal checkpoints (FlashKDA) into slots inside the chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtrace.cache.blocks import KVCacheBlock
from kvtrace.cache.config import MambaSpec
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


class MambaRequestState:
    """What the Mamba manager knows of one request, from its first allocation to ``free``.

    Invariants:
    * ``allocated`` (vLLM's ``_allocated_block_reqs``) becomes true at the request's first
      allocation that adds blocks, or (``external-hit-running-cow``) at one that needs
      none; from then on a partial-tail copy takes the running branch;
    * ``handed_out`` becomes true once the worker has seen the request's blocks: it then
      appends new block ids instead of setting the table;
    * ``state_pos[slot]`` is the number of tokens the state in ``slot`` summarises. A slot
      takes its block-end key only when that equals the block end (a state materialised
      exactly there), so any chunking keeps keys honest;
    * ``checkpoints`` is this step's checkpoint plan [(position, slot)], None between
      steps (``cache_blocks`` consumes it).
    """

    __slots__ = ("allocated", "checkpoints", "handed_out", "last_state_block_idx", "state_pos")

    def __init__(self) -> None:
        self.allocated = False
        self.handed_out = False
        self.last_state_block_idx: int | None = None
        self.checkpoints: list[tuple[int, int]] | None = None
        self.state_pos: dict[int, int] = {}


class MambaManager(SingleTypeManager):
    is_mamba = True

    def __init__(self, group_id: int, spec: MambaSpec, pool: BlockPool, ctx: CacheContext):
        super().__init__(group_id, spec, pool, ctx)
        self.num_speculative_blocks = ctx.num_speculative_blocks
        self.reqs: dict[str, MambaRequestState] = {}

    def _state(self, request_id: str) -> MambaRequestState:
        st = self.reqs.get(request_id)
        if st is None:
            st = self.reqs[request_id] = MambaRequestState()
        return st

    def mark_handed_out(self, request_id: str) -> None:
        """The scheduler is about to hand this request's blocks to the worker."""
        self._state(request_id).handed_out = True

    # -- lookup -------------------------------------------------------------------
    def find_longest_cache_hit(
        self, fine: list[BlockHash], max_length: int, alignment: int
    ) -> tuple[list[KVCacheBlock], int]:
        bs = self.block_size
        lookup = self.pool.lookup_for_hit
        null = self.null_block
        if alignment < bs:  # partial hits: any hash boundary holding a state
            hbs = alignment
            for fi in range(min(max_length // hbs, len(fine)) - 1, -1, -1):
                b = lookup(fine[fi])
                if b is not None:
                    return [null] * (fi // self.scale) + [b], (fi + 1) * hbs
            return [], 0
        coarse = self.coarse(fine)
        for i in range(min(max_length // bs, len(coarse)) - 1, -1, -1):
            if ((i + 1) * bs) % alignment:
                continue
            b = lookup(coarse[i])
            if b is not None:
                return [null] * i + [b], (i + 1) * bs
        return [], 0

    # -- allocation ---------------------------------------------------------------
    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(num_computed_tokens - 1, 0)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        super().remove_skipped_blocks(request_id, num_computed_tokens)
        st = self.reqs.get(request_id)
        last = st.last_state_block_idx if st is not None else None
        if last is not None and last < cdiv(num_computed_tokens, self.block_size) - 1:
            table = self.req_to_blocks.get(request_id)
            if table and last < len(table) and table[last] is not self.null_block:
                self.pool.free_blocks([table[last]])
                table[last] = self.null_block

    def _plan_checkpoints(self, request: Request, step_start: int, query_end: int,
                          table_len: int) -> list[tuple[int, int]]:
        """(position, slot) of this chunk's internal checkpoints: slot cdiv(end, bs) - 2
        (then - 3, ...), holding the state after the last hash boundary before the chunk
        end (then one block earlier, ...), never before the chunk start."""
        n = self.ctx.num_prefill_checkpoint_blocks
        if not n or step_start >= request.num_prompt_tokens:
            return []
        bs, hbs = self.block_size, self.ctx.hash_block_size
        out = []
        last_boundary = (query_end - 1) // hbs * hbs
        for j in range(1, n + 1):
            slot = cdiv(query_end, bs) - 1 - j
            pos = last_boundary - (j - 1) * bs
            if slot < table_len or slot < 0 or pos <= step_start:
                break
            out.append((pos, slot))
        return out

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed: Sequence[KVCacheBlock],
                                   num_local_computed: int, total_computed: int) -> int:
        table = self.req_to_blocks.get(request_id, ())
        prev = len(table) + len(new_computed)
        required = cdiv(num_tokens, self.block_size) + self.num_speculative_blocks
        n = min(required - prev, 1 + self.num_speculative_blocks) if required > prev else 0
        n += self.ctx.num_prefill_checkpoint_blocks if required > prev else 0
        n += sum(1 for b in new_computed if b.ref_cnt == 0 and not b.is_null)
        if new_computed and num_local_computed % self.block_size:
            n += 1
        if request_id in self.partial_hit_reqs:
            n += 1
        return n

    def add_computed_blocks(self, request_id: str, blocks: list[KVCacheBlock], num_local_computed: int) -> None:
        super().add_computed_blocks(request_id, blocks, num_local_computed)
        if blocks:  # the hit state lives in the last hit block
            self._state(request_id).state_pos = {len(blocks) - 1: num_local_computed}

    def _partial_hit_index(self, blocks: list[KVCacheBlock], num_local_computed: int) -> int:
        return len(blocks) - 1  # the state block, not the one holding token L

    def apply_cow(self, request: Request, new_out: list[KVCacheBlock]) -> None:
        rid = request.request_id
        pending = self.partial_hit_reqs.pop(rid, None)
        if pending is None:
            return
        idx, src = pending
        table = self.req_to_blocks[rid]
        if idx >= len(table) or table[idx] is not src or src.block_hash is None:
            return
        st = self._state(rid)
        if st.allocated:
            # Running: the worker's table is append-only, so the live block stays and
            # the cache entry moves to the copy.
            (dst,) = self.pool.get_new_blocks(1, rid)
            self.pool.move_block_hashes(src, dst, rid)
            src.ref_cnt += 1
            self.ctx.retained.append((self.pool, src))
            self.ctx.retained.append((self.pool, dst))
            self.ctx.queue_copy(BlockCopy(self.group_id, src.block_id, dst.block_id, rid, COPY_RUNNING_TAIL))
            return
        if st.handed_out:
            # First-prefill branch on a request the worker already runs: the worker will
            # append the copy and keep writing the old block, which keeps its key.
            sink = self.ctx.sink
            self.ctx.stats.stale_hash_left += 1
            if sink.enabled:
                sink.events.append(
                    StaleHashLeft(sink.step, rid, self.group_id, src.block_id, src.block_hash, src.hash_num_tokens)
                )
        self._swap_in_copy(request, idx, src, new_out)
        st.allocated = True

    def allocate_external_blocks(
        self, request: Request, num_local: int, num_external: int, new_out: list[KVCacheBlock]
    ) -> None:
        rid = request.request_id
        table = self.req_to_blocks.setdefault(rid, [])
        total = num_local + num_external
        slot = cdiv(total, self.block_size) - 1
        if slot < len(table):
            return
        # the local hit's state is superseded by the loaded one
        if table and table[-1] is not self.null_block:
            old = table[-1]
            table[-1] = self.null_block
            self.pool.free_blocks([old])
        self.partial_hit_reqs.pop(rid, None)
        while len(table) < slot:
            table.append(self.null_block)
            new_out.append(self.null_block)
        (b,) = self.pool.get_new_blocks(1, rid)
        table.append(b)
        new_out.append(b)
        self._state(rid).state_pos[slot] = total
        self.ctx.state_writes.append(StateWrite(rid, self.group_id, b.block_id, total, STATE_EXTERNAL))
        self.ctx.note_external_load(rid, self.group_id, b)

    def allocate_new_blocks(
        self, request: Request, num_tokens: int, num_tokens_main: int, step_start: int, new_out: list[KVCacheBlock]
    ) -> None:
        rid = request.request_id
        st = self._state(rid)
        table = self.req_to_blocks.setdefault(rid, [])
        spec_n = self.num_speculative_blocks
        required = cdiv(num_tokens_main, self.block_size) + spec_n
        ckpts = self._plan_checkpoints(request, step_start, num_tokens_main, len(table))
        if num_tokens_main > step_start:
            st.state_pos[cdiv(num_tokens_main, self.block_size) - 1] = num_tokens_main
        if required <= len(table):
            # No new state block (e.g. the first continuation after an external hit
            # stays inside the loaded block). The fix marks the request allocated so a
            # later partial-tail CoW takes the running branch.
            if self.ctx.external_hit_running_cow:
                st.allocated = True
            return
        prev_len = len(table)
        allocated = st.allocated
        if allocated:
            st.last_state_block_idx = prev_len - 1 - spec_n
        elif prev_len > 0:
            st.last_state_block_idx = prev_len - 1
        num_skipped = required - spec_n - 1
        null = self.null_block
        while len(table) < num_skipped:
            table.append(null)
        if allocated:  # reuse this request's speculative blocks
            for idx in range(prev_len - spec_n, prev_len):
                if idx < num_skipped:
                    table.append(table[idx])
                    table[idx] = null
                else:
                    break
        n_new = required - len(table)
        blocks = self.pool.get_new_blocks(n_new + len(ckpts), rid)
        for (_pos, slot), b in zip(ckpts, blocks[n_new:]):
            table[slot] = b
        table.extend(blocks[:n_new])
        new_out.extend(table[prev_len:])
        if ckpts:
            st.checkpoints = ckpts
            for pos, slot in ckpts:
                st.state_pos[slot] = pos
                self.ctx.state_writes.append(
                    StateWrite(rid, self.group_id, table[slot].block_id, pos, STATE_CHECKPOINT)
                )
        st.allocated = True

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
        mask, owed = mamba_reachable_mask(
            start, end, self.block_size, self.ctx.scheduler_block_size,
            self.ctx.retention_interval, self.reachable_boundaries(request),
        )
        # Only slots holding the state at their own block end may take the full key
        # (this step's checkpoint slots go through the checkpoint branch afterwards).
        st = self.reqs.get(request.request_id)
        positions = st.state_pos if st is not None else {}
        ckpt_slots = {slot for _, slot in (st.checkpoints or ())} if st is not None else set()
        bs = self.block_size
        for i in range(start, end):
            if i in ckpt_slots:
                continue
            if positions.get(i) != (i + 1) * bs:
                if mask is None:
                    mask = [True] * (end - start)
                mask[i - start] = False
                owed.discard(i)
        return mask, owed

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        super().cache_blocks(request, num_tokens)
        self._cache_partial_tail_block(request, num_tokens, self.ctx.retention_interval)

    def _cache_partial_tail_block(self, request: Request, num_tokens: int, retention_interval: int | None) -> None:
        """Key this step's checkpoints, or the prompt's partial tail when the step ends there."""
        rid = request.request_id
        hbs = self.ctx.hash_block_size
        table = self.req_to_blocks[rid]
        st = self.reqs.get(rid)
        ckpts = st.checkpoints if st is not None else None
        if ckpts is not None:
            assert st is not None
            st.checkpoints = None
            for pos, slot in ckpts:
                b = table[slot]
                if (
                    self.ctx.transient_checkpoint_retention
                    and retention_interval == 0
                    and num_tokens < request.num_prompt_tokens
                    and pos != request.shared_prefix_boundary
                ):
                    # Request-local checkpoint: not published. The state about to be
                    # written overwrites the slot, so a key it carries would go stale.
                    self.pool.evict_block_keys(b, EVICT_STALE_HASH, rid)
                    continue
                if b.block_hash is not None and b.hash_num_tokens == pos:
                    continue
                self.pool.cache_partial_block(
                    rid, b, request.block_hashes[pos // hbs - 1], pos, PUBLISH_CHECKPOINT,
                    replace_existing_hashes=True,
                )
            return
        if not self.ctx.enable_partial_hits:
            return
        boundary = request.num_prompt_tokens // hbs * hbs
        if boundary == 0 or boundary != num_tokens or boundary % self.block_size == 0:
            return  # a state exists only at the step's last token
        slot = (boundary - 1) // self.block_size
        if slot >= len(table) or table[slot] is self.null_block:
            return
        b = table[slot]
        h = self.pool.cache_partial_block(
            rid, b, request.block_hashes[boundary // hbs - 1], boundary, PUBLISH_PARTIAL_TAIL
        )
        if h is not None:
            # The producer keeps writing this block in place: copy before it does.
            self.partial_hit_reqs[rid] = (slot, b)

    # -- release ------------------------------------------------------------------
    def free(self, request_id: str) -> list[KVCacheBlock]:
        self.reqs.pop(request_id, None)
        return super().free(request_id)
