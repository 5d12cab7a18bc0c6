"""A small hand-built span set with known answers (see the expectations in test_read.py).

Steps are 1000 ns apart; cache spans cover their step. Hashes are short hex strings.
"""

from __future__ import annotations

import pyarrow as pa

from kvtrace.store.schema import SPAN_ARROW_SCHEMA

PUB, EVICT, COW, LOOKUP = "kvtrace.cache.publish", "kvtrace.cache.evict", "kvtrace.cache.cow", "kvtrace.cache.lookup"
STEP, REQ = "kvtrace.engine.step", "kvtrace.request"
STALE_LEFT, STALE, DIV = "kvtrace.cache.stale_left", "kvtrace.verify.stale_hash", "kvtrace.verify.divergent_output"


def at(step: int, **kw) -> dict:
    kw.setdefault("start_ns", step * 1000)
    kw.setdefault("end_ns", step * 1000 + 1000)
    kw["step"] = step
    return kw


def lookup(step, req, q, h, per_group, root, miss, miss_index, ext=0):
    return at(step, name=LOOKUP, request_id=req, num_query_tokens=q, num_hit_tokens=h,
              hit_tokens_per_group=per_group, root_hash=root, first_miss_hash=miss,
              first_miss_index=miss_index, num_external_hit_tokens=ext, shared_prefix_boundary=0)


def scenario_rows() -> list[dict]:
    """Rows in append (seq) order; the index in this list is the span's seq. A step's child
    spans are 10 ns apart in this order, as the instrument spreads cache spans over the step's
    window in event order (order across span kinds is time: seq numbers a batch kind by kind)."""
    return _with_ids(_spread([
        # step 0
        at(0, name=STEP, usage=[0.1, 0.2], num_running=1, num_waiting=0),                     # 0
        lookup(0, "A", 64, 0, [0, 0], "h1", "h1", 0),                                          # 1
        at(0, name=PUB, request_id="A", group_id=0, publish_kind="full",
           block_ids=[1, 2], block_hashes=["h1", "h2"], num_tokens=32),                        # 2
        at(0, name=PUB, request_id="A", group_id=1, publish_kind="checkpoint",
           block_ids=[10], block_hashes=["h2"], num_tokens=32),                                # 3
        # step 1
        at(1, name=STEP, usage=[0.5, 0.5], num_running=2, num_waiting=1),                     # 4
        lookup(1, "B", 64, 32, [32, 16], "h1", "h3", 1, ext=8),                                # 5
        at(1, name=EVICT, group_id=0, evict_reason="lru", block_ids=[1, 2],
           block_hashes=["h1", "h2"], ages=[1, 1], idle=[1, 0], request_id="C"),               # 6
        at(1, name=PUB, request_id="C", group_id=0, publish_kind="partial_tail",
           block_ids=[1], block_hashes=["h9"], num_tokens=40),                                 # 7
        at(1, name=COW, request_id="B", group_id=0, copy_reason="partial_hit", copy_src=2, copy_dst=5),  # 8
        # step 2
        at(2, name=STEP, usage=[0.9, 0.4], num_running=3, num_waiting=0),                     # 9
        lookup(2, "D", 48, 0, [0, 0], "h1", "h1", 0),                                          # 10
        lookup(2, "E", 32, 16, [16, 16], "h2", "h2", 1),                                       # 11
        lookup(2, "F", 16, 0, [0, 0], "h5", "h7", 0),                                          # 12
        at(2, name=STALE_LEFT, request_id="A", group_id=1, block_ids=[10], block_hashes=["h2"], num_tokens=32),  # 13
        at(2, name=STALE, request_id="A", group_id=1, block_ids=[10], block_hashes=["h2"], num_tokens=32,
           expected_fingerprint=11, actual_fingerprint=22),                                    # 14
        at(2, name=DIV, request_id="E", position=3, expected_token=5, actual_token=6),         # 15
        dict(name=REQ, request_id="A", start_ns=0, end_ns=5000, arrival_ns=0, first_scheduled_ns=100,
             first_token_ns=900, num_prompt_tokens=64, num_output_tokens=4, num_hit_tokens=0,
             num_external_hit_tokens=0, num_computed_tokens=64, itl_ns=[1000, 2000, 1100],
             num_external_query_tokens=64, num_preemptions=1, num_preempted_query_tokens=66,
             num_preempted_hit_tokens=32,
             itl_mean_ns=4100 / 3, itl_p50_ns=1100.0, itl_p99_ns=1998.0, itl_max_ns=2000,
             prefill_chunks=[{"start_ns": 100, "end_ns": 500, "num_tokens": 32},
                             {"start_ns": 500, "end_ns": 900, "num_tokens": 32}]),             # 16
        dict(name=REQ, request_id="B", start_ns=500, end_ns=3000, arrival_ns=500, first_scheduled_ns=1000,
             first_token_ns=1500, num_prompt_tokens=64, num_output_tokens=2, num_hit_tokens=32,
             num_external_hit_tokens=8, num_computed_tokens=24, itl_ns=[1500], itl_mean_ns=1500.0,
             num_external_query_tokens=32,
             itl_p50_ns=1500.0, itl_p99_ns=1500.0, itl_max_ns=1500,
             prefill_chunks=[{"start_ns": 1000, "end_ns": 1500, "num_tokens": 24}]),          # 17
        # step 3
        at(3, name=EVICT, group_id=0, evict_reason="stale_hash", block_ids=[1], block_hashes=["h9"],
           ages=[2], idle=[0], request_id="E"),                                                # 18
        at(3, name=PUB, request_id="E", group_id=0, publish_kind="checkpoint",
           block_ids=[1], block_hashes=["h10"], num_tokens=48),                                # 19
        lookup(3, "G", 32, 16, [16, 0], "h1", "h9", 2),                                        # 20
    ]))


_CACHE_NAMES = (LOOKUP, PUB, EVICT, COW, STALE_LEFT, STALE, DIV)  # (the step's children; verification at its time)


def _spread(rows: list[dict]) -> list[dict]:
    placed: dict[int, int] = {}
    for r in rows:
        if r["name"] in _CACHE_NAMES:
            k = placed[r["step"]] = placed.get(r["step"], -1) + 1
            r["start_ns"] += 10 * k
    return rows


def _with_ids(rows: list[dict]) -> list[dict]:
    """OTel ids as the instrument lays them out: a trace per step rooted at its step span,
    a trace per request; the top bit set so the full 64-bit range round-trips."""
    step_span = {r["step"]: (1 << 63) | i for i, r in enumerate(rows) if r["name"] == STEP}
    for i, r in enumerate(rows):
        root = r["name"] in (STEP, REQ)
        key = r["step"] if not root or r["name"] == STEP else 1000 + i
        r.update(trace_id_hi=0xFEED << 48 | key, trace_id_lo=key, span_id=(1 << 63) | i,
                 parent_span_id=None if root else step_span.get(r["step"]))
    return rows


def scenario_table(rows: list[dict] | None = None) -> pa.Table:
    rows = scenario_rows() if rows is None else rows
    names = [f.name for f in SPAN_ARROW_SCHEMA if f.name != "run_id"]
    cols = {n: [r.get(n) for r in rows] for n in names}
    return pa.table({n: pa.array(cols[n], SPAN_ARROW_SCHEMA.field(n).type) for n in names})


def as_viewed(table: pa.Table) -> pa.Table:
    """What the store's views show for rows appended as ``table``: ids as OTel hex."""
    cols = {n: table.column(n).to_pylist() for n in table.column_names}
    hi, lo = cols.pop("trace_id_hi"), cols.pop("trace_id_lo")
    out = {"trace_id": [None if h is None else f"{h:016x}{v:016x}" for h, v in zip(hi, lo)]}
    for c in ("span_id", "parent_span_id"):
        out[c] = [None if v is None else f"{v:016x}" for v in cols.pop(c)]
    out["links"] = [None if links is None else [
        {"trace_id": f"{k['trace_id_hi']:016x}{k['trace_id_lo']:016x}", "span_id": f"{k['span_id']:016x}",
         "trace_state": k["trace_state"], "attributes": k["attributes"]} for k in links] for links in cols.pop("links")]
    return pa.table({**{n: pa.array(v) for n, v in out.items()},
                     **{n: table.column(n) for n in cols}})
