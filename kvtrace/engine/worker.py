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
(one token that consumes the request's last known one) therefore go as one batch, its
indices computed from the tables' host arrays (``_decode_write``, ``_decode_sample``): on
the CPU by the C loops of ``kvtrace/engine/_decode.pyx`` when they are compiled, else by
numpy (tests/engine/test_decode_kernels.py compares the two event by event). Only the
prefill chunks take the general path (their full-attention kv writes by a C loop too);
the split is made only where the two parts touch disjoint blocks, so every value is what
one pass gives (tests/engine/test_decode_fast_path.py compares both ways event by event).
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any

import numpy as np

from kvtrace.cache import CacheConfig, FullAttentionSpec, MambaSpec, SlidingWindowSpec
from kvtrace.cache.plans import STATE_CHECKPOINT, STATE_EXTERNAL, STATE_RUNNING
from kvtrace.compiled import kernels
from kvtrace.engine.arrays import Array, Arrays
from kvtrace.engine.block_table import BlockTableTensor
from kvtrace.engine.content import KV_A, KV_B, KV_C, ContentModel, P, kv_values
from kvtrace.engine.memory import state_lanes
from kvtrace.engine.reference import PrefixOracle, TraceBlockMemo
from kvtrace.engine.request import EngineRequest
from kvtrace.engine.scheduler import DecodeRun, SchedulerOutput
from kvtrace.engine.step import Divergence, StepResult, tally
from kvtrace.engine.storage import DeviceStorage, first_sums
from kvtrace.numeric import cdiv
from kvtrace.workload.lines import VOCAB_SIZE

DECODE_KERNELS = "kvtrace.engine._decode"


class _Seq:
    """The worker's per-request state: its own block tables (one list per group) and its row
    in the block-table arrays and the reference tips."""

    __slots__ = ("request", "row", "tables")

    def __init__(self, request: EngineRequest, tables: list[list[int]], row: int):
        self.request = request
        self.tables = tables
        self.row = row


class _DecodeBatch:
    """What ``_decode_write`` leaves for ``_decode_sample``: the batch's rows, positions,
    tokens and ends on the host, the sum so far of each sampled value (device), and per
    full attention group the widest count of full blocks and the gather's indices."""

    __slots__ = ("ends", "nfull_d", "pos", "rows", "rows_d", "toks", "total", "widths")

    def __init__(self, rows, pos, toks, ends, total, widths, rows_d, nfull_d):
        self.rows, self.pos, self.toks, self.ends = rows, pos, toks, ends
        self.total, self.widths, self.rows_d, self.nfull_d = total, widths, rows_d, nfull_d


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
        self.num_lanes = state_lanes(cache_config)
        self.content = ContentModel(self.num_lanes, xp)
        self.ref_model = ContentModel(self.num_lanes, "cpu")
        self.memo = TraceBlockMemo(self.ref_model)
        self.seqs: dict[str, _Seq] = {}
        # The tables as arrays, a row per request: on the host for the decode step's index
        # arithmetic (full attention and state groups), on the device for sampling's gather
        # of block sums (full attention; the same arrays when the device is the host).
        host = Arrays("cpu")
        self.host_tables = {g: BlockTableTensor(host) for g in self.full_groups + self.state_groups}
        self.table_tensors = {g: self.host_tables[g] if xp.is_numpy else BlockTableTensor(xp)
                              for g in self.full_groups}
        self._free_rows: list[int] = []
        # Reference tips per row (CPU, numpy: a few small ops per step, where torch's per-op
        # overhead is the cost): the decode step's reference, vectorised over the batch. Row r's
        # tip holds the state and token sum after _tip_n[r] tokens (-1: none yet).
        self._tip_state = np.zeros((64, self.num_lanes), dtype=np.int64)
        self._tip_tsum = np.zeros(64, dtype=np.int64)
        self._tip_n = np.full(64, -1, dtype=np.int64)
        self._ref_m = np.asarray(self.ref_model.multipliers, dtype=np.int64)
        self._next_row = 0
        # the decode step's C loops (host arrays: the numpy device only), else its numpy path
        self.kernels: Any = kernels(DECODE_KERNELS) if xp.is_numpy else None  # (a compiled module or None)
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
        for g, tt in self.host_tables.items():
            tt.set_row(row, tables[g])
        if not self.xp.is_numpy:
            for g, tt in self.table_tensors.items():
                tt.set_row(row, tables[g])
        if row >= self._tip_tsum.shape[0]:
            grow = 2 * max(row, self._tip_tsum.shape[0]) - self._tip_tsum.shape[0]
            self._tip_state = np.concatenate([self._tip_state, np.zeros((grow, self.num_lanes), dtype=np.int64)])
            self._tip_tsum = np.concatenate([self._tip_tsum, np.zeros(grow, dtype=np.int64)])
            self._tip_n = np.concatenate([self._tip_n, np.full(grow, -1, dtype=np.int64)])
        self._tip_n[row] = -1
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
        # The batch, in its order (new requests, then running ones), as (batch index, item):
        # the decode runs' requests as (index, seq, position), the rest as (index, (seq,
        # start, num_tokens)).
        runs: list[tuple[int, _Seq, int]] = []
        others: list[tuple[int, tuple[_Seq, int, int]]] = []
        loads: list[tuple[_Seq, int, int]] = []
        sched = out.num_scheduled_tokens
        seqs = self.seqs
        i = 0
        for nr in out.scheduled_new_reqs:
            old = seqs.get(nr.request_id)
            if old is not None:  # resumed without a preemption notice: start over
                self.drop(nr.request_id)
            s = self._new_seq(nr.request, [list(ids) for ids in nr.block_ids])
            seqs[nr.request_id] = s
            if nr.num_external_tokens:
                loads.append((s, nr.num_computed_tokens - nr.num_external_tokens, nr.num_computed_tokens))
            others.append((i, (s, nr.num_computed_tokens, sched[nr.request_id])))
            i += 1
        for cr in out.scheduled_cached_reqs:
            if isinstance(cr, DecodeRun):
                for request, a in zip(cr.requests, cr.starts):
                    runs.append((i, seqs[request.request_id], a))
                    i += 1
                continue
            s = seqs[cr.request_id]
            if any(cr.new_block_ids):
                self._append_blocks(s, cr.new_block_ids)
            others.append((i, (s, cr.num_computed_tokens, sched[cr.request_id])))
            i += 1

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
        if self.state_groups and out.state_writes:
            self._check_running_writes(out, res)
        if runs or others:
            self._compute(runs, others, out, res)
        return res

    def _append_blocks(self, s: _Seq, new_block_ids: tuple[list[int], ...]) -> None:
        """A running request's new blocks, onto its tables (lists and arrays)."""
        for g, ids in enumerate(new_block_ids):
            if ids:
                tt = self.host_tables.get(g)
                if tt is not None:
                    tt.append(s.row, len(s.tables[g]), ids)
                    if not self.xp.is_numpy and g in self.table_tensors:
                        self.table_tensors[g].append(s.row, len(s.tables[g]), ids)
                s.tables[g].extend(ids)

    def _check_running_writes(self, out: SchedulerOutput, res: StepResult) -> None:
        """The Core's ``running`` state writes name the block it expects the state after the
        step in; the worker's own table slot must be that block (counted, never obeyed)."""
        running = [sw for sw in out.state_writes if sw.kind == STATE_RUNNING]
        if not running:
            return
        rids, groups, blocks, num_tokens, _ = zip(*running)
        seqs = self.seqs
        rows = np.array([seqs[rid].row for rid in rids], dtype=np.int64)
        core = np.array(blocks, dtype=np.int64)
        ends = np.array(num_tokens, dtype=np.int64)
        group = np.array(groups, dtype=np.int64) if len(self.state_groups) > 1 else None
        for g in self.state_groups:
            bs = self.block_size[g]
            sel = slice(None) if group is None else group == g
            mine = self.host_tables[g].t[rows[sel], (ends[sel] + bs - 1) // bs - 1]
            res.table_disagreements += int((mine != core[sel]).sum())

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

    def _compute(self, runs: list[tuple[int, _Seq, int]], others: list[tuple[int, tuple[_Seq, int, int]]],
                 out: SchedulerOutput, res: StepResult) -> None:
        """Content for the step (``runs``: the decode runs' requests; ``others``: the rest of
        the batch, each with its batch index): decode tokens by ``_decode_write`` and
        ``_decode_sample``, the rest (prefill chunks) by ``_compute_general``.

        The split changes nothing: the two parts touch disjoint blocks (checked; else the
        whole step goes the general way), each part's reads see the other's writes exactly
        as one pass would, and the results are put back in the batch's order.
        """
        split = self._split_decodes(runs, others, out) if self.decode_fast_path else None
        if split is None:
            work = [w for _, w in sorted([(i, (sq, a, 1)) for i, sq, a in runs] + others, key=itemgetter(0))]
            self._compute_general(work, out, res)
            return
        dec, rest, rows, pos = split
        slow: list[tuple[int, Divergence]] = []
        # decode writes, then the rest (whose sampling sees them), then decode sampling
        batch = self._decode_write(dec, rows, pos)
        res.num_decode_seqs += len(dec)  # step.tally's decode count, for the whole batch
        res.decode_context_tokens += int(batch.ends.sum())
        rest_sampled: dict[str, int] = {}
        if rest:
            rest_res = StepResult(sampled=rest_sampled, divergences=[])
            self._compute_general([w for _, w in rest], out, rest_res)
            index = {w[0].request.request_id: i for i, w in rest}
            slow.extend((index[d.request_id], d) for d in rest_res.divergences)
            res.prefill_pairs += rest_res.prefill_pairs
            res.num_prefill_tokens += rest_res.num_prefill_tokens
            res.prefill_spans.extend(rest_res.prefill_spans)
            res.num_decode_seqs += rest_res.num_decode_seqs
            res.decode_context_tokens += rest_res.decode_context_tokens
        dec_sampled, fast = self._decode_sample(dec, batch, slow)
        # the batch's order (the scheduler frees the requests finishing in it in its schedule's order)
        if not rest_sampled:
            res.sampled.update(dec_sampled)
        else:  # a prefill chunk samples too (once a request): merge by batch index
            both = [(i, sq.request.request_id) for i, sq, _ in dec] + [(i, w[0].request.request_id) for i, w in rest]
            for _, rid in sorted(both, key=itemgetter(0)):
                token = dec_sampled[rid] if rid in dec_sampled else rest_sampled.get(rid)
                if token is not None:
                    res.sampled[rid] = token
        res.divergences.extend(fast)
        slow.sort(key=lambda x: x[0])
        res.divergences.extend(d for _, d in slow)

    def _split_decodes(self, runs: list[tuple[int, _Seq, int]], others: list[tuple[int, tuple[_Seq, int, int]]],
                       out: SchedulerOutput):
        """(decodes as (batch index, seq, position), the rest with their batch index, the
        decodes' rows and positions as arrays), or None when the step must go the general way:
        a sliding-window group, no decode, a decode that exports a checkpoint, or blocks that
        a decode and a prefill chunk both touch. A decode is one token that consumes the
        request's last known one past its prompt: the runs' requests are (the manager's
        decode fast path took them), the others are looked at."""
        if self.swa_groups:
            return None
        dec = list(runs)  # (runs stays as it was: the general way rebuilds the batch from it)
        rest: list[tuple[int, tuple[_Seq, int, int]]] = []
        for i, w in others:
            sq, a, n = w
            req = sq.request
            if n == 1 and a >= req.num_prompt_tokens and a + 1 == req.num_prompt_tokens + len(req.output_token_ids):
                dec.append((i, sq, a))
            else:
                rest.append((i, w))
        if runs and len(dec) > len(runs):
            dec.sort(key=itemgetter(0))
        if not dec:
            return None
        checkpointed = {sw.request_id for sw in out.state_writes if sw.kind == STATE_CHECKPOINT}
        if checkpointed and any(sq.request.request_id in checkpointed for _, sq, _ in dec):
            return None
        rows = np.array([sq.row for _, sq, _ in dec], dtype=np.int64)
        pos = np.array([a for _, _, a in dec], dtype=np.int64)
        if rest:
            for g in self.attn_groups:  # (no sliding window here: the full groups have host tables)
                bs = self.block_size[g]
                mine = set(self.host_tables[g].t[rows, pos // bs].tolist())
                for _, (sq, a, n) in rest:
                    if not mine.isdisjoint(sq.tables[g][a // bs: (a + n - 1) // bs + 1]):
                        return None
            for g in self.state_groups:
                bs = self.block_size[g]
                t = self.host_tables[g].t
                mine = set(t[rows, (pos + bs - 1) // bs - 1].tolist())
                mine.update(t[rows, pos // bs].tolist())  # cdiv(a + 1, bs) - 1
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
            tip_n = self._tip_n
            for _, (sq, a, n) in rest:  # the rest's divergences must all be the slow kind
                if tip_n[sq.row] == a + n - 1 and a + n == sq.request.num_tokens:
                    return None
        return dec, rest, rows, pos

    def _decode_write(self, dec: list[tuple[int, _Seq, int]], rows: np.ndarray, pos: np.ndarray) -> _DecodeBatch:
        """One token each for requests that consumed all but their last known token: write
        its kv and advance each state. The batch's indices are computed on the host from the
        table arrays (``host_tables``), one array call per quantity for the whole batch."""
        B = len(dec)
        toks = np.array([sq.request.output_token_ids[-1] for _, sq, _ in dec], dtype=np.int64)
        if self.kernels is not None:
            return self._decode_write_kernels(rows, pos, toks)
        host: list[np.ndarray] = [kv_values(toks, pos), toks]  # what the device needs, in this order
        nfull: dict[int, np.ndarray] = {}
        distinct: dict[int, bool] = {}
        for g in self.attn_groups:
            bs = self.block_size[g]
            q = pos // bs
            blk = self.host_tables[g].t[rows, q]
            # two requests writing one block is a cache bug: the general write handles it
            # (a set of a few dozen ints is cheaper than np.unique's sort)
            distinct[g] = len(set(blk.tolist())) == B
            host += (blk, pos - q * bs)
            nfull[g] = q
        for g in self.state_groups:
            bs = self.block_size[g]
            t = self.host_tables[g].t
            host += (t[rows, (pos + bs - 1) // bs - 1], t[rows, pos // bs])  # from, to
        if self.full_groups:
            host.append(rows)
            host += (nfull[g] for g in self.full_groups)
        xp = self.xp
        if xp.is_numpy:
            dev = host
        else:  # one transfer: the per-call cost, not the data, dominates at this size
            flat = xp.from_host(np.concatenate(host))
            dev = [flat[k * B:(k + 1) * B] for k in range(len(host))]
        vals_d, toks_d = dev[0], dev[1]
        k = 2
        total = None
        for g in self.attn_groups:
            # The block written holds the context's last tokens, up to and with this one;
            # nothing else writes it this step (checked).
            blk, slot = dev[k], dev[k + 1]
            k += 2
            if distinct[g]:
                part = self.storage.append_kv(g, blk, slot, vals_d)
            else:
                self.storage.write_kv(g, blk, slot, vals_d)
                part = first_sums(xp, self.storage.read_kv(g, blk), slot + 1)
            total = part if total is None else total + part
        for g in self.state_groups:
            s0 = self.storage.read_states(g, dev[k])
            states = self.content.step_one(s0, toks_d)
            self.storage.write_states(g, dev[k + 1], states)
            k += 2
            lanes = states.sum(1)
            total = lanes if total is None else total + lanes
        widths = {g: int(nfull[g].max()) for g in self.full_groups}
        rows_d = dev[k] if self.full_groups else None
        nfull_d = {g: dev[k + 1 + j] for j, g in enumerate(self.full_groups)}
        return _DecodeBatch(rows, pos, toks, pos + 1, total, widths, rows_d, nfull_d)

    def _decode_write_kernels(self, rows: np.ndarray, pos: np.ndarray, toks: np.ndarray) -> _DecodeBatch:
        """``_decode_write`` by the C loops of ``kvtrace.engine._decode``: the same writes and
        sums, one call per group (an attention group whose blocks two requests share takes
        the numpy write, as ``_decode_write`` does)."""
        kern = self.kernels
        total = np.zeros(rows.shape[0], dtype=np.int64)
        for g in self.attn_groups:
            table = self.host_tables[g].t
            if not self.storage.append_kv_rows(kern, g, table, rows, pos, toks, total):
                bs = self.block_size[g]
                blk, slot = table[rows, pos // bs], pos % bs
                self.storage.write_kv(g, blk, slot, kv_values(toks, pos))
                total += first_sums(self.xp, self.storage.read_kv(g, blk), slot + 1)
        for g in self.state_groups:
            kern.state_step(self.storage.data[g], self.host_tables[g].t, self.block_size[g], self._ref_m,
                            rows, pos, toks, total)
        return _DecodeBatch(rows, pos, toks, pos + 1, total, None, None, None)

    def _decode_sample(self, dec: list[tuple[int, _Seq, int]], batch: _DecodeBatch,
                       slow: list[tuple[int, Divergence]]) -> tuple[dict[str, int], list[Divergence]]:
        """Sample the decode tokens staged by ``_decode_write`` and check them against the
        reference. Returns the sampled tokens by request and the divergences found through
        the tips (those found the oracle's way go to ``slow`` with their batch index)."""
        if self.kernels is not None:
            return self._decode_sample_kernels(dec, batch, slow)
        total = batch.total
        for g in self.full_groups:
            w = batch.widths[g]
            if w:  # the full blocks: their maintained sums, through the worker's own table
                tab = self.table_tensors[g].t[:, :w][batch.rows_d]
                block_sum = self.storage.block_sum[g]
                assert block_sum is not None
                kv = first_sums(self.xp, block_sum.take(tab), batch.nfull_d[g])
                total = kv if total is None else total + kv
        assert total is not None
        out = self.xp.host(total % P % VOCAB_SIZE)
        if not self.verify:
            return self._sampled(dec, out.tolist()), []
        ref = np.full(len(dec), -1, dtype=np.int64)  # -1: off its tip
        tips = np.flatnonzero(self._tip_n[batch.rows] == batch.pos)
        if tips.shape[0] == len(dec):
            ref = self._advance_tips(batch.rows, batch.toks, batch.ends)
        elif tips.shape[0]:
            ref[tips] = self._advance_tips(batch.rows[tips], batch.toks[tips], batch.ends[tips])
        return self._decode_checked(dec, out, ref, slow)

    def _decode_sample_kernels(self, dec: list[tuple[int, _Seq, int]], batch: _DecodeBatch,
                               slow: list[tuple[int, Divergence]]) -> tuple[dict[str, int], list[Divergence]]:
        """``_decode_sample`` by the C loops of ``kvtrace.engine._decode``."""
        kern = self.kernels
        rows, pos, toks, total = batch.rows, batch.pos, batch.toks, batch.total
        for g in self.full_groups:
            kern.full_block_sums(self.storage.block_sum[g], self.host_tables[g].t, self.block_size[g], rows, pos, total)
        if not self.verify:
            return self._sampled(dec, (total % P % VOCAB_SIZE).tolist()), []
        out = np.empty_like(total)
        ref = np.empty_like(total)
        kern.advance_tips(self._tip_state, self._tip_tsum, self._tip_n, self._ref_m, len(self.state_groups),
                          len(self.full_groups), VOCAB_SIZE, rows, pos, toks, total, out, ref)
        return self._decode_checked(dec, out, ref, slow)

    @staticmethod
    def _sampled(dec: list[tuple[int, _Seq, int]], tokens: list[int]) -> dict[str, int]:
        return dict(zip([sq.request.request_id for _, sq, _ in dec], tokens))

    def _decode_checked(self, dec: list[tuple[int, _Seq, int]], out: np.ndarray, ref: np.ndarray,
                        slow: list[tuple[int, Divergence]]) -> tuple[dict[str, int], list[Divergence]]:
        """The sampled tokens ``out`` by request, and the divergences from the reference
        ``ref`` (the tips' tokens, -1 for a request off its tip: then the oracle's, and its
        divergence goes to ``slow`` with its batch index)."""
        out_l = out.tolist()
        fast: list[Divergence] = []
        for k in np.flatnonzero(ref != out).tolist():
            r = int(ref[k])
            i, sq, a = dec[k]
            if r >= 0:  # through the tip
                fast.append(Divergence(sq.request.request_id, sq.request.num_output_tokens, r, out_l[k]))
            else:  # first token after a resume: the oracle's way
                r = self._slow_reference(sq, a + 1, True)
                if r != out_l[k]:
                    slow.append((i, Divergence(sq.request.request_id, sq.request.num_output_tokens, r, out_l[k])))
        return self._sampled(dec, out_l), fast

    def _compute_general(self, work: list[tuple[_Seq, int, int]], out: SchedulerOutput, res: StepResult) -> None:
        xp = self.xp
        B = len(work)
        starts = [w[1] for w in work]
        lens = [w[2] for w in work]
        ends = [a + n for a, n in zip(starts, lens)]
        decode_only = max(lens) == 1
        tok_list = None
        tok_np = None
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
            vals = None
            for g in self.attn_groups:
                bs = self.block_size[g]
                if not decode_only and self._prefill_by_kernel(g, work):
                    assert tok_np is not None
                    self.storage.prefill_kv_rows(self.kernels, g, self.host_tables[g].t,
                                                 np.fromiter((w[0].row for w in work), np.int64, B),
                                                 np.asarray(starts, dtype=np.int64), np.asarray(lens, dtype=np.int64),
                                                 tok_np)
                    continue
                if vals is None:
                    vals = kv_values(tokens, positions)
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
                        else:  # each block's share of the chunk: the first and last ones partial
                            counts = [bs] * (b1 - b0 + 1)
                            counts[0] = (b0 + 1) * bs - a
                            counts[-1] = a + n - b1 * bs
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
            checkpoints = [sw for sw in out.state_writes if sw.kind == STATE_CHECKPOINT]
            if checkpoints:
                seq_index = {w[0].request.request_id: i for i, w in enumerate(work)}
                for sw in checkpoints:
                    i = seq_index.get(sw.request_id)
                    if i is not None and starts[i] < sw.num_tokens <= ends[i]:
                        extra.append((sw.group_id, sw.block_id, len(q_end)))
                        q_seg.append(i)
                        q_end.append(sw.num_tokens)
            fresh = [i for i, a in enumerate(starts) if a == 0]
            closed_form = None
            for g in self.state_groups:
                bs = self.block_size[g]
                src = [w[0].tables[g][cdiv(a, bs) - 1] if a > 0 else 0 for w, a in zip(work, starts)]
                dst = [w[0].tables[g][cdiv(e, bs) - 1] for w, e in zip(work, ends)]
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

    def _prefill_by_kernel(self, g: int, work: list[tuple[_Seq, int, int]]) -> bool:
        """Whether group ``g``'s prefill writes go by the C loop (``prefill_kv_rows``): a full
        attention group (it has host tables), the kernels compiled, and every chunk inside
        its table (else the numpy write, which fails on a short table as it always has)."""
        if self.kernels is None or g not in self.full_groups:
            return False
        bs = self.block_size[g]
        return all(len(sq.tables[g]) * bs >= a + n for sq, a, n in work)

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
        tip_n = self._tip_n
        for k, i in enumerate(sample_idx):
            sq = work[i][0]
            e = ends[i]
            if use_tips and tip_n[sq.row] == e - 1:
                fast_k.append(k)
                fast_rows.append(sq.row)
                fast_tok.append(tok_list[i] if tok_list is not None else self._token_at(sq.request, e - 1))
                fast_end.append(e)
            else:
                slow_k.append(k)
        if fast_k:  # decode: advance every reference tip by its one token at once
            seqs = [work[sample_idx[k]][0] for k in fast_k]
            ref = self._advance_tips(np.array(fast_rows, dtype=np.int64), np.array(fast_tok, dtype=np.int64),
                                     np.array(fast_end, dtype=np.int64)).tolist()
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

    def _advance_tips(self, rows: np.ndarray, tok: np.ndarray, e: np.ndarray) -> np.ndarray:
        """The reference tokens of decode steps whose tips (distinct ``rows``) stand one token
        back, before the ``e``-th token ``tok``; the tips advance by it."""
        st = (self._tip_state[rows] * self._ref_m + tok[:, None]) % P
        ts = self._tip_tsum[rows] + tok
        self._tip_state[rows] = st
        self._tip_tsum[rows] = ts
        pos_sum = (e - 1) * e // 2 % P
        kv = (KV_A * (ts % P) + KV_B * pos_sum + KV_C * e) % P
        self._tip_n[rows] = e
        return (st.sum(axis=1) % P * len(self.state_groups) + kv * len(self.full_groups)) % P % VOCAB_SIZE

    def _slow_reference(self, sq: _Seq, end: int, use_tips: bool) -> int:
        """The reference token after ``end`` tokens from the oracle; the tip is set there."""
        r = self.reference_token(sq.request, end)
        if use_tips:
            state, tsum = self.oracle(sq.request).point(end)
            self._tip_state[sq.row] = state
            self._tip_tsum[sq.row] = tsum
            self._tip_n[sq.row] = end
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
