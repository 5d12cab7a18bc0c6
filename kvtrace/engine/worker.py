"""The worker: its own block tables, device content, sampling and verification.

It builds its tables ONLY from ``SchedulerOutput`` (a new request's table is set, a
running request's table gets the new block ids appended) and never reads the Core's
tables. Per step it executes the copies, writes every scheduled token's kv into the
slot its table names, advances each Mamba state from the block its table names at the
chunk start to the block its table names at the chunk end (plus checkpoint writes),
and samples for every request that consumed all its known tokens. A Core/Worker
disagreement therefore becomes wrong content, which the no-cache reference catches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvtrace.cache import CacheConfig, FullAttentionSpec, MambaSpec, SlidingWindowSpec
from kvtrace.cache.content import P, ContentModel, kv_values
from kvtrace.cache.plans import STATE_CHECKPOINT, STATE_RUNNING
from kvtrace.cache.storage import DeviceStorage
from kvtrace.cache.tokens import VOCAB_SIZE
from kvtrace.engine.reference import PrefixOracle, TraceBlockMemo
from kvtrace.engine.request import EngineRequest
from kvtrace.engine.scheduler import SchedulerOutput


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
    """The worker's per-request state: its own block tables (one list per group)."""

    __slots__ = ("request", "tables")

    def __init__(self, request: EngineRequest, tables: list[list[int]]):
        self.request = request
        self.tables = tables


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
        self.oracles: dict[str, PrefixOracle] = {}  # survive preemption, dropped on finish

    def oracle(self, request) -> PrefixOracle:
        o = self.oracles.get(request.request_id)
        if o is None:
            o = self.oracles[request.request_id] = PrefixOracle(self.ref_model, request, self.memo)
        return o

    # -- tables ---------------------------------------------------------------------------------
    def drop(self, request_id: str) -> None:
        self.seqs.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        """A finished request: drop its table and its reference."""
        self.seqs.pop(request_id, None)
        self.oracles.pop(request_id, None)

    def seq(self, request_id: str) -> _Seq:
        return self.seqs[request_id]

    def block_table(self, request_id: str) -> tuple[list[int], ...]:
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
            s = _Seq(nr.request, [list(ids) for ids in nr.block_ids])
            self.seqs[nr.request_id] = s
            if nr.num_external_tokens:
                loads.append((s, nr.num_computed_tokens - nr.num_external_tokens, nr.num_computed_tokens))
            work.append((s, nr.num_computed_tokens, out.num_scheduled_tokens[nr.request_id]))
        for cr in out.scheduled_cached_reqs:
            s = self.seqs[cr.request_id]
            for g, ids in enumerate(cr.new_block_ids):
                if ids:
                    s.tables[g].extend(ids)
            work.append((s, cr.num_computed_tokens, out.num_scheduled_tokens[cr.request_id]))

        if loads:
            self._load_external(loads)
        if out.block_copies:
            self.storage.copy_blocks(out.block_copies)
            for c in out.block_copies:
                if c.group_id in self.state_groups:
                    res.num_state_copies += 1
                else:
                    res.num_kv_copies += 1
        if work:
            self._compute(work, out, res)
        return res

    def _load_external(self, loads: list[tuple[_Seq, int, int]]) -> None:
        """Fill [start, end) from the external tier, which holds correct content by construction."""
        for s, start, end in loads:
            tokens = s.request.get_token_ids(start, end)
            self._write_kv(s, start, end, tokens)
            if self.state_groups:
                full = s.request.get_token_ids(0, end)
                st = self.content.states_from_scratch(
                    torch.from_numpy(np.ascontiguousarray(full)).to(self.device),
                    torch.tensor([end], dtype=torch.int64, device=self.device),
                )
                for g in self.state_groups:
                    blk = s.tables[g][_cdiv(end, self.block_size[g]) - 1]
                    self.storage.write_states(g, torch.tensor([blk], device=self.device), st)

    def _write_kv(self, s: _Seq, start: int, end: int, tokens: np.ndarray) -> None:
        pos = torch.arange(start, end, dtype=torch.int64, device=self.device)
        vals = kv_values(torch.from_numpy(np.ascontiguousarray(tokens)).to(self.device), pos)
        for g in self.attn_groups:
            bs = self.block_size[g]
            table = np.asarray(s.tables[g], dtype=np.int64)
            p = np.arange(start, end, dtype=np.int64)
            blocks = torch.from_numpy(table[p // bs]).to(self.device)
            self.storage.write_kv(g, blocks, torch.from_numpy(p % bs).to(self.device), vals)

    def _compute(self, work: list[tuple[_Seq, int, int]], out: SchedulerOutput, res: StepResult) -> None:
        dev = self.device
        B = len(work)
        starts = np.fromiter((w[1] for w in work), dtype=np.int64, count=B)
        lens = np.fromiter((w[2] for w in work), dtype=np.int64, count=B)
        ends = starts + lens
        offsets = np.zeros(B, dtype=np.int64)
        np.cumsum(lens[:-1], out=offsets[1:])
        tok_np = np.concatenate([w[0].request.get_token_ids(w[1], w[1] + w[2]) for w in work]).astype(np.int64, copy=False)
        seg = np.repeat(np.arange(B, dtype=np.int64), lens)
        pos_np = np.arange(tok_np.shape[0], dtype=np.int64) - offsets[seg] + starts[seg]
        tokens = torch.from_numpy(tok_np).to(dev)
        positions = torch.from_numpy(pos_np).to(dev)

        # Attention: every token's kv into the slot its table names.
        if self.attn_groups:
            vals = kv_values(tokens, positions)
            for g in self.attn_groups:
                bs = self.block_size[g]
                flat_tables, table_off = self._flat_tables(work, g)
                blocks = flat_tables[table_off[seg] + pos_np // bs]
                self.storage.write_kv(g, torch.from_numpy(blocks).to(dev), torch.from_numpy(pos_np % bs).to(dev), vals)

        # Recurrent state: read at the chunk start, write at the chunk end (+ checkpoints).
        end_states: list[torch.Tensor] = []
        if self.state_groups:
            seq_index = {w[0].request.request_id: i for i, w in enumerate(work)}
            q_seg = list(range(B))
            q_end = ends.tolist()
            extra: list[tuple[int, int, int]] = []  # (group, block, query row)
            running_core: dict[tuple[str, int], int] = {}
            for sw in out.state_writes:
                if sw.kind == STATE_CHECKPOINT:
                    i = seq_index.get(sw.request_id)
                    if i is not None and starts[i] < sw.num_tokens <= ends[i]:
                        extra.append((sw.group_id, sw.block_id, len(q_end)))
                        q_seg.append(i)
                        q_end.append(sw.num_tokens)
                elif sw.kind == STATE_RUNNING:
                    running_core[(sw.request_id, sw.group_id)] = sw.block_id
            qs = torch.tensor(q_seg, dtype=torch.int64, device=dev)
            qe = torch.tensor(q_end, dtype=torch.int64, device=dev)
            for g in self.state_groups:
                bs = self.block_size[g]
                src = [w[0].tables[g][_cdiv(w[1], bs) - 1] if w[1] > 0 else 0 for w in work]
                dst = [w[0].tables[g][_cdiv(int(e), bs) - 1] for w, e in zip(work, ends)]
                if running_core:
                    for w, d in zip(work, dst):
                        core = running_core.get((w[0].request.request_id, g))
                        if core is not None and core != d:
                            res.table_disagreements += 1
                s0 = self.storage.read_states(g, torch.tensor(src, dtype=torch.int64, device=dev))
                s0[torch.from_numpy(starts == 0).to(dev)] = 0
                states = self.content.advance(
                    s0, tokens, positions, torch.from_numpy(offsets).to(dev), torch.from_numpy(starts).to(dev), qs, qe
                )
                self.storage.write_states(g, torch.tensor(dst, dtype=torch.int64, device=dev), states[:B])
                for grp, blk, row in extra:
                    if grp == g:
                        self.storage.write_states(g, torch.tensor([blk], device=dev), states[row : row + 1])
                end_states.append(states[:B])

        # Sample for every request that has consumed all its known tokens.
        sample_idx = [i for i, (s, st, n) in enumerate(work) if st + n == s.request.num_tokens]
        for i, (s, st, n) in enumerate(work):
            if st + n < s.request.num_tokens or n > 1:
                res.prefill_pairs += n * st + n * (n + 1) // 2
                res.num_prefill_tokens += n
                res.prefill_spans.append((s.request.request_id, st, n))
            else:
                res.num_decode_seqs += 1
                res.decode_context_tokens += st + n
        if sample_idx:
            self._sample(work, sample_idx, ends, end_states, res)

    def _flat_tables(self, work, g: int) -> tuple[np.ndarray, np.ndarray]:
        tables = [w[0].tables[g] for w in work]
        lens = np.fromiter((len(t) for t in tables), dtype=np.int64, count=len(tables))
        off = np.zeros(len(tables), dtype=np.int64)
        np.cumsum(lens[:-1], out=off[1:])
        flat = np.fromiter((b for t in tables for b in t), dtype=np.int64, count=int(lens.sum()))
        return flat, off

    def _sample(self, work, sample_idx: list[int], ends: np.ndarray, end_states: list[torch.Tensor], res: StepResult) -> None:
        dev = self.device
        S = len(sample_idx)
        total = torch.zeros(S, dtype=torch.int64, device=dev)
        if end_states:
            rows = torch.tensor(sample_idx, dtype=torch.int64, device=dev)
            for states in end_states:  # the state each group's table slot now holds
                total = (total + states[rows].sum(dim=1)) % P
        for g in self.full_groups:
            bs = self.block_size[g]
            full_ids: list[int] = []
            full_seg: list[int] = []
            part_blk: list[int] = []
            part_slot: list[int] = []
            part_seg: list[int] = []
            for k, i in enumerate(sample_idx):
                e = int(ends[i])
                t = work[i][0].tables[g]
                nf = e // bs
                full_ids.extend(t[:nf])
                full_seg.extend([k] * nf)
                r = e - nf * bs
                if r:
                    part_blk.extend([t[nf]] * r)
                    part_slot.extend(range(r))
                    part_seg.extend([k] * r)
            acc = torch.zeros(S, dtype=torch.int64, device=dev)
            if full_ids:
                sums = self.storage.block_sums(g, torch.tensor(full_ids, dtype=torch.int64, device=dev))
                acc.index_add_(0, torch.tensor(full_seg, dtype=torch.int64, device=dev), sums)
            if part_blk:
                vals = self.storage.slot_values(
                    g, torch.tensor(part_blk, dtype=torch.int64, device=dev), torch.tensor(part_slot, dtype=torch.int64, device=dev)
                )
                acc.index_add_(0, torch.tensor(part_seg, dtype=torch.int64, device=dev), vals)
            total = (total + acc % P) % P
        for g in self.swa_groups:
            bs = self.block_size[g]
            window = self.cache_config.groups[g].sliding_window
            acc_list = []
            for i in sample_idx:
                e = int(ends[i])
                lo = max(0, e - window)
                p = np.arange(lo, e, dtype=np.int64)
                t = np.asarray(work[i][0].tables[g], dtype=np.int64)
                vals = self.storage.slot_values(g, torch.from_numpy(t[p // bs]).to(dev), torch.from_numpy(p % bs).to(dev))
                acc_list.append(int(vals.sum()) % P)
            total = (total + torch.tensor(acc_list, dtype=torch.int64, device=dev)) % P
        sampled = (total % VOCAB_SIZE).tolist()
        for k, i in enumerate(sample_idx):
            s = work[i][0]
            rid = s.request.request_id
            res.sampled[rid] = sampled[k]
            if self.verify:
                expected = self.reference_token(s.request, int(ends[i]))
                if expected != sampled[k]:
                    res.divergences.append(Divergence(rid, s.request.num_output_tokens, expected, sampled[k]))

    # -- the no-cache reference -------------------------------------------------------------------
    def reference_token(self, request, end: int) -> int:
        """The token a run without any cache samples after the first ``end`` tokens."""
        o = self.oracle(request)
        total = 0
        if self.state_groups:
            total += o.state_lane_sum(end) * len(self.state_groups)
        total += o.kv_sum(0, end) * len(self.full_groups)
        for g in self.swa_groups:
            window = self.cache_config.groups[g].sliding_window
            total += o.kv_sum(max(0, end - window), end)
        return total % P % VOCAB_SIZE
