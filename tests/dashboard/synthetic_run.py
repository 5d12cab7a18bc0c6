"""A small, realistic kvtrace run written through the store's real writer.

Stand-in until the lead's ``replayed_store`` (a real replay) exists: a tiny hybrid prefix
cache (group 0 attention, group 1 Mamba state aligned to 4 blocks) under LRU, driven by
requests that share a few system prompts. The same trace is written twice, with
``transient-checkpoint-retention`` on and off: off publishes prefill checkpoints that
evict hot prefixes and leave stale hashes, as in the seed review. Every span kind the
dashboard reads is produced, and the run summary is computed from the same numbers.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from kvtrace.store.schema import (
    SPAN_COW,
    SPAN_DIVERGENT,
    SPAN_EVICT,
    SPAN_LOOKUP,
    SPAN_PUBLISH,
    SPAN_REQUEST,
    SPAN_STALE_HASH,
    SPAN_STALE_LEFT,
    SPAN_STEP,
)
from kvtrace.store.writer import Store

BLOCK = 64  # tokens per block (both groups)
ALIGN = 4  # Mamba state kept every ALIGN blocks
STEP_NS = 25_000_000  # one scheduler step of virtual time
BEHAVIOUR = "transient-checkpoint-retention"
ALL = ["transient-checkpoint-retention", "shared-prefix-pinning", "external-hit-running-cow"]


def _hash(*parts: object) -> str:
    return hashlib.blake2b(repr(parts).encode(), digest_size=8).hexdigest()


@dataclass
class _Group:
    capacity: int
    cache: OrderedDict = field(default_factory=OrderedDict)  # hash -> (block_id, published_step, last_used_step)
    free: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.free = list(range(self.capacity, 0, -1))


def _trace(n_requests: int, seed: int):
    rng = np.random.default_rng(seed)
    families = rng.choice(6, size=n_requests, p=[0.35, 0.25, 0.15, 0.1, 0.1, 0.05])
    prefix_blocks = np.array([24, 16, 12, 20, 8, 30])
    suffix = rng.integers(2, 14, size=n_requests)
    outputs = rng.integers(8, 40, size=n_requests)
    arrivals = np.sort(rng.integers(0, n_requests * 2, size=n_requests))  # in steps
    external = rng.random(n_requests) < 0.1
    return [
        dict(i=i, fam=int(families[i]), nprefix=int(prefix_blocks[families[i]]), nsuffix=int(suffix[i]),
             out=int(outputs[i]), arrival=int(arrivals[i]), external=bool(external[i]))
        for i in range(n_requests)
    ]


class _Sim:
    def __init__(self, behaviour_on: bool, capacity: int, seed: int):
        self.on = behaviour_on
        self.rng = np.random.default_rng(seed + 1)
        self.groups = [_Group(capacity), _Group(capacity)]
        self.rows: list[dict] = []
        self.n = dict(publishes=0, evictions=0, cow_copies=0, stale_hashes=0, divergent_outputs=0,
                      lookup_blocks=0, hit_blocks=0)
        self.requests: list[dict] = []
        self.span_seq = 0

    def span(self, name: str, start_ns: int, end_ns: int | None = None, **cols) -> None:
        self.span_seq += 1
        cols.update(name=name, start_ns=start_ns, end_ns=end_ns if end_ns is not None else start_ns,
                    trace_id_hi=0, trace_id_lo=self.span_seq, span_id=self.span_seq)
        self.rows.append(cols)

    def allocate(self, g: int, step: int, rid: str) -> int:
        grp = self.groups[g]
        if grp.free:
            return grp.free.pop()
        h, (bid, pub, used) = grp.cache.popitem(last=False)
        self.n["evictions"] += 1
        self.span(SPAN_EVICT, step * STEP_NS, step=step, group_id=g, evict_reason="lru", block_ids=[bid],
                  block_hashes=[h], ages=[step - pub], idle=[step - used], request_id=rid)
        return bid

    def run_request(self, req: dict, step: int) -> int:
        rid = f"req-{req['i']:04d}"
        hashes = [_hash("sys", req["fam"], b) for b in range(req["nprefix"])]
        hashes += [_hash("user", req["i"], b) for b in range(req["nsuffix"])]
        nblocks = len(hashes)
        # Lookup: attention scans left to right; the Mamba state needs an aligned stored state.
        g0 = self.groups[0]
        hit = 0
        while hit < nblocks - 1 and hashes[hit] in g0.cache:
            hit += 1
        g1 = self.groups[1]
        hit1 = hit - hit % ALIGN
        while hit1 > 0 and hashes[hit1 - 1] not in g1.cache:
            hit1 -= ALIGN
        hit_blocks = max(hit1, 0)
        first_miss = hit if hit < nblocks else -1
        ext = ALIGN if (req["external"] and hit_blocks + ALIGN < nblocks) else 0
        for grp in self.groups:
            for h in hashes[: hit_blocks]:
                if h in grp.cache:
                    bid, pub, _ = grp.cache[h]
                    grp.cache[h] = (bid, pub, step)
                    grp.cache.move_to_end(h)
        self.n["lookup_blocks"] += nblocks
        self.n["hit_blocks"] += hit_blocks + ext
        prompt = nblocks * BLOCK - (req["i"] * 7) % (BLOCK // 2)  # same trace in both runs
        local_hit = hit_blocks * BLOCK
        ext_hit = ext * BLOCK
        t0 = step * STEP_NS
        self.span(SPAN_LOOKUP, t0, step=step, request_id=rid, num_query_tokens=prompt, num_hit_tokens=local_hit,
                  hit_tokens_per_group=[hit * BLOCK, hit_blocks * BLOCK], shared_prefix_boundary=req["nprefix"] * BLOCK,
                  num_external_hit_tokens=ext_hit, root_hash=hashes[0],
                  first_miss_hash=hashes[first_miss] if first_miss >= 0 else None, first_miss_index=first_miss)
        if req["external"] and ext:
            self.n["cow_copies"] += 1
            self.span(SPAN_COW, t0, step=step, request_id=rid, group_id=1, copy_reason="external",
                      copy_src=0, copy_dst=int(self.rng.integers(1, 50)))
        # Prefill in chunks of 8 blocks; one step per chunk.
        todo = list(range(hit_blocks + ext, nblocks))
        chunks = []
        s = step
        while todo:
            chunk, todo = todo[:8], todo[8:]
            for g in (0, 1):
                ids, hs = [], []
                for b in chunk:
                    if g == 1 and (b + 1) % ALIGN and b != nblocks - 1:
                        continue  # state kept only at aligned blocks and the prompt tail
                    bid = self.allocate(g, s, rid)
                    self.groups[g].cache[hashes[b]] = (bid, s, s)
                    ids.append(bid)
                    hs.append(hashes[b])
                if ids:
                    tail = chunk[-1] == nblocks - 1
                    self.n["publishes"] += 1
                    self.span(SPAN_PUBLISH, s * STEP_NS, step=s, request_id=rid, group_id=g, block_ids=ids,
                              block_hashes=hs, publish_kind="partial_tail" if tail else "full",
                              num_tokens=(chunk[-1] + 1) * BLOCK)
            if todo and req["nprefix"] + req["nsuffix"] > 16:
                self.checkpoint(s, rid, req)
            chunks.append((s * STEP_NS, (s + 1) * STEP_NS, len(chunk) * BLOCK))
            s += 1
        if not chunks:
            chunks.append((s * STEP_NS, (s + 1) * STEP_NS, BLOCK))
            s += 1
        first_token = s * STEP_NS
        itl = (STEP_NS + self.rng.integers(0, STEP_NS // 2, size=req["out"] - 1)).astype(np.int64)
        finish = first_token + int(itl.sum())
        divergent = 0
        if not self.on and self.stale_pending:
            divergent = 1
            self.stale_pending = False
            self.n["divergent_outputs"] += 1
            self.span(SPAN_DIVERGENT, first_token + int(itl[:2].sum()), step=s + 2, request_id=rid, position=2,
                      expected_token=int(self.rng.integers(0, 32000)), actual_token=int(self.rng.integers(0, 32000)))
        arrival = req["arrival"] * STEP_NS
        self.requests.append(dict(ttft=first_token - arrival, itl=itl, prompt=prompt, hit=local_hit + ext_hit,
                                  local=local_hit, ext=ext_hit, out=req["out"]))
        self.span(SPAN_REQUEST, arrival, finish, request_id=rid, session_id=f"fam-{req['fam']}", arrival_ns=arrival,
                  first_scheduled_ns=t0, first_token_ns=first_token, num_prompt_tokens=prompt,
                  num_output_tokens=req["out"], num_hit_tokens=local_hit, num_external_hit_tokens=ext_hit,
                  num_computed_tokens=prompt - local_hit - ext_hit, num_preemptions=0, num_divergent_tokens=divergent,
                  ttft_ns=first_token - arrival, itl_ns=itl.tolist(), itl_mean_ns=float(itl.mean()),
                  itl_p50_ns=float(np.percentile(itl, 50)), itl_p99_ns=float(np.percentile(itl, 99)),
                  itl_max_ns=int(itl.max()),
                  prefill_chunks=[dict(start_ns=a, end_ns=b, num_tokens=n) for a, b, n in chunks])
        return s

    stale_pending = False

    def checkpoint(self, s: int, rid: str, req: dict) -> None:
        """A prefill checkpoint state written into a slot that still carries a hash."""
        g1 = self.groups[1]
        if not g1.cache:
            return
        victim = next(reversed(g1.cache))  # the slot reused for the checkpoint
        bid, pub, used = g1.cache[victim]
        if self.on:  # behaviour on: the old key is evicted as stale, the checkpoint stays local
            del g1.cache[victim]
            g1.free.append(bid)
            self.n["evictions"] += 1
            self.span(SPAN_EVICT, s * STEP_NS, step=s, group_id=1, evict_reason="stale_hash", block_ids=[bid],
                      block_hashes=[victim], ages=[s - pub], idle=[s - used], request_id=rid)
        else:  # behaviour off: the key stays (stale) and the checkpoint is published too
            self.span(SPAN_STALE_LEFT, s * STEP_NS, step=s, request_id=rid, group_id=1, block_id=None,
                      block_ids=[bid], block_hashes=[victim], num_tokens=BLOCK * 4)
            self.n["stale_hashes"] += 1
            self.stale_pending = True
            self.span(SPAN_STALE_HASH, s * STEP_NS + 1, step=s, request_id=rid, group_id=1, block_ids=[bid],
                      block_hashes=[victim], num_tokens=BLOCK * 4,
                      expected_fingerprint=int(victim[:8], 16), actual_fingerprint=int(_hash(rid, s)[:8], 16))
            ck = _hash("ckpt", rid, s)
            nb = self.allocate(1, s, rid)
            g1.cache[ck] = (nb, s, s)
            self.n["publishes"] += 1
            self.span(SPAN_PUBLISH, s * STEP_NS, step=s, request_id=rid, group_id=1, block_ids=[nb],
                      block_hashes=[ck], publish_kind="checkpoint", num_tokens=BLOCK * 8)


def simulate(behaviour_on: bool, n_requests: int = 80, capacity: int = 160, seed: int = 7):
    """Spans (list of dicts) and the run summary for one run of the synthetic trace."""
    sim = _Sim(behaviour_on, capacity, seed)
    step = 0
    for req in _trace(n_requests, seed):
        step = max(step, req["arrival"])
        start = step
        step = sim.run_request(req, step)
        usage = [len(g.cache) / g.capacity for g in sim.groups]
        for st in range(start, step):
            sim.span(SPAN_STEP, st * STEP_NS, (st + 1) * STEP_NS, step=st, num_prefill_tokens=8 * BLOCK,
                     num_decode_seqs=4, num_running=5, num_waiting=1, num_copies=0, num_preempted=0, usage=usage)
    reqs = sim.requests
    prompt = sum(r["prompt"] for r in reqs)
    hit = sum(r["hit"] for r in reqs)
    ttft_ms = np.array([r["ttft"] for r in reqs]) / 1e6
    itl_ms = np.concatenate([r["itl"] for r in reqs]) / 1e6
    summary = dict(
        requests=len(reqs), prompt_tokens=prompt, hit_tokens=hit, token_hit_rate=hit / prompt,
        block_hit_rate=sim.n["hit_blocks"] / sim.n["lookup_blocks"],
        ttft_ms_p50=float(np.percentile(ttft_ms, 50)), ttft_ms_p99=float(np.percentile(ttft_ms, 99)),
        itl_ms_p50=float(np.percentile(itl_ms, 50)), itl_ms_p99=float(np.percentile(itl_ms, 99)),
        publishes=sim.n["publishes"], evictions=sim.n["evictions"], cow_copies=sim.n["cow_copies"],
        stale_hashes=sim.n["stale_hashes"], divergent_outputs=sim.n["divergent_outputs"], preemptions=0,
        digest=_hash(behaviour_on, n_requests, seed),
    )
    return sim.rows, summary


def _table(rows: list[dict]) -> pa.Table:
    from kvtrace.store.schema import SPAN_ARROW_SCHEMA

    names = sorted({k for r in rows for k in r if k != "block_id"})
    fields = [SPAN_ARROW_SCHEMA.field(n) for n in names]
    return pa.Table.from_pylist([{n: r.get(n) for n in names} for r in rows], schema=pa.schema(fields))


def engine_config(capacity: int) -> dict:
    """The run config as an engine replay stores it: group 0 attention, group 1 Mamba state,
    ``capacity`` usable blocks each (block ids 1..capacity; id 0 is the null block)."""
    return {"cache": {"groups": [{"type": "FullAttentionSpec", "block_size": BLOCK},
                                 {"type": "MambaSpec", "block_size": BLOCK, "num_lanes": 4}],
                      "num_gpu_blocks": [capacity + 1, capacity + 1]}}


def write_runs(db: str, n_requests: int = 80, capacity: int = 160, seed: int = 7) -> dict[str, dict]:
    """Write the trace twice (behaviour on, off); return {run_id: summary}."""
    out = {}
    with Store.open(db) as store:
        for on in (True, False):
            behaviours = ALL if on else [b for b in ALL if b != BEHAVIOUR]
            name = "synthetic-on" if on else f"synthetic-without-{BEHAVIOUR}"
            run_id = store.create_run(name, created="2026-11-29T00:00:00+00:00",
                                      trace_source="gen:synthetic-shared-prompts",
                                      trace_digest="synthetic-7", config=engine_config(capacity),
                                      behaviours=behaviours, mode="engine")
            rows, summary = simulate(on, n_requests, capacity, seed)
            store.append_spans(_table(rows), run_id=run_id)
            store.finish_run(run_id, status="complete", digest=summary["digest"], summary=summary)
            out[run_id] = summary
    return out
