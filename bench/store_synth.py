"""Synthetic span generator for store benchmarks: realistic mix, built in bulk with numpy/Arrow.

Per scheduler step (about 47 spans): 1 step, 2 lookups, 2 finished requests (ITL arrays of
8..120 gaps), 18 publishes and 14 evictions of 1..4 blocks each, 8 frees, 2 CoW copies,
and rare stale-hash / divergent-output spans. Publishes mostly reuse the block ids evicted
in the same step and lookups mostly miss on recently evicted hashes, so eviction
attribution has real chains to find. Deterministic for a seed.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrace.store.schema import SPAN_ARROW_SCHEMA

SPANS_PER_STEP = 47
STEP_NS = 20_000_000  # 20 ms virtual steps
NUM_BLOCKS = 60_000
NUM_HASHES = 1 << 21
NUM_PREFIXES = 2_000
_TYPES = {f.name: f.type for f in SPAN_ARROW_SCHEMA}
_ORDER = ["step", "lookup", "evict", "publish", "cow", "free", "stale_left", "stale", "divergent", "request"]
_NAMES = {
    "step": "kvtrace.engine.step", "lookup": "kvtrace.cache.lookup", "evict": "kvtrace.cache.evict",
    "publish": "kvtrace.cache.publish", "cow": "kvtrace.cache.cow", "free": "kvtrace.cache.free",
    "stale_left": "kvtrace.cache.stale_left", "stale": "kvtrace.verify.stale_hash",
    "divergent": "kvtrace.verify.divergent_output", "request": "kvtrace.request",
}


class Vocab:
    """Hex strings for integer ids, made once (formatting per span would dominate)."""

    def __init__(self, n: int, width: int = 16):
        self.strings = pa.array([format(i * 0x9E3779B97F4A7C15 & (2**64 - 1), f"0{width}x") for i in range(n)])

    def take(self, ids: np.ndarray) -> pa.Array:
        return self.strings.take(pa.array(ids))


def _lists(values: np.ndarray, lengths: np.ndarray, typ: pa.DataType) -> pa.Array:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, typ.value_type))


def _string_lists(values: pa.Array, lengths: np.ndarray) -> pa.Array:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), values)


def _table(kind: str, steps: np.ndarray, cols: dict) -> pa.Table:
    n = len(steps)
    out = {
        "name": pa.array(np.full(n, _NAMES[kind], dtype=object)),
        "step": pa.array(steps.astype(np.int64)),
        "start_ns": pa.array(steps.astype(np.int64) * STEP_NS),
        "end_ns": pa.array(steps.astype(np.int64) * STEP_NS + STEP_NS),
    }
    out.update(cols)
    for k, v in list(out.items()):
        if not isinstance(v, (pa.Array, pa.ChunkedArray)):
            out[k] = pa.array(v, _TYPES[k])
        elif out[k].type != _TYPES[k]:
            out[k] = out[k].cast(_TYPES[k])
    return pa.table(out)


class SpanSynth:
    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.hashes = Vocab(NUM_HASHES)
        self.prefixes = Vocab(NUM_PREFIXES)
        self.recent_evicted = np.zeros(0, dtype=np.int64)  # hash ids evicted lately
        self.next_request = 0

    def _zipf(self, n: int, size: int, a: float = 1.2) -> np.ndarray:
        return (self.rng.zipf(a, size) - 1) % n

    def chunk(self, step0: int, num_steps: int) -> pa.Table:
        """Spans of steps [step0, step0 + num_steps), in per-step event order."""
        rng = self.rng
        steps = np.arange(step0, step0 + num_steps)
        parts: dict[str, pa.Table] = {}
        rep = lambda k: np.repeat(steps, k)  # noqa: E731

        s = steps
        usage = rng.uniform(0.3, 1.0, (len(s), 2))
        parts["step"] = _table("step", s, {
            "usage": _lists(usage.ravel(), np.full(len(s), 2), _TYPES["usage"]),
            "num_prefill_tokens": rng.integers(0, 8192, len(s)), "num_decode_seqs": rng.integers(0, 256, len(s)),
            "num_running": rng.integers(0, 256, len(s)), "num_waiting": rng.integers(0, 64, len(s)),
            "num_copies": rng.integers(0, 4, len(s)), "num_preempted": rng.integers(0, 2, len(s)),
        })

        ev_steps = rep(14)
        ev_len = rng.integers(1, 5, len(ev_steps))
        ev_blocks = rng.integers(0, NUM_BLOCKS, ev_len.sum())
        ev_hash_ids = self._zipf(NUM_HASHES, ev_len.sum(), 1.1)
        ev_groups = rng.integers(0, 2, len(ev_steps))
        parts["evict"] = _table("evict", ev_steps, {
            "group_id": ev_groups,
            "evict_reason": rng.choice(np.array(["lru", "lru", "lru", "stale_hash", "replaced", "connector"], dtype=object), len(ev_steps)),
            "block_ids": _lists(ev_blocks, ev_len, _TYPES["block_ids"]),
            "block_hashes": _string_lists(self.hashes.take(ev_hash_ids), ev_len),
            "ages": _lists(rng.integers(1, 5000, ev_len.sum()), ev_len, _TYPES["ages"]),
            "idle": _lists(rng.integers(0, 2000, ev_len.sum()), ev_len, _TYPES["idle"]),
            "request_id": pa.array(np.char.add("req-", (self.next_request + rng.integers(0, 2 * len(s), len(ev_steps))).astype(str)).astype(object)),
        })

        pub_steps = rep(18)
        pub_len = rng.integers(1, 5, len(pub_steps))
        # most published blocks take block ids evicted in this chunk
        reuse = rng.random(pub_len.sum()) < 0.7
        pub_blocks = np.where(reuse, ev_blocks[rng.integers(0, len(ev_blocks), pub_len.sum())],
                              rng.integers(0, NUM_BLOCKS, pub_len.sum()))
        parts["publish"] = _table("publish", pub_steps, {
            "group_id": rng.integers(0, 2, len(pub_steps)),
            "publish_kind": rng.choice(np.array(["full"] * 6 + ["partial_tail", "checkpoint", "boundary"], dtype=object), len(pub_steps)),
            "block_ids": _lists(pub_blocks, pub_len, _TYPES["block_ids"]),
            "block_hashes": _string_lists(self.hashes.take(self._zipf(NUM_HASHES, pub_len.sum(), 1.1)), pub_len),
            "num_tokens": rng.integers(16, 32768, len(pub_steps)),
            "request_id": pa.array(np.char.add("req-", (self.next_request + rng.integers(0, 2 * len(s), len(pub_steps))).astype(str)).astype(object)),
        })

        lk_steps = rep(2)
        n_lk = len(lk_steps)
        req_ids = np.char.add("req-", np.arange(self.next_request, self.next_request + n_lk).astype(str)).astype(object)
        self.next_request += n_lk
        q = rng.integers(64, 16384, n_lk)
        h = (q * rng.uniform(0, 1, n_lk)).astype(np.int64) // 16 * 16
        x = np.where(rng.random(n_lk) < 0.1, (q - h) // 4, 0)
        pool = np.concatenate([self.recent_evicted, ev_hash_ids[ev_groups.repeat(ev_len) == 0]])
        miss = np.where(rng.random(n_lk) < 0.6, pool[rng.integers(0, len(pool), n_lk)], rng.integers(0, NUM_HASHES, n_lk))
        self.recent_evicted = pool[-50_000:]
        has_miss = h < q
        per_group = np.stack([h, np.minimum(h, (h * rng.uniform(0.5, 1, n_lk)).astype(np.int64))], axis=1)
        parts["lookup"] = _table("lookup", lk_steps, {
            "request_id": pa.array(req_ids), "num_query_tokens": q, "num_hit_tokens": h,
            "num_external_hit_tokens": x, "shared_prefix_boundary": rng.integers(0, 4096, n_lk),
            "hit_tokens_per_group": _lists(per_group.ravel(), np.full(n_lk, 2), _TYPES["hit_tokens_per_group"]),
            "root_hash": self.prefixes.take(self._zipf(NUM_PREFIXES, n_lk)),
            "first_miss_hash": pa.array(np.where(has_miss, self.hashes.take(miss).to_numpy(zero_copy_only=False), None)),
            "first_miss_index": np.where(has_miss, h // 16, -1),
        })

        cow_steps = rep(2)
        parts["cow"] = _table("cow", cow_steps, {
            "group_id": rng.integers(0, 2, len(cow_steps)),
            "copy_reason": rng.choice(np.array(["partial_hit", "running_tail", "external"], dtype=object), len(cow_steps)),
            "copy_src": rng.integers(0, NUM_BLOCKS, len(cow_steps)), "copy_dst": rng.integers(0, NUM_BLOCKS, len(cow_steps)),
            "request_id": pa.array(req_ids[rng.integers(0, n_lk, len(cow_steps))]),
        })

        fr_steps = rep(8)
        fr_len = rng.integers(1, 9, len(fr_steps))
        parts["free"] = _table("free", fr_steps, {
            "group_id": rng.integers(0, 2, len(fr_steps)),
            "block_ids": _lists(rng.integers(0, NUM_BLOCKS, fr_len.sum()), fr_len, _TYPES["block_ids"]),
            "request_id": pa.array(req_ids[rng.integers(0, n_lk, len(fr_steps))]),
        })

        rare = steps[rng.random(len(s)) < 0.05]
        rare_hash = self.hashes.take(rng.integers(0, NUM_HASHES, len(rare)))
        one = np.ones(len(rare), dtype=np.int64)
        blk = rng.integers(0, NUM_BLOCKS, len(rare))
        common = {"group_id": np.ones(len(rare), dtype=np.int64), "block_ids": _lists(blk, one, _TYPES["block_ids"]),
                  "block_hashes": _string_lists(rare_hash, one), "num_tokens": rng.integers(16, 8192, len(rare)),
                  "request_id": pa.array(np.char.add("req-", rng.integers(0, max(1, self.next_request), len(rare)).astype(str)).astype(object))}
        parts["stale_left"] = _table("stale_left", rare, dict(common))
        parts["stale"] = _table("stale", rare, dict(common, expected_fingerprint=rng.integers(0, 2**62, len(rare)).astype(np.uint64),
                                                     actual_fingerprint=rng.integers(0, 2**62, len(rare)).astype(np.uint64)))
        parts["divergent"] = _table("divergent", rare, {
            "request_id": common["request_id"], "position": rng.integers(0, 100, len(rare)),
            "expected_token": rng.integers(0, 150000, len(rare)), "actual_token": rng.integers(0, 150000, len(rare))})

        # requests finishing at these steps (they are the ones looked up ~64 steps ago)
        rq_steps = rep(2)
        n_rq = len(rq_steps)
        out_len = rng.integers(8, 121, n_rq)
        gaps = rng.gamma(4.0, STEP_NS / 4, out_len.sum()).astype(np.int64) + 1
        offs = np.concatenate([[0], np.cumsum(out_len)])
        decode = np.add.reduceat(gaps, offs[:-1])
        finish = rq_steps.astype(np.int64) * STEP_NS + STEP_NS
        first_tok = finish - decode
        ttft = rng.gamma(2.0, 5 * STEP_NS, n_rq).astype(np.int64) + STEP_NS
        arrival = first_tok - ttft
        sched = arrival + (ttft * rng.uniform(0, 0.5, n_rq)).astype(np.int64)
        seg = np.repeat(np.arange(n_rq), out_len)
        sorted_gaps = gaps[np.lexsort((gaps, seg))]
        p50 = sorted_gaps[offs[:-1] + (out_len - 1) // 2].astype(np.float64)
        p99 = sorted_gaps[offs[:-1] + ((out_len - 1) * 99) // 100].astype(np.float64)
        prompt = rng.integers(64, 16384, n_rq)
        hit = (prompt * rng.uniform(0, 1, n_rq)).astype(np.int64)
        chunk_start = np.stack([sched, (sched + first_tok) // 2], axis=1).ravel()
        chunk_end = np.stack([(sched + first_tok) // 2, first_tok], axis=1).ravel()
        chunks = pa.StructArray.from_arrays(
            [pa.array(chunk_start), pa.array(chunk_end), pa.array(np.repeat((prompt - hit) // 2, 2))],
            names=["start_ns", "end_ns", "num_tokens"])
        rq_ids = np.char.add("req-", np.maximum(0, self.next_request - 256 + rng.integers(0, 256, n_rq)).astype(str)).astype(object)
        parts["request"] = _table("request", rq_steps, {
            "start_ns": arrival, "end_ns": finish, "request_id": pa.array(rq_ids), "arrival_ns": arrival,
            "first_scheduled_ns": sched, "first_token_ns": first_tok, "num_prompt_tokens": prompt,
            "num_output_tokens": out_len + 1, "num_hit_tokens": hit, "num_external_hit_tokens": np.zeros(n_rq, np.int64),
            "num_computed_tokens": prompt - hit, "num_preemptions": np.zeros(n_rq, np.int64),
            "num_divergent_tokens": np.zeros(n_rq, np.int64), "ttft_ns": ttft,
            "itl_ns": _lists(gaps, out_len, _TYPES["itl_ns"]), "itl_mean_ns": decode / out_len,
            "itl_p50_ns": p50, "itl_p99_ns": p99,
            "itl_max_ns": np.maximum.reduceat(gaps, offs[:-1]),
            "prefill_chunks": pa.ListArray.from_arrays(pa.array(np.arange(0, 2 * n_rq + 1, 2, dtype=np.int32)), chunks),
        })

        table = pa.concat_tables([parts[k] for k in _ORDER], promote_options="default")
        kind_rank = np.concatenate([np.full(parts[k].num_rows, i) for i, k in enumerate(_ORDER)])
        step_col = table.column("step").to_numpy()
        order = np.lexsort((np.arange(table.num_rows), kind_rank, step_col))
        return self._with_ids(table.take(pa.array(order)), step0, num_steps)

    def _with_ids(self, table: pa.Table, step0: int, num_steps: int) -> pa.Table:
        """OTel ids as the instrument writes them: one trace per step (its step span the
        root, the other spans its children), random 64-bit span ids; requests are roots."""
        rng, n = self.rng, table.num_rows
        trace = rng.integers(1, 2**64, (num_steps, 2), dtype=np.uint64, endpoint=False)
        step_span = rng.integers(1, 2**64, num_steps, dtype=np.uint64, endpoint=False)
        at = table.column("step").to_numpy() - step0
        names = table.column("name")
        is_step = pc.equal(names, _NAMES["step"]).to_numpy(zero_copy_only=False)
        root = is_step | pc.equal(names, _NAMES["request"]).to_numpy(zero_copy_only=False)
        own = np.where(is_step, step_span[at], rng.integers(1, 2**64, n, dtype=np.uint64, endpoint=False))
        return (table.append_column("trace_id_hi", pa.array(trace[at, 0]))
                .append_column("trace_id_lo", pa.array(trace[at, 1]))
                .append_column("span_id", pa.array(own))
                .append_column("parent_span_id", pa.array(step_span[at], pa.uint64(), mask=root)))


def fill_store(store, run_id: str, num_spans: int, seed: int = 0, steps_per_chunk: int = 4000) -> int:
    """Append about ``num_spans`` synthetic spans to ``run_id``; return the count appended."""
    synth = SpanSynth(seed)
    total, step = 0, 0
    while total < num_spans:
        n_steps = max(1, min(steps_per_chunk, (num_spans - total) // SPANS_PER_STEP + 1))
        table = synth.chunk(step, n_steps)
        if total + table.num_rows > num_spans:
            table = table.slice(0, num_spans - total)
        total += store.append_spans(table, run_id=run_id)
        step += n_steps
    store.flush()
    return total
