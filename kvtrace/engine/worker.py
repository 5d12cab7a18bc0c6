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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvtrace.cache import CacheConfig, FullAttentionSpec, MambaSpec, SlidingWindowSpec
from kvtrace.engine.content import KV_A, KV_B, KV_C, P, ContentModel, kv_values
from kvtrace.cache.plans import STATE_CHECKPOINT, STATE_EXTERNAL, STATE_RUNNING
from kvtrace.engine.storage import DeviceStorage
from kvtrace.workload.tokens import VOCAB_SIZE
from kvtrace.engine.block_table import BlockTableTensor
from kvtrace.engine.reference import PrefixOracle, TraceBlockMemo
from kvtrace.engine.request import EngineRequest
from kvtrace.engine.scheduler import SchedulerOutput
from kvtrace.numeric import cdiv


@dataclass(slots=True)
class Divergence:
    request_id: str
    position: int  # output index
    expected: int
    actual: int


@dataclass(slots=True)
class StepResult:
    sampled: dict[str, int]
    divergences: list[Divergence]
    num_kv_copies: int = 0
    num_state_copies: int = 0
    prefill_pairs: int = 0
    decode_context_tokens: int = 0
    num_decode_seqs: int = 0
    num_prefill_tokens: int = 0
    table_disagreements: int = 0  # Core's running-state block != the worker's table slot
    prefill_spans: list[tuple[str, int, int]] = field(default_factory=list)  # (request, start, num_tokens)


class _Seq:
    """The worker's per-request state: its own block tables (one list per group) and its row
    in the device block-table tensors."""

    __slots__ = ("request", "tables", "row", "tip_n")

    def __init__(self, request: EngineRequest, tables: list[list[int]], row: int):
        self.request = request
        self.tables = tables
        self.row = row
        self.tip_n = -1  # the reference tip (row of Worker._tip_*) holds the state after tip_n tokens


class Worker:
    def __init__(self, cache_config: CacheConfig, storage: DeviceStorage, verify: bool = True):
        self.cache_config = cache_config
        self.storage = storage
        self.device = storage.device
        self.verify = verify
        self.full_groups = [g for g, s in enumerate(cache_config.groups) if isinstance(s, FullAttentionSpec)]
        self.swa_groups = [g for g, s in enumerate(cache_config.groups) if isinstance(s, SlidingWindowSpec)]
        self.attn_groups = self.full_groups + self.swa_groups
        self.state_groups = [g for g, s in enumerate(cache_config.groups) if isinstance(s, MambaSpec)]
        self.block_size = [s.block_size for s in cache_config.groups]
        lanes = {cache_config.groups[g].num_lanes for g in self.state_groups} or {4}
        if len(lanes) != 1:
            raise ValueError("all MambaSpec groups must have the same num_lanes")
        self.num_lanes = lanes.pop()
        self.content = ContentModel(self.num_lanes, self.device)
        self.ref_model = ContentModel(self.num_lanes, "cpu")
        self.memo = TraceBlockMemo(self.ref_model)
        self.seqs: dict[str, _Seq] = {}
        self.table_tensors = {g: BlockTableTensor(self.device) for g in self.full_groups}
        self._free_rows: list[int] = []
        self._arange = torch.arange(1024, device=self.device).unsqueeze(0)
        # Reference tips per row (CPU): the decode step's reference, vectorised over the batch.
        self._tip_state = torch.zeros((64, self.num_lanes), dtype=torch.int64)
        self._tip_tsum = torch.zeros(64, dtype=torch.int64)
        self._ref_m = torch.tensor(self.ref_model.multipliers, dtype=torch.int64)
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
            self._tip_state = torch.cat([self._tip_state, torch.zeros((cap - self._tip_state.shape[0], self.num_lanes), dtype=torch.int64)])
            self._tip_tsum = torch.cat([self._tip_tsum, torch.zeros(cap - self._tip_tsum.shape[0], dtype=torch.int64)])
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
                    mine = self.seqs[sw.request_id].tables[sw.group_id][cdiv(sw.num_tokens, self.block_size[sw.group_id]) - 1]
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
                st = torch.tensor([self.oracle(s.request).state_at(end)], dtype=torch.int64, device=self.device)
                for g in self.state_groups:
                    blk = s.tables[g][cdiv(end, self.block_size[g]) - 1]
                    self.storage.write_states(g, torch.tensor([blk], dtype=torch.int64, device=self.device), st)

    def _write_kv(self, s: _Seq, start: int, end: int, tokens: np.ndarray) -> None:
        pos = torch.arange(start, end, dtype=torch.int64, device=self.device)
        vals = kv_values(torch.from_numpy(np.ascontiguousarray(tokens)).to(self.device), pos)
        for g in self.attn_groups:
            bs = self.block_size[g]
            table = np.asarray(s.tables[g], dtype=np.int64)
            p = np.arange(start, end, dtype=np.int64)
            blocks = torch.from_numpy(table[p // bs]).to(self.device)
            self.storage.write_kv(g, blocks, torch.from_numpy(p % bs).to(self.device), vals)

    def _aranges(self, n: int) -> torch.Tensor:
        """[1, n] column indices (cached; grown by doubling)."""
        a = self._arange
        if a.shape[1] < n:
            a = self._arange = torch.arange(max(n, 2 * a.shape[1]), device=self.device).unsqueeze(0)
        return a[:, :n]

    @staticmethod
    def _token_at(request, position: int) -> int:
        p = request.num_prompt_tokens
        return int(request.prompt_token_ids[position]) if position < p else request.output_token_ids[position - p]

    def _compute(self, work: list[tuple[_Seq, int, int]], out: SchedulerOutput, res: StepResult) -> None:
        dev = self.device
        B = len(work)
        starts = [w[1] for w in work]
        lens = [w[2] for w in work]
        ends = [a + n for a, n in zip(starts, lens)]
        decode_only = max(lens) == 1
        tok_list = None
        if decode_only:  # one token each: plain lists beat numpy at this size
            tok_list = [self._token_at(w[0].request, w[1]) for w in work]
            tokens = torch.tensor(tok_list, dtype=torch.int64, device=dev)
            positions = torch.tensor(starts, dtype=torch.int64, device=dev)
            pos_np = None
        else:
            tok_np = np.concatenate([w[0].request.get_token_ids(w[1], w[1] + w[2]) for w in work])
            pos_np = np.concatenate([np.arange(a, e, dtype=np.int64) for a, e in zip(starts, ends)])
            tokens = torch.from_numpy(tok_np.astype(np.int64, copy=False)).to(dev)
            positions = torch.from_numpy(pos_np).to(dev)

        # Attention: every token's kv into the slot its table names.
        if self.attn_groups:
            vals = kv_values(tokens, positions)
            for g in self.attn_groups:
                bs = self.block_size[g]
                if decode_only:
                    blocks = [w[0].tables[g][a // bs] for w, a in zip(work, starts)]
                    block_t = torch.tensor(blocks, dtype=torch.int64, device=dev)
                    slot_t = torch.tensor([a % bs for a in starts], dtype=torch.int64, device=dev)
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
                            counts = np.diff(np.clip(np.arange(b0, b1 + 2, dtype=np.int64) * bs, a, a + n))
                            pieces.append(np.repeat(np.asarray(run, dtype=np.int64), counts))
                    block_t = torch.from_numpy(np.concatenate(pieces)).to(dev)
                    slot_t = torch.from_numpy(pos_np % bs).to(dev)
                    touched_t = torch.tensor(touched, dtype=torch.int64, device=dev)
                self.storage.write_kv(g, block_t, slot_t, vals, touched_t)

        # Recurrent state: read at the chunk start, write at the chunk end (+ checkpoints).
        end_states: list[torch.Tensor] = []
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
                s0 = self.storage.read_states(g, torch.tensor(src, dtype=torch.int64, device=dev))
                if fresh:
                    s0[torch.tensor(fresh, dtype=torch.int64, device=dev)] = 0
                if decode_only and not extra:
                    states = self.content.step_one(s0, tokens)
                else:
                    if closed_form is None:
                        offsets = [0] * B
                        for i in range(1, B):
                            offsets[i] = offsets[i - 1] + lens[i - 1]
                        closed_form = (
                            torch.tensor(offsets, dtype=torch.int64, device=dev),
                            torch.tensor(starts, dtype=torch.int64, device=dev),
                            torch.tensor(q_seg, dtype=torch.int64, device=dev),
                            torch.tensor(q_end, dtype=torch.int64, device=dev),
                        )
                    states = self.content.advance(s0, tokens, positions, *closed_form)
                self.storage.write_states(g, torch.tensor(dst, dtype=torch.int64, device=dev), states[:B])
                for grp, blk, row in extra:
                    if grp == g:
                        self.storage.write_states(g, torch.tensor([blk], dtype=torch.int64, device=dev), states[row : row + 1])
                end_states.append(states[:B])

        # Sample for every request that has consumed all its known tokens.
        sample_idx = []
        for i, (sq, a, n) in enumerate(work):
            if a + n == sq.request.num_tokens:
                sample_idx.append(i)
            if n > 1 or a + n < sq.request.num_tokens:
                res.prefill_pairs += n * a + n * (n + 1) // 2
                res.num_prefill_tokens += n
                res.prefill_spans.append((sq.request.request_id, a, n))
            else:
                res.num_decode_seqs += 1
                res.decode_context_tokens += a + n
        if sample_idx:
            self._sample(work, sample_idx, ends, end_states, res, tok_list)

    def _sample(
        self, work, sample_idx: list[int], ends: list[int], end_states: list[torch.Tensor], res: StepResult,
        tok_list: list[int] | None = None,
    ) -> None:
        dev = self.device
        S = len(sample_idx)
        total = torch.zeros(S, dtype=torch.int64, device=dev)
        if end_states:
            rows = torch.tensor(sample_idx, dtype=torch.int64, device=dev) if S < len(work) else None
            for states in end_states:  # the state each group's table slot now holds
                total += (states if rows is None else states[rows]).sum(dim=1)
        if self.full_groups:
            e_list, row_list, seqs = [], [], []
            for i in sample_idx:
                sq = work[i][0]
                e_list.append(ends[i])
                row_list.append(sq.row)
                seqs.append(sq)
            e_t = torch.tensor(e_list, dtype=torch.int64, device=dev)
            rows = torch.tensor(row_list, dtype=torch.int64, device=dev)
        for g in self.full_groups:
            bs = self.block_size[g]
            width = max([len(sq.tables[g]) for sq in seqs])
            tab = self.table_tensors[g].t.index_select(0, rows)[:, :width]  # [S, W]: the worker's own tables
            nfull = torch.div(e_t, bs, rounding_mode="floor")
            rem = e_t - nfull * bs
            # full blocks: their maintained sums; the last, partial block: its first rem slots
            sums = self.storage.block_sum[g].take(tab)
            total += torch.where(self._aranges(width) < nfull.unsqueeze(1), sums, 0).sum(dim=1)
            last = tab.gather(1, nfull.clamp(max=width - 1).unsqueeze(1)).squeeze(1)
            vals = self.storage.data[g].index_select(0, last)  # [S, bs]
            total += torch.where(self._aranges(bs) < rem.unsqueeze(1), vals, 0).sum(dim=1)
        for g in self.swa_groups:
            bs = self.block_size[g]
            window = self.cache_config.groups[g].sliding_window
            acc_list = []
            for i in sample_idx:
                e = ends[i]
                p = np.arange(max(0, e - window), e, dtype=np.int64)
                t = np.asarray(work[i][0].tables[g], dtype=np.int64)
                vals = self.storage.slot_values(g, torch.from_numpy(t[p // bs]).to(dev), torch.from_numpy(p % bs).to(dev))
                acc_list.append(int(vals.sum()) % P)
            total += torch.tensor(acc_list, dtype=torch.int64, device=dev)
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
            rows = torch.tensor(fast_rows, dtype=torch.int64)
            tok = torch.tensor(fast_tok, dtype=torch.int64)
            e = torch.tensor(fast_end, dtype=torch.int64)
            st = (self._tip_state.index_select(0, rows) * self._ref_m + tok.unsqueeze(1)) % P
            ts = self._tip_tsum.index_select(0, rows) + tok
            self._tip_state.index_copy_(0, rows, st)
            self._tip_tsum.index_copy_(0, rows, ts)
            pos_sum = torch.div((e - 1) * e, 2, rounding_mode="floor") % P
            kv = (KV_A * (ts % P) + KV_B * pos_sum + KV_C * e) % P
            ref = (st.sum(dim=1) % P * len(self.state_groups) + kv * len(self.full_groups)) % P % VOCAB_SIZE
            for k, r in zip(fast_k, ref.tolist()):
                sq = work[sample_idx[k]][0]
                sq.tip_n += 1
                if r != sampled[k]:
                    res.divergences.append(Divergence(sq.request.request_id, sq.request.num_output_tokens, r, sampled[k]))
        for k in slow_k:  # first token, resume, or a sliding window: the oracle's way
            i = sample_idx[k]
            sq = work[i][0]
            r = self.reference_token(sq.request, ends[i])
            if use_tips:
                state, tsum = self.oracle(sq.request).point(ends[i])
                self._tip_state[sq.row] = torch.tensor(state, dtype=torch.int64)
                self._tip_tsum[sq.row] = tsum
                sq.tip_n = ends[i]
            if r != sampled[k]:
                res.divergences.append(Divergence(sq.request.request_id, sq.request.num_output_tokens, r, sampled[k]))

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
            window = self.cache_config.groups[g].sliding_window
            total += o.kv_sum(max(0, end - window), end)
        return total % P % VOCAB_SIZE
