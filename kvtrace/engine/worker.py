"""The worker: its own block tables, device content, sampling and verification.

It builds its tables ONLY from ``SchedulerOutput`` (a new request's table is set, a
running request's table gets the new block ids appended) and never reads the Core's
tables. Per step it executes the copies, writes every scheduled token's kv into the
slot its table names, advances each Mamba state from the block its table names at the
chunk start to the block its table names at the chunk end (plus checkpoint writes),
and samples for every request that consumed all its known tokens. A Core/Worker
disagreement therefore becomes wrong content, which the no-cache reference catches.

Two things come from the Core as block ids rather than table slots, as in vLLM: the
copy list and the internal prefill checkpoint writes. The Core's ``running`` and
``external`` state writes are only compared with the worker's own table slot
(``table_disagreements``), never obeyed. Sampling gathers the batch's tables from a
device block-table tensor (vLLM's worker-side ``BlockTable``); the decode-step reference
is advanced for the whole batch at once from per-request "tips" on the CPU.

Speed: per-step arrays are small, so the cost is the number of array calls, not the
data (numpy on the CPU, torch on a GPU: :mod:`kvtrace.engine.arrays`). Decode tokens
(one token that consumes the request's last known one) therefore go
as one batch built from one host list (``_decode_write``, ``_decode_sample``), and only
the prefill chunks take the general path; the split is made only where the two parts
touch disjoint blocks, so every value is what one pass gives (tests/engine/
test_decode_fast_path.py compares both ways event by event).
"""

from __future__ import annotations

import numpy as np

from kvtrace.cache import CacheConfig, FullAttentionSpec, MambaSpec, SlidingWindowSpec
from kvtrace.cache.plans import STATE_CHECKPOINT, STATE_EXTERNAL, STATE_RUNNING
from kvtrace.engine.arrays import Array
from kvtrace.engine.block_table import BlockTableTensor
from kvtrace.engine.content import KV_A, KV_B, KV_C, ContentModel, P, kv_values
from kvtrace.engine.reference import PrefixOracle, TraceBlockMemo
from kvtrace.engine.request import EngineRequest
from kvtrace.engine.scheduler import SchedulerOutput
from kvtrace.engine.step import Divergence, StepResult, tally
from kvtrace.engine.storage import DeviceStorage, first_sums
from kvtrace.numeric import cdiv
from kvtrace.workload.lines import VOCAB_SIZE


class _Seq:
    """The worker's per-request state: its own block tables (one list per group) and its row
    in the device block-table tensors."""

    __slots__ = ("request", "row", "tables", "tip_n")

    def __init__(self, request: EngineRequest, tables: list[list[int]], row: int):
        self.request = request
        self.tables = tables
        self.row = row
        self.tip_n = -1  # the reference tip (row of Worker._tip_*) holds the state after tip_n tokens


class Worker:
    decode_fast_path = True  # False: every step takes the general path (tests compare both)

    def __init__(self, cache_config: CacheConfig, storage: DeviceStorage, verify: bool = True):
        self.cache_config = cache_config
        self.storage = storage
        self.device = storage.device
        self.xp = xp = storage.arrays
        self.verify = verify
        self.full_groups = [g for g, s in enumerate(cache_config.groups) if isinstance(s, FullAttentionSpec)]
        self.swa_groups = [g for g, s in enumerate(cache_config.groups) if isinstance(s, SlidingWindowSpec)]
        self.attn_groups = self.full_groups + self.swa_groups
        self.state_groups = [g for g, s in enumerate(cache_config.groups) if isinstance(s, MambaSpec)]
        self.block_size = [s.block_size for s in cache_config.groups]
        lanes = {s.num_lanes for s in cache_config.groups if isinstance(s, MambaSpec)} or {4}
        if len(lanes) != 1:
            raise ValueError("all MambaSpec groups must have the same num_lanes")
        self.num_lanes = lanes.pop()
        self.content = ContentModel(self.num_lanes, xp)
        self.ref_model = ContentModel(self.num_lanes, "cpu")
        self.memo = TraceBlockMemo(self.ref_model)
        self.seqs: dict[str, _Seq] = {}
        self.table_tensors = {g: BlockTableTensor(xp) for g in self.full_groups}
        self._free_rows: list[int] = []
        # Reference tips per row (CPU, numpy: a few small ops per step, where torch's per-op
        # overhead is the cost): the decode step's reference, vectorised over the batch.
        self._tip_state = np.zeros((64, self.num_lanes), dtype=np.int64)
        self._tip_tsum = np.zeros(64, dtype=np.int64)
        self._ref_m = np.asarray(self.ref_model.multipliers, dtype=np.int64)
        self._next_row = 0
        self.oracles: dict[str, PrefixOracle] = {}  # survive preemption, dropped on finish

    def oracle(self, request) -> PrefixOracle:
        o = self.oracles.get(request.request_id)
        if o is None:
            o = self.oracles[request.request_id] = PrefixOracle(self.ref_model, request, self.memo)
        return o

    # -- tables ---------------------------------------------------------------------------------
    def drop(self, request_id: str) -> None:
        s = self.seqs.pop(request_id, None)
        if s is not None:
            self._free_rows.append(s.row)

    def forget(self, request_id: str) -> None:
        """A finished request: drop its table and its reference."""
        self.drop(request_id)
        self.oracles.pop(request_id, None)

    def _new_seq(self, request: EngineRequest, tables: list[list[int]]) -> _Seq:
        if self._free_rows:
            row = self._free_rows.pop()
        else:
            row = self._next_row
            self._next_row += 1
        for g, tt in self.table_tensors.items():
            tt.set_row(row, tables[g])
        if row >= self._tip_tsum.shape[0]:
            cap = 2 * max(row, self._tip_tsum.shape[0])
            self._tip_state = np.concatenate(
                [self._tip_state, np.zeros((cap - self._tip_state.shape[0], self.num_lanes), dtype=np.int64)])
            self._tip_tsum = np.concatenate([self._tip_tsum, np.zeros(cap - self._tip_tsum.shape[0], dtype=np.int64)])
        return _Seq(request, tables, row)

    def block_table(self, request_id: str) -> tuple[list[int], ...]:
        """The worker's own table of a running request (per group)."""
        return tuple(self.seqs[request_id].tables)

    # -- one step -------------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> StepResult:
        for rid in out.finished_req_ids:
            self.forget(rid)
        for rid in out.preempted_req_ids:
            self.drop(rid)
        res = StepResult(sampled={}, divergences=[])
        work: list[tuple[_Seq, int, int]] = []  # (seq, start, num_tokens)
        loads: list[tuple[_Seq, int, int]] = []
        for nr in out.scheduled_new_reqs:
            old = self.seqs.get(nr.request_id)
            if old is not None:  # resumed without a preemption notice: start over
                self.drop(nr.request_id)
            s = self._new_seq(nr.request, [list(ids) for ids in nr.block_ids])
            self.seqs[nr.request_id] = s
            if nr.num_external_tokens:
                loads.append((s, nr.num_computed_tokens - nr.num_external_tokens, nr.num_computed_tokens))
            work.append((s, nr.num_computed_tokens, out.num_scheduled_tokens[nr.request_id]))
        for cr in out.scheduled_cached_reqs:
            s = self.seqs[cr.request_id]
            for g, ids in enumerate(cr.new_block_ids):
                if ids:
                    tt = self.table_tensors.get(g)
                    if tt is not None:
                        tt.append(s.row, len(s.tables[g]), ids)
                    s.tables[g].extend(ids)
            work.append((s, cr.num_computed_tokens, out.num_scheduled_tokens[cr.request_id]))

        # Copies first: a copy-on-write block receives the shared part of its block,
        # then an external load may fill the rest of it.
        if out.block_copies:
            self.storage.copy_blocks(out.block_copies)
            for c in out.block_copies:
                if c.group_id in self.state_groups:
                    res.num_state_copies += 1
                else:
                    res.num_kv_copies += 1
        if loads:
            self._load_external(loads)
            for sw in out.state_writes:  # the Core names the block it loaded; ours must agree
                if sw.kind == STATE_EXTERNAL:
                    mine = self.seqs[sw.request_id].tables[sw.group_id][
                        cdiv(sw.num_tokens, self.block_size[sw.group_id]) - 1
                    ]
                    if mine != sw.block_id:
                        res.table_disagreements += 1
        if work:
            self._compute(work, out, res)
        return res

    def _load_external(self, loads: list[tuple[_Seq, int, int]]) -> None:
        """Fill [start, end) from the external tier.

        The tier is modelled as holding correct content (a store written from correct
        blocks), so the loaded kv and state come from the tokens, via the reference.
        """
        for s, start, end in loads:
            self._write_kv(s, start, end, s.request.get_token_ids(start, end))
            if self.state_groups:
                st = self.xp.ints([self.oracle(s.request).state_at(end)])
                for g in self.state_groups:
                    blk = s.tables[g][cdiv(end, self.block_size[g]) - 1]
                    self.storage.write_states(g, self.xp.ints([blk]), st)

    def _write_kv(self, s: _Seq, start: int, end: int, tokens: np.ndarray) -> None:
        xp = self.xp
        vals = kv_values(xp.from_host(tokens), xp.arange(start, end))
        for g in self.attn_groups:
            bs = self.block_size[g]
            table = np.asarray(s.tables[g], dtype=np.int64)
            p = np.arange(start, end, dtype=np.int64)
            self.storage.write_kv(g, xp.from_host(table[p // bs]), xp.from_host(p % bs), vals)

    @staticmethod
    def _token_at(request, position: int) -> int:
        p = request.num_prompt_tokens
        return int(request.prompt_token_ids[position]) if position < p else request.output_token_ids[position - p]

    def _compute(self, work: list[tuple[_Seq, int, int]], out: SchedulerOutput, res: StepResult) -> None:
        """Content for the step: decode tokens by ``_decode_write`` and ``_decode_sample``, the
        rest (prefill chunks) by ``_compute_general``.

        The split changes nothing: the two parts touch disjoint blocks (checked; else the
        whole step goes the general way), each part's reads see the other's writes exactly
        as one pass would, and the results are put back in the batch's order.
        """
        split = self._split_decodes(work, out) if self.decode_fast_path else None
        if split is None:
            self._compute_general(work, out, res)
            return
        dec, rest, running_core = split
        slow: list[tuple[int, Divergence]] = []
        sampled: dict[str, int] = {}
        # decode writes, then the rest (whose sampling sees them), then decode sampling
        staged = self._decode_write(dec, res, running_core)
        if rest:
            rest_res = StepResult(sampled={}, divergences=[])
            self._compute_general([w for _, w in rest], out, rest_res)
            sampled.update(rest_res.sampled)
            index = {w[0].request.request_id: i for i, w in rest}
            slow.extend((index[d.request_id], d) for d in rest_res.divergences)
            res.table_disagreements += rest_res.table_disagreements
            res.prefill_pairs += rest_res.prefill_pairs
            res.num_prefill_tokens += rest_res.num_prefill_tokens
            res.prefill_spans.extend(rest_res.prefill_spans)
            res.num_decode_seqs += rest_res.num_decode_seqs
            res.decode_context_tokens += rest_res.decode_context_tokens
        fast = self._decode_sample(dec, staged, res, sampled, slow)
        for w in work:  # the batch's order (the engine finishes requests in it)
            rid = w[0].request.request_id
            if rid in sampled:
                res.sampled[rid] = sampled[rid]
        res.divergences.extend(fast)
        slow.sort(key=lambda x: x[0])
        res.divergences.extend(d for _, d in slow)

    def _split_decodes(self, work, out: SchedulerOutput):
        """(decodes, the rest with their batch index, the Core's running state writes), or
        None when the step must go the general way: a sliding-window group, no decode, or
        blocks that a decode and a prefill chunk both touch."""
        if self.swa_groups:
            return None
        dec: list[tuple[int, _Seq, int]] = []
        rest: list[tuple[int, tuple[_Seq, int, int]]] = []
        for i, w in enumerate(work):
            sq, a, n = w
            req = sq.request
            if n == 1 and a >= req.num_prompt_tokens and a + 1 == req.num_prompt_tokens + len(req.output_token_ids):
                dec.append((i, sq, a))
            else:
                rest.append((i, w))
        if not dec:
            return None
        running_core: dict[tuple[str, int], int] = {}
        checkpointed = set()
        for sw in out.state_writes:
            if sw.kind == STATE_RUNNING:
                running_core[(sw.request_id, sw.group_id)] = sw.block_id
            elif sw.kind == STATE_CHECKPOINT:
                checkpointed.add(sw.request_id)
        if checkpointed and any(sq.request.request_id in checkpointed for _, sq, _ in dec):
            return None
        if rest:
            for g in self.attn_groups:
                bs = self.block_size[g]
                mine = {sq.tables[g][a // bs] for _, sq, a in dec}
                for _, (sq, a, n) in rest:
                    if not mine.isdisjoint(sq.tables[g][a // bs: (a + n - 1) // bs + 1]):
                        return None
            for g in self.state_groups:
                bs = self.block_size[g]
                mine = set()
                for _, sq, a in dec:
                    t = sq.tables[g]
                    mine.add(t[(a + bs - 1) // bs - 1])
                    mine.add(t[a // bs])  # cdiv(a + 1, bs) - 1
                theirs = set()
                for _, (sq, a, n) in rest:
                    t = sq.tables[g]
                    if a > 0:
                        theirs.add(t[(a + bs - 1) // bs - 1])
                    theirs.add(t[(a + n + bs - 1) // bs - 1])
                theirs.update(sw.block_id for sw in out.state_writes
                              if sw.group_id == g and sw.kind == STATE_CHECKPOINT)
                if not mine.isdisjoint(theirs):
                    return None
            for _, (sq, a, n) in rest:  # the rest's divergences must all be the slow kind
                if sq.tip_n == a + n - 1 and a + n == sq.request.num_tokens:
                    return None
        return dec, rest, running_core

    def _decode_write(self, dec: list[tuple[int, _Seq, int]], res: StepResult,
                      running_core: dict[tuple[str, int], int]) -> tuple:
        """One token each for requests that consumed all but their last known token: write
        its kv and advance each state. Returns what ``_decode_sample`` needs."""
        B = len(dec)
        toks = [sq.request.output_token_ids[-1] for _, sq, _ in dec]  # the token at position a
        pos = [a for _, _, a in dec]
        ends = [a + 1 for a in pos]
        # One host list, one array: the per-call cost, not the data, dominates at this size.
        host: list[int] = [(t * KV_A + a * KV_B + KV_C) % P for t, a in zip(toks, pos)]
        host += toks
        at: dict[str, int] = {}

        def put(name: str, values: list[int]) -> None:
            at[name] = len(host)
            host.extend(values)

        distinct = {}
        for g in self.attn_groups:
            bs = self.block_size[g]
            blocks = [sq.tables[g][a // bs] for _, sq, a in dec]
            distinct[g] = len(set(blocks)) == B  # else two requests write one block: a cache bug
            put(f"blk{g}", blocks)
            put(f"slot{g}", [a % bs for a in pos])
        for g in self.state_groups:
            bs = self.block_size[g]
            src = [sq.tables[g][(a + bs - 1) // bs - 1] for _, sq, a in dec]
            dst = [sq.tables[g][a // bs] for _, sq, a in dec]
            if running_core:
                for (_, sq, _), d in zip(dec, dst):
                    core = running_core.get((sq.request.request_id, g))
                    if core is not None and core != d:
                        res.table_disagreements += 1
            put(f"src{g}", src)
            put(f"dst{g}", dst)
        widths = {}
        if self.full_groups:
            put("rows", [sq.row for _, sq, _ in dec])
            for g in self.full_groups:  # the blocks before the one written: full
                bs = self.block_size[g]
                nfull = [a // bs for a in pos]
                widths[g] = max(nfull)
                put(f"nfull{g}", nfull)
        xp = self.xp
        h = xp.ints(host)

        def view(name: str) -> Array:
            return h[at[name]: at[name] + B]

        vals, tokens = h[:B], h[B: 2 * B]
        total = None
        for g in self.attn_groups:
            # The block written holds the context's last tokens, up to and with this one;
            # nothing else writes it this step (checked).
            blk, slot = view(f"blk{g}"), view(f"slot{g}")
            if distinct[g]:
                part = self.storage.append_kv(g, blk, slot, vals)
            else:
                self.storage.write_kv(g, blk, slot, vals)
                part = first_sums(xp, self.storage.read_kv(g, blk), slot + 1)
            if g in widths:
                total = part if total is None else total + part
        for g in self.state_groups:
            s0 = self.storage.read_states(g, view(f"src{g}"))
            states = self.content.step_one(s0, tokens)
            self.storage.write_states(g, view(f"dst{g}"), states)
            lanes = states.sum(1)
            total = lanes if total is None else total + lanes
        res.num_decode_seqs += B  # step.tally's decode count, for the whole batch
        res.decode_context_tokens += sum(ends)
        return toks, ends, widths, view, total

    def _decode_sample(self, dec: list[tuple[int, _Seq, int]], staged: tuple, res: StepResult,
                       sampled: dict[str, int], slow: list[tuple[int, Divergence]]) -> list[Divergence]:
        """Sample the decode tokens staged by ``_decode_write`` and check them against the
        reference. Returns the divergences found through the tips (those found the oracle's
        way go to ``slow`` with their batch index)."""
        toks, ends, widths, view, total = staged
        for g in self.full_groups:
            w = widths[g]
            if w:  # the full blocks: their maintained sums, through the worker's own table
                tab = self.table_tensors[g].t[:, :w][view("rows")]
                block_sum = self.storage.block_sum[g]
                assert block_sum is not None
                sums = block_sum.take(tab)
                kv = first_sums(self.xp, sums, view(f"nfull{g}"))
                total = kv if total is None else total + kv
        assert total is not None
        out = (total % P % VOCAB_SIZE).tolist()
        for (_, sq, _), t in zip(dec, out):
            sampled[sq.request.request_id] = t
        if not self.verify:
            return []
        fast: list[Divergence] = []
        tips = [k for k, (_, sq, a) in enumerate(dec) if sq.tip_n == a]
        if tips:
            seqs = [dec[k][1] for k in tips]
            ref = self._advance_tips(seqs, [sq.row for sq in seqs], [toks[k] for k in tips], [ends[k] for k in tips])
            for k, sq, r in zip(tips, seqs, ref):
                if r != out[k]:
                    fast.append(Divergence(sq.request.request_id, sq.request.num_output_tokens, r, out[k]))
        if len(tips) < len(dec):
            tipped = set(tips)
            for k, (i, sq, a) in enumerate(dec):
                if k not in tipped:  # first token after a resume: the oracle's way
                    r = self._slow_reference(sq, a + 1, True)
                    if r != out[k]:
                        slow.append((i, Divergence(sq.request.request_id, sq.request.num_output_tokens, r, out[k])))
        return fast

    def _compute_general(self, work: list[tuple[_Seq, int, int]], out: SchedulerOutput, res: StepResult) -> None:
        xp = self.xp
        B = len(work)
        starts = [w[1] for w in work]
        lens = [w[2] for w in work]
        ends = [a + n for a, n in zip(starts, lens)]
        decode_only = max(lens) == 1
        tok_list = None
        if decode_only:  # one token each: plain lists beat numpy at this size
            tok_list = [self._token_at(w[0].request, w[1]) for w in work]
            tokens = xp.ints(tok_list)
            positions = xp.ints(starts)
            pos_np = None
        else:
            tok_np = np.concatenate([w[0].request.get_token_ids(w[1], w[1] + w[2]) for w in work])
            pos_np = np.concatenate([np.arange(a, e, dtype=np.int64) for a, e in zip(starts, ends)])
            tokens = xp.from_host(tok_np)
            positions = xp.from_host(pos_np)

        # Attention: every token's kv into the slot its table names.
        if self.attn_groups:
            vals = kv_values(tokens, positions)
            for g in self.attn_groups:
                bs = self.block_size[g]
                if decode_only:
                    blocks = [w[0].tables[g][a // bs] for w, a in zip(work, starts)]
                    block_t = xp.ints(blocks)
                    slot_t = xp.ints([a % bs for a in starts])
                    touched_t = block_t
                else:
                    pieces, touched = [], []
                    for (sq, a, n) in work:
                        b0, b1 = a // bs, (a + n - 1) // bs
                        run = sq.tables[g][b0 : b1 + 1]
                        touched.extend(run)
                        if b0 == b1:
                            pieces.append(np.full(n, run[0], dtype=np.int64))
                        else:
                            # (annotated: numpy's stubs pick a timedelta64 overload for clip)
                            counts: np.ndarray = np.diff(np.clip(np.arange(b0, b1 + 2, dtype=np.int64) * bs, a, a + n))
                            pieces.append(np.repeat(np.asarray(run, dtype=np.int64), counts))
                    block_t = xp.from_host(np.concatenate(pieces))
                    assert pos_np is not None  # set unless decode_only
                    slot_t = xp.from_host(pos_np % bs)
                    touched_t = xp.ints(touched)
                self.storage.write_kv(g, block_t, slot_t, vals, touched_t)

        # Recurrent state: read at the chunk start, write at the chunk end (+ checkpoints).
        end_states: list[Array] = []
        if self.state_groups:
            extra: list[tuple[int, int, int]] = []  # (group, block, query row)
            q_seg = list(range(B))
            q_end = list(ends)
            running_core: dict[tuple[str, int], int] = {}
            if out.state_writes:
                seq_index = {w[0].request.request_id: i for i, w in enumerate(work)}
                for sw in out.state_writes:
                    if sw.kind == STATE_CHECKPOINT:
                        i = seq_index.get(sw.request_id)
                        if i is not None and starts[i] < sw.num_tokens <= ends[i]:
                            extra.append((sw.group_id, sw.block_id, len(q_end)))
                            q_seg.append(i)
                            q_end.append(sw.num_tokens)
                    elif sw.kind == STATE_RUNNING:
                        running_core[(sw.request_id, sw.group_id)] = sw.block_id
            fresh = [i for i, a in enumerate(starts) if a == 0]
            closed_form = None
            for g in self.state_groups:
                bs = self.block_size[g]
                src = [w[0].tables[g][cdiv(a, bs) - 1] if a > 0 else 0 for w, a in zip(work, starts)]
                dst = [w[0].tables[g][cdiv(e, bs) - 1] for w, e in zip(work, ends)]
                if running_core:
                    for w, d in zip(work, dst):
                        core = running_core.get((w[0].request.request_id, g))
                        if core is not None and core != d:
                            res.table_disagreements += 1
                s0 = self.storage.read_states(g, xp.ints(src))
                if fresh:
                    s0[xp.ints(fresh)] = 0
                if decode_only and not extra:
                    states = self.content.step_one(s0, tokens)
                else:
                    if closed_form is None:
                        offsets = [0] * B
                        for i in range(1, B):
                            offsets[i] = offsets[i - 1] + lens[i - 1]
                        closed_form = (
                            xp.ints(offsets),
                            xp.ints(starts),
                            xp.ints(q_seg),
                            xp.ints(q_end),
                        )
                    states = self.content.advance(s0, tokens, positions, *closed_form, max_end=max(q_end),
                                                  ranges=list(zip(starts, ends)))
                self.storage.write_states(g, xp.ints(dst), states[:B])
                for grp, blk, row in extra:
                    if grp == g:
                        self.storage.write_states(
                            g, xp.ints([blk]), states[row : row + 1]
                        )
                end_states.append(states[:B])

        # Sample for every request that has consumed all its known tokens.
        sample_idx = [i for i, (sq, a, n) in enumerate(work) if tally(res, sq.request, a, n)]
        if sample_idx:
            self._sample(work, sample_idx, ends, end_states, res, tok_list)

    def _sample(
        self, work, sample_idx: list[int], ends: list[int], end_states: list[Array], res: StepResult,
        tok_list: list[int] | None = None,
    ) -> None:
        xp = self.xp
        S = len(sample_idx)
        total = xp.zeros(S)
        if end_states:
            state_rows = xp.ints(sample_idx) if len(work) > S else None
            for states in end_states:  # the state each group's table slot now holds
                total += (states if state_rows is None else states[state_rows]).sum(1)
        if self.full_groups:
            e_list, row_list, seqs = [], [], []
            for i in sample_idx:
                sq = work[i][0]
                e_list.append(ends[i])
                row_list.append(sq.row)
                seqs.append(sq)
            e_t = xp.ints(e_list)
            rows = xp.ints(row_list)
        for g in self.full_groups:
            bs = self.block_size[g]
            width = max([len(sq.tables[g]) for sq in seqs])
            tab = self.table_tensors[g].t[rows][:, :width]  # [S, W]: the worker's own tables
            nfull = e_t // bs
            rem = e_t - nfull * bs
            # full blocks: their maintained sums; the last, partial block: its first rem slots
            sums = self.storage.block_sum[g].take(tab)  # type: ignore[union-attr]  # attention groups have sums
            total += first_sums(xp, sums, nfull)
            last = tab[xp.arange(S), xp.minimum(nfull, width - 1)]
            vals = self.storage.data[g][last]  # [S, bs]
            total += first_sums(xp, vals, rem)
        for g in self.swa_groups:
            bs = self.block_size[g]
            window = self.cache_config.groups[g].sliding_window  # type: ignore[union-attr]  # an SWA group
            acc_list = []
            for i in sample_idx:
                e = ends[i]
                p = np.arange(max(0, e - window), e, dtype=np.int64)
                t = np.asarray(work[i][0].tables[g], dtype=np.int64)
                vals = self.storage.slot_values(g, xp.from_host(t[p // bs]), xp.from_host(p % bs))
                acc_list.append(int(vals.sum()) % P)
            total += xp.ints(acc_list)
        sampled = (total % P % VOCAB_SIZE).tolist()
        for k, i in enumerate(sample_idx):
            res.sampled[work[i][0].request.request_id] = sampled[k]
        if not self.verify:
            return
        fast_k: list[int] = []
        fast_rows: list[int] = []
        fast_tok: list[int] = []
        fast_end: list[int] = []
        slow_k: list[int] = []
        use_tips = not self.swa_groups
        for k, i in enumerate(sample_idx):
            sq = work[i][0]
            e = ends[i]
            if use_tips and sq.tip_n == e - 1:
                fast_k.append(k)
                fast_rows.append(sq.row)
                fast_tok.append(tok_list[i] if tok_list is not None else self._token_at(sq.request, e - 1))
                fast_end.append(e)
            else:
                slow_k.append(k)
        if fast_k:  # decode: advance every reference tip by its one token at once
            seqs = [work[sample_idx[k]][0] for k in fast_k]
            ref = self._advance_tips(seqs, fast_rows, fast_tok, fast_end)
            for k, sq, r in zip(fast_k, seqs, ref):
                if r != sampled[k]:
                    res.divergences.append(
                        Divergence(sq.request.request_id, sq.request.num_output_tokens, r, sampled[k])
                    )
        for k in slow_k:  # first token, resume, or a sliding window: the oracle's way
            i = sample_idx[k]
            sq = work[i][0]
            r = self._slow_reference(sq, ends[i], use_tips)
            if r != sampled[k]:
                res.divergences.append(Divergence(sq.request.request_id, sq.request.num_output_tokens, r, sampled[k]))

    def _advance_tips(self, seqs: list[_Seq], rows_l: list[int], tok_l: list[int], end_l: list[int]) -> list[int]:
        """The reference tokens of decode steps whose tips stand one token back; tips advance."""
        rows = np.asarray(rows_l, dtype=np.int64)
        tok = np.asarray(tok_l, dtype=np.int64)
        e = np.asarray(end_l, dtype=np.int64)
        st = (self._tip_state[rows] * self._ref_m + tok[:, None]) % P
        ts = self._tip_tsum[rows] + tok
        self._tip_state[rows] = st
        self._tip_tsum[rows] = ts
        pos_sum = (e - 1) * e // 2 % P
        kv = (KV_A * (ts % P) + KV_B * pos_sum + KV_C * e) % P
        ref = (st.sum(axis=1) % P * len(self.state_groups) + kv * len(self.full_groups)) % P % VOCAB_SIZE
        for sq in seqs:
            sq.tip_n += 1
        return ref.tolist()

    def _slow_reference(self, sq: _Seq, end: int, use_tips: bool) -> int:
        """The reference token after ``end`` tokens from the oracle; the tip is set there."""
        r = self.reference_token(sq.request, end)
        if use_tips:
            state, tsum = self.oracle(sq.request).point(end)
            self._tip_state[sq.row] = state
            self._tip_tsum[sq.row] = tsum
            sq.tip_n = end
        return r

    # -- the no-cache reference -------------------------------------------------------------------
    def reference_token(self, request, end: int) -> int:
        """The token a run without any cache samples after the first ``end`` tokens."""
        o = self.oracle(request)
        if not self.swa_groups:
            fast = o.decode_token(end, len(self.state_groups), len(self.full_groups))
            if fast is not None:
                return fast % VOCAB_SIZE
        lanes, kv = o.sample_parts(end)
        total = lanes * len(self.state_groups) + kv * len(self.full_groups)
        for g in self.swa_groups:
            window = self.cache_config.groups[g].sliding_window  # type: ignore[union-attr]  # an SWA group
            total += o.kv_sum(max(0, end - window), end)
        return total % P % VOCAB_SIZE
