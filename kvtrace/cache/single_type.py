"""Per-group managers: full attention, sliding window, Mamba/KDA state (align mode).

Each owns its group's block tables (``req_to_blocks``) and applies the group's hit
rule, allocation rule, skipped-block rule and retention mask, after vLLM's
``SingleTypeKVCacheManager`` family. Hashes come in ``hash_block_size`` units
("fine"); a group block i uses the fine hash at (i+1)*scale-1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtrace.cache.block_pool import BlockPool, KVCacheBlock
from kvtrace.cache.config import (
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from kvtrace.cache.events import (
    COPY_PARTIAL_HIT,
    COPY_RUNNING_TAIL,
    EVICT_STALE_HASH,
    PUBLISH_BOUNDARY,
    PUBLISH_CHECKPOINT,
    PUBLISH_FULL,
    PUBLISH_PARTIAL_TAIL,
    StaleHashLeft,
)
from kvtrace.cache.plans import STATE_CHECKPOINT, STATE_EXTERNAL, STATE_RUNNING, BlockCopy, StateWrite
from kvtrace.cache.retention import mamba_reachable_mask, swa_reachable_mask

if TYPE_CHECKING:
    from kvtrace.cache.manager import _Context
    from kvtrace.cache.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SingleTypeManager:
    """Common bookkeeping; subclasses define the hit and skip rules."""

    supports_fine_grained = False
    is_mamba = False

    def __init__(self, group_id: int, spec, pool: BlockPool, ctx: "_Context"):
        self.group_id = group_id
        self.spec = spec
        self.block_size = spec.block_size
        self.scale = spec.block_size // ctx.hash_block_size
        self.pool = pool
        self.null_block = pool.null_block
        self.ctx = ctx
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        # req -> (table index, source block): a hit or producer tail that ends inside a
        # block and must be copied before this request writes into that block.
        self.partial_hit_reqs: dict[str, tuple[int, KVCacheBlock]] = {}

    # -- hashes -------------------------------------------------------------------
    def coarse(self, fine: list[bytes]) -> list[bytes]:
        s = self.scale
        return fine if s == 1 else fine[s - 1::s]

    # -- lookup -------------------------------------------------------------------
    def find_longest_cache_hit(
        self, fine: list[bytes], max_length: int, alignment: int
    ) -> tuple[list[KVCacheBlock], int]:
        raise NotImplementedError

    # -- allocation ---------------------------------------------------------------
    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return 0

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed: list[KVCacheBlock],
        num_local_computed: int, total_computed: int,
    ) -> int:
        num_required = cdiv(num_tokens, self.block_size)
        existing = len(self.req_to_blocks.get(request_id, ())) + len(new_computed)
        skipped = self.get_num_skipped_tokens(total_computed) // self.block_size
        n = max(num_required - max(skipped, existing), 0)
        if new_computed:
            n += sum([b.ref_cnt == 0 and not b.is_null for b in new_computed])
        if new_computed and num_local_computed % self.block_size:
            n += 1  # copy-on-write block for a hit ending mid-block
        if request_id in self.partial_hit_reqs:
            n += 1
        return n

    def add_computed_blocks(self, request_id: str, blocks: list[KVCacheBlock], num_local_computed: int) -> None:
        """Take the hit blocks of a new request (touch) and note a mid-block hit for CoW."""
        table = self.req_to_blocks.setdefault(request_id, [])
        if not blocks:
            self.num_cached_block.setdefault(request_id, len(table))
            return
        assert not table, f"{request_id}: hit blocks for a request that already has blocks"
        self.pool.touch(blocks)
        table.extend(blocks)
        self.num_cached_block[request_id] = len(blocks)
        if num_local_computed % self.block_size:
            idx = self._partial_hit_index(blocks, num_local_computed)
            self.partial_hit_reqs[request_id] = (idx, blocks[idx])
            self.num_cached_block[request_id] = idx  # re-cache from the copy when it fills

    def _partial_hit_index(self, blocks: list[KVCacheBlock], num_local_computed: int) -> int:
        """Table index of the block a mid-block hit ends in."""
        return num_local_computed // self.block_size

    def apply_cow(self, request: "Request", new_out: list[KVCacheBlock]) -> None:
        """Redirect a mid-block hit to a private copy (first-prefill branch)."""
        pending = self.partial_hit_reqs.pop(request.request_id, None)
        if pending is None:
            return
        idx, src = pending
        table = self.req_to_blocks[request.request_id]
        if idx >= len(table) or table[idx] is not src:
            return
        self._swap_in_copy(request, idx, src, new_out)

    def _swap_in_copy(self, request: "Request", idx: int, src: KVCacheBlock, new_out: list[KVCacheBlock]) -> None:
        rid = request.request_id
        (dst,) = self.pool.get_new_blocks(1, rid)
        self.req_to_blocks[rid][idx] = dst
        # src keeps the table's reference until the copy ran; dst takes one extra.
        dst.ref_cnt += 1
        self.ctx.retained.append((self.pool, src))
        self.ctx.retained.append((self.pool, dst))
        self.ctx.queue_copy(BlockCopy(self.group_id, src.block_id, dst.block_id, rid, COPY_PARTIAL_HIT))
        new_out.append(dst)

    def allocate_external_blocks(self, request: "Request", num_local: int, num_external: int, new_out) -> None:
        """Blocks for tokens loaded from the external tier (before any local compute)."""
        rid = request.request_id
        table = self.req_to_blocks.setdefault(rid, [])
        total = num_local + num_external
        skipped = self.get_num_skipped_tokens(total) // self.block_size
        while len(table) < min(skipped, cdiv(total, self.block_size)):
            table.append(self.null_block)
            new_out.append(self.null_block)
        bs = self.block_size
        if num_local % bs and len(table) > num_local // bs:
            # the local hit ends inside this block: the load fills the rest of it
            b = table[num_local // bs]
            self.ctx.state_writes.append(
                StateWrite(rid, self.group_id, b.block_id, min((num_local // bs + 1) * bs, total), STATE_EXTERNAL)
            )
        n = cdiv(total, bs) - len(table)
        if n <= 0:
            return
        first = len(table)
        blocks = self.pool.get_new_blocks(n, rid)
        table.extend(blocks)
        new_out.extend(blocks)
        for i, b in enumerate(blocks, start=first):
            self.ctx.state_writes.append(
                StateWrite(rid, self.group_id, b.block_id, min((i + 1) * self.block_size, total), STATE_EXTERNAL)
            )
            self.ctx.note_external_load(request, self.group_id, b)

    def allocate_new_blocks(
        self, request: "Request", num_tokens: int, num_tokens_main: int, step_start: int, new_out: list
    ) -> None:
        rid = request.request_id
        table = self.req_to_blocks.setdefault(rid, [])
        n = cdiv(num_tokens, self.block_size) - len(table)
        if n > 0:
            blocks = self.pool.get_new_blocks(n, rid)
            table.extend(blocks)
            new_out.extend(blocks)

    # -- caching ------------------------------------------------------------------
    def reachable_mask(self, request: "Request", start: int, end: int):
        return None, set()

    def cache_blocks(self, request: "Request", num_tokens: int) -> None:
        rid = request.request_id
        num_cached = self.num_cached_block.get(rid, 0)
        num_full = num_tokens // self.block_size
        if num_cached >= num_full:
            return
        mask, owed = self.reachable_mask(request, num_cached, num_full)
        fine = request.block_hashes
        self.pool.cache_full_blocks(
            rid, self.req_to_blocks[rid], self.coarse(fine), num_cached, num_full, self.block_size,
            mask, PUBLISH_FULL, {i: PUBLISH_BOUNDARY for i in owed} if owed else None,
        )
        self.num_cached_block[rid] = num_full

    def reachable_boundaries(self, request: "Request") -> list[int]:
        out = [request.num_prompt_tokens - 1]
        if self.ctx.pinning and request.shared_prefix_boundary:
            out.append(request.shared_prefix_boundary)
        return out

    # -- release ------------------------------------------------------------------
    def _remove_blocks_in_range(self, request_id: str, first: int, last: int) -> None:
        table = self.req_to_blocks.get(request_id)
        if not table or first >= last:
            return
        last = min(last, len(table))
        freed = []
        null = self.null_block
        for i in range(last - 1, first - 1, -1):
            b = table[i]
            if b is null:
                break
            freed.append(b)
            table[i] = null
        if freed:
            self.pool.free_blocks(freed)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        skipped = self.get_num_skipped_tokens(num_computed_tokens)
        if skipped <= 0:
            return
        self._remove_blocks_in_range(request_id, 0, skipped // self.block_size)

    def free(self, request_id: str) -> list[KVCacheBlock]:
        """Return the request's blocks to the pool, tail first; returns them in that order."""
        table = self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        self.partial_hit_reqs.pop(request_id, None)
        if not table:
            return []
        null = self.null_block
        ordered = [b for b in reversed(table) if b is not null]
        self.pool.free_blocks(ordered)
        return ordered


class FullAttentionManager(SingleTypeManager):
    supports_fine_grained = True

    def find_longest_cache_hit(self, fine, max_length, alignment):
        bs = self.block_size
        scale = self.scale
        coarse = fine if scale == 1 else fine[scale - 1::scale]  # self.coarse, inlined (per lookup)
        pool = self.pool
        cached, step = pool.cached, pool.step
        blocks: list[KVCacheBlock] = []
        append = blocks.append
        for h in coarse[: max_length // bs]:
            b = cached.get(h)
            if b is None:
                break
            if type(b) is not KVCacheBlock or b.published_step == step:
                b = pool.lookup_for_hit(h)  # duplicates, or published this step
                if b is None:
                    break
            append(b)
        hit = len(blocks) * bs
        if alignment < bs:  # partial hits: probe hash boundaries inside the next block
            first = len(blocks) * scale
            last = min(first + scale - 1, max_length // alignment, len(fine))
            for fi in range(last - 1, first - 1, -1):
                b = pool.lookup_for_hit(fine[fi])
                if b is not None:
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
        self.pool.free_blocks(ordered)
        return ordered

    def cache_blocks(self, request, num_tokens):
        super().cache_blocks(request, num_tokens)
        if self.ctx.enable_partial_hits and self.scale > 1:
            self._cache_partial_tail_block(request, num_tokens)

    def _cache_partial_tail_block(self, request, num_tokens) -> None:
        hbs = self.ctx.hash_block_size
        boundary = request.num_prompt_tokens // hbs * hbs
        if boundary == 0 or boundary > num_tokens or boundary % self.block_size == 0:
            return
        table = self.req_to_blocks[request.request_id]
        idx = boundary // self.block_size
        if idx >= len(table):
            return
        b = table[idx]
        if b.block_hash is not None and b.hash_num_tokens >= boundary:
            return
        self.pool.cache_partial_block(
            request.request_id, b, request.block_hashes[boundary // hbs - 1], boundary, PUBLISH_PARTIAL_TAIL
        )


class SlidingWindowManager(SingleTypeManager):
    def __init__(self, group_id, spec: SlidingWindowSpec, pool, ctx):
        super().__init__(group_id, spec, pool, ctx)
        self.sliding_window = spec.sliding_window
        self.need = cdiv(spec.sliding_window - 1, spec.block_size)  # contiguous blocks for a hit

    def find_longest_cache_hit(self, fine, max_length, alignment):
        bs = self.block_size
        align = max(alignment, bs)
        coarse = self.coarse(fine)
        lookup = self.pool.lookup_for_hit
        n_max = min(max_length // bs, len(coarse))
        seen: list = [None] * n_max
        need = self.need
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

    def get_num_skipped_tokens(self, num_computed_tokens):
        return max(num_computed_tokens - self.sliding_window + 1, 0)

    def reachable_mask(self, request, start, end):
        return swa_reachable_mask(
            start, end, self.block_size, self.ctx.scheduler_block_size, self.need,
            self.ctx.retention_interval, self.reachable_boundaries(request),
        )


class MambaManager(SingleTypeManager):
    """Recurrent state in vLLM's align mode: table slot p holds the state after (p+1)*bs tokens.

    Each step the state after the step's last token goes to the table's last block
    (``StateWrite(kind="running")``); slots skipped over are null. The previous state
    block (``last_state_block_idx``) is freed once consumed (it stays hashed if cached).
    """

    supports_fine_grained = True
    is_mamba = True

    def __init__(self, group_id, spec: MambaSpec, pool, ctx):
        super().__init__(group_id, spec, pool, ctx)
        self.num_speculative_blocks = ctx.num_speculative_blocks
        self.allocated_block_reqs: set[str] = set()  # vLLM's _allocated_block_reqs
        self.last_state_block_idx: dict[str, int] = {}
        self.checkpoints: dict[str, list[tuple[int, int]]] = {}  # req -> [(position, slot)] this step
        self.handed_out: set[str] = set()  # requests whose blocks the worker has seen
        # req -> {slot: tokens its state summarises}. A slot is keyed at its block end
        # only if its state was materialised exactly there (robust to chunk splits).
        self.state_pos: dict[str, dict[int, int]] = {}

    def find_longest_cache_hit(self, fine, max_length, alignment):
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

    def get_num_skipped_tokens(self, num_computed_tokens):
        return max(num_computed_tokens - 1, 0)

    def remove_skipped_blocks(self, request_id, num_computed_tokens):
        super().remove_skipped_blocks(request_id, num_computed_tokens)
        last = self.last_state_block_idx.get(request_id)
        if last is not None and last < cdiv(num_computed_tokens, self.block_size) - 1:
            table = self.req_to_blocks.get(request_id)
            if table and last < len(table) and table[last] is not self.null_block:
                self.pool.free_blocks([table[last]])
                table[last] = self.null_block

    def _plan_checkpoints(self, request, step_start: int, query_end: int, table_len: int) -> list[tuple[int, int]]:
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

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed, num_local_computed, total_computed):
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

    def add_computed_blocks(self, request_id, blocks, num_local_computed):
        super().add_computed_blocks(request_id, blocks, num_local_computed)
        if blocks:  # the hit state lives in the last hit block
            self.state_pos[request_id] = {len(blocks) - 1: num_local_computed}

    def _partial_hit_index(self, blocks, num_local_computed):
        return len(blocks) - 1  # the state block, not the one holding token L

    def apply_cow(self, request, new_out):
        rid = request.request_id
        pending = self.partial_hit_reqs.pop(rid, None)
        if pending is None:
            return
        idx, src = pending
        table = self.req_to_blocks[rid]
        if idx >= len(table) or table[idx] is not src or src.block_hash is None:
            return
        if rid in self.allocated_block_reqs:
            # Running: the worker's table is append-only, so the live block stays and
            # the cache entry moves to the copy.
            (dst,) = self.pool.get_new_blocks(1, rid)
            self.pool.move_block_hashes(src, dst, rid)
            src.ref_cnt += 1
            self.ctx.retained.append((self.pool, src))
            self.ctx.retained.append((self.pool, dst))
            self.ctx.queue_copy(BlockCopy(self.group_id, src.block_id, dst.block_id, rid, COPY_RUNNING_TAIL))
            return
        if rid in self.handed_out:
            # First-prefill branch on a request the worker already runs: the worker will
            # append the copy and keep writing the old block, which keeps its key.
            sink = self.ctx.sink
            self.ctx.stats.stale_hash_left += 1
            if sink.enabled:
                sink.events.append(
                    StaleHashLeft(sink.step, rid, self.group_id, src.block_id, src.block_hash, src.hash_num_tokens)
                )
        self._swap_in_copy(request, idx, src, new_out)
        self.allocated_block_reqs.add(rid)

    def allocate_external_blocks(self, request, num_local, num_external, new_out):
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
        self.state_pos.setdefault(rid, {})[slot] = total
        self.ctx.state_writes.append(StateWrite(rid, self.group_id, b.block_id, total, STATE_EXTERNAL))
        self.ctx.note_external_load(request, self.group_id, b)

    def allocate_new_blocks(self, request, num_tokens, num_tokens_main, step_start, new_out):
        rid = request.request_id
        table = self.req_to_blocks.setdefault(rid, [])
        spec_n = self.num_speculative_blocks
        required = cdiv(num_tokens_main, self.block_size) + spec_n
        ckpts = self._plan_checkpoints(request, step_start, num_tokens_main, len(table))
        if num_tokens_main > step_start:
            self.state_pos.setdefault(rid, {})[cdiv(num_tokens_main, self.block_size) - 1] = num_tokens_main
        if required <= len(table):
            # No new state block (e.g. the first continuation after an external hit
            # stays inside the loaded block). The fix marks the request allocated so a
            # later partial-tail CoW takes the running branch.
            if self.ctx.external_hit_running_cow:
                self.allocated_block_reqs.add(rid)
            return
        prev_len = len(table)
        allocated = rid in self.allocated_block_reqs
        if allocated:
            self.last_state_block_idx[rid] = prev_len - 1 - spec_n
        elif prev_len > 0:
            self.last_state_block_idx[rid] = prev_len - 1
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
        for (pos, slot), b in zip(ckpts, blocks[n_new:]):
            table[slot] = b
        table.extend(blocks[:n_new])
        new_out.extend(table[prev_len:])
        if ckpts:
            self.checkpoints[rid] = ckpts
            positions = self.state_pos.setdefault(rid, {})
            for (pos, slot) in ckpts:
                positions[slot] = pos
                self.ctx.state_writes.append(
                    StateWrite(rid, self.group_id, table[slot].block_id, pos, STATE_CHECKPOINT)
                )
        self.allocated_block_reqs.add(rid)

    def queue_running_state(self, request, num_tokens_main: int) -> None:
        table = self.req_to_blocks.get(request.request_id)
        if not table:
            return
        slot = cdiv(num_tokens_main, self.block_size) - 1
        if 0 <= slot < len(table) and table[slot] is not self.null_block:
            self.ctx.state_writes.append(
                StateWrite(request.request_id, self.group_id, table[slot].block_id, num_tokens_main, STATE_RUNNING)
            )

    def reachable_mask(self, request, start, end):
        mask, owed = mamba_reachable_mask(
            start, end, self.block_size, self.ctx.scheduler_block_size,
            self.ctx.retention_interval, self.reachable_boundaries(request),
        )
        # Only slots holding the state at their own block end may take the full key
        # (this step's checkpoint slots go through the checkpoint branch afterwards).
        positions = self.state_pos.get(request.request_id, {})
        ckpt_slots = {slot for _, slot in self.checkpoints.get(request.request_id, ())}
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

    def cache_blocks(self, request, num_tokens):
        super().cache_blocks(request, num_tokens)
        self._cache_partial_tail_block(request, num_tokens, self.ctx.retention_interval)

    def _cache_partial_tail_block(self, request, num_tokens: int, retention_interval: int | None) -> None:
        rid = request.request_id
        hbs = self.ctx.hash_block_size
        table = self.req_to_blocks[rid]
        ckpts = self.checkpoints.pop(rid, None)
        if ckpts is not None:
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

    def free(self, request_id):
        self.allocated_block_reqs.discard(request_id)
        self.last_state_block_idx.pop(request_id, None)
        self.checkpoints.pop(request_id, None)
        self.handed_out.discard(request_id)
        self.state_pos.pop(request_id, None)
        return super().free(request_id)


MANAGER_FOR_SPEC = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    MambaSpec: MambaManager,
}
