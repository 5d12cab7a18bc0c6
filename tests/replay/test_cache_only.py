"""Cache-only replay through the real KVCacheManager, the bare reference, and Belady."""

from __future__ import annotations

import random
import re

import pytest

from kvtrace.cache.events import BlockEvicted, BlockPublished, BlocksFreed, PrefixLookup
from kvtrace.errors import ConfigError
from kvtrace.replay.belady import belady_hits, chain_keys, next_uses
from kvtrace.replay.cache_only import block_keys, replay_cache_only
from kvtrace.replay.curve import capacity_curve
from kvtrace.replay.digest import Digest
from kvtrace.replay.generate import generate
from kvtrace.replay.readers import open_trace, read_trace
from kvtrace.workload import TraceRequest
from tests.conftest import TRACES
from tests.support.oracles import lru_reference

MOONCAKE = TRACES / "mooncake_synthetic_trace.jsonl"


def req(rid: str, ids, input_length=None, bs=4, **kw) -> TraceRequest:
    n = input_length if input_length is not None else len(ids) * bs
    return TraceRequest(rid, 0, n, 1, hash_ids=tuple(ids), hash_block_size=bs, **kw)


def hits(reqs, capacity, policy="lru"):
    return replay_cache_only(reqs, capacity_blocks=capacity, policy=policy).per_request_hit_blocks


def test_prefix_contiguous_hit_and_partial_last_block():
    r = [req("a", [1, 2, 3], input_length=10), req("b", [1, 2, 3], input_length=10), req("c", [1, 9, 3])]
    res = replay_cache_only(r, capacity_blocks=100)
    assert res.per_request_hit_blocks == [0, 3, 1]  # c: 3 is cached but after a miss
    # b's partial last block hits: min(3 * 4, 10) = 10 tokens, the whole prompt
    assert res.per_request_hit_tokens == [0, 10, 4]
    assert (res.prompt_tokens, res.hit_tokens) == (32, 14)
    assert res.prefix_cache_hit_rate == pytest.approx(14 / 32) and res.block_hit_rate == pytest.approx(4 / 9)
    assert res.publishes == 3 + 0 + 2 and res.evictions == 0


def test_free_order_evicts_a_requests_tail_before_its_prefix():
    # capacity 4: [1,2,3,4] cached; [7] needs one block -> the LRU victim is 4 (tail first)
    r = [req("a", [1, 2, 3, 4]), req("b", [7]), req("c", [1, 2, 3, 4]), req("d", [1, 2, 3, 4])]
    assert hits(r, 4) == [0, 0, 3, 4]
    res = replay_cache_only(r, capacity_blocks=4)
    assert res.evictions == 2  # 4 for b, then 7 for c's block 4


def test_running_request_blocks_are_not_evicted():
    # capacity 3, a 3-block request whose hit is 2 blocks: the miss must evict something
    # outside the request; block 5 is the only other cached block
    r = [req("a", [1, 2]), req("b", [5]), req("c", [1, 2, 3]), req("d", [1, 2, 3])]
    assert hits(r, 3) == [0, 0, 2, 3]
    assert hits(r, 3, "belady") == [0, 0, 2, 3]


def test_oversized_request_is_served_uncached():
    r = [req("a", [1, 2, 3]), req("big", [1, 2, 3, 4, 5, 6]), req("c", [1, 2, 3])]
    res = replay_cache_only(r, capacity_blocks=4)
    assert res.oversized == 1 and res.per_request_hit_blocks == [0, 3, 3]
    assert belady_hits(chain_keys(r)[0], 4)[3] == 1


def test_manager_path_equals_the_bare_reference_on_generated_workloads():
    for name, cap in (("chat", 300), ("agent", 900), ("mixed", 500)):
        reqs = generate(name, 11)
        res = replay_cache_only(reqs, capacity_blocks=cap)
        ref_hits, ref_pub, ref_ev, _ = lru_reference(chain_keys(reqs)[0], cap)
        assert res.per_request_hit_blocks == ref_hits, name
        assert (res.publishes, res.evictions) == (ref_pub, ref_ev)
        assert res.evictions > 0 and sum(ref_hits) > 0  # the capacity really binds


def test_one_token_blocks():
    # At one token a block the extra token each request is presented with fills a block of
    # its own, whose key the hasher appends: the keys were handed over as a tuple (an
    # AttributeError on every trace at --block-size 1).
    reqs = generate("chat", 11)[:40]
    one, two = (replay_cache_only(reqs, block_size=bs) for bs in (1, 2))
    hit_tokens = [[h * bs for h in res.per_request_hit_blocks] for res, bs in ((one, 1), (two, 2))]
    assert all(a >= b for a, b in zip(*hit_tokens))  # finer blocks hit at least as much
    assert all(h <= r.input_length for h, r in zip(hit_tokens[0], reqs)) and sum(hit_tokens[0]) > 0


def random_trace(seed: int, n: int = 120) -> list[TraceRequest]:
    """Requests drawn from a random prefix tree (nested reuse, varied depth)."""
    rng = random.Random(seed)
    paths: list[tuple[int, ...]] = [()]
    next_id = 0
    out = []
    for i in range(n):
        base = rng.choice(paths)
        base = base[: rng.randint(0, len(base))]
        ext = []
        for _ in range(rng.randint(1, 5)):
            ext.append(next_id)
            next_id += 1
        ids = base + tuple(ext)
        paths.append(ids)
        out.append(req(f"r{i}", ids, input_length=len(ids) * 4 - rng.randint(0, 3)))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_belady_bounds_lru_and_matches_unbounded_cache(seed):
    reqs = random_trace(seed)
    keys = chain_keys(reqs)[0]
    for cap in (8, 16, 40):
        lru = sum(lru_reference(keys, cap)[0])
        opt = sum(belady_hits(keys, cap)[0])
        assert opt >= lru
        assert sum(hits(reqs, cap)) == lru  # the manager path agrees with the reference
    unbounded = sum(len(k) for k in keys)
    assert sum(belady_hits(keys, unbounded)[0]) == sum(lru_reference(keys, unbounded)[0])


def test_belady_prefers_the_block_used_soonest():
    # capacity 4: after a=[1,2] and b=[3,4], c=[5] must evict; [1,2] comes back next
    # and [3,4] never does, so MIN evicts 4 (deepest of the never-used); LRU evicts the
    # oldest, a's tail 2, and d only hits [1]
    r = [req("a", [1, 2]), req("b", [3, 4]), req("c", [5]), req("d", [1, 2])]
    assert hits(r, 4, "belady") == [0, 0, 0, 2]
    assert hits(r, 4, "lru") == [0, 0, 0, 1]


def test_next_uses():
    assert next_uses([[1, 2], [1], [2, 1]]) == [[1, 2], [2], [1 << 62, 1 << 62]]


def test_scopes_keep_equal_ids_apart():
    a = req("a", [1, 2], namespace=1)
    b = req("b", [1, 2], namespace=2)
    c = req("c", [1, 2], namespace=1, cache_salt="s")
    d = req("d", [1, 2], namespace=1)
    assert hits([a, b, c, d], 100) == [0, 0, 0, 2]
    keys = block_keys([a, b, c, d])
    assert keys[0] == keys[3] and keys[0][0] != keys[1][0] != keys[2][0]
    # the first scope keeps its trace ids; the others get negative keys, all int64
    assert list(keys[0]) == [1, 2] and all(k < 0 for ks in keys[1:3] for k in ks)
    assert all(-(1 << 63) <= k < (1 << 63) for ks in keys for k in ks)


def test_non_chained_ids_fall_back_to_chain_keys():
    # id 3 follows 2 in one request and 9 in another: keys must differ
    r = [req("a", [1, 2, 3]), req("b", [1, 9, 3]), req("c", [1, 2, 3])]
    keys = block_keys(r)
    assert keys[0][2] != keys[1][2] and keys[0] == keys[2]
    assert hits(r, 100) == [0, 1, 3]


def test_dense_and_sparse_ids_give_the_same_keys():
    # small ids take the table path, ids shifted past 4x the block count take np.unique:
    # both must key (and chain-check) alike, the key carrying the id itself
    ids = [[0, 1, 2], [0, 1, 5], [7], [0, 1, 2, 3]]
    shift = 1 << 40
    dense = block_keys([req(str(i), x) for i, x in enumerate(ids)])
    sparse = block_keys([req(str(i), [shift + v for v in x]) for i, x in enumerate(ids)])
    assert [list(ks) for ks in dense] == ids
    assert [[k - shift for k in ks] for ks in sparse] == ids
    assert dense[0][:2] == dense[1][:2] == dense[3][:2] and dense[0][2] != dense[1][2]
    # id 1 follows 0 and then 7: not prefix-chained, so both paths fall back to chain keys
    broken = [[0, 1], [7, 1]]
    for base in (0, shift):
        keys = block_keys([req(str(i), [base + v for v in x]) for i, x in enumerate(broken)])
        assert keys[0][1] != keys[1][1] and max(list(keys[0]) + list(keys[1])) < 0


def test_ids_beyond_int64_fall_back_to_chain_keys():
    big = 1 << 70
    r = [req("a", [big, big + 1]), req("b", [big, big + 2]), req("c", [big, big + 1])]
    keys = block_keys(r)
    assert keys[0] == keys[2] and keys[0][0] == keys[1][0] and keys[0][1] != keys[1][1]
    assert hits(r, 100) == [0, 1, 2]


def test_token_requests_are_reblocked_by_content():
    reqs = generate("chat", 2, 30, prompt="tokens")
    same = generate("chat", 2, 30)
    a = replay_cache_only(reqs, capacity_blocks=400, block_size=16)
    b = replay_cache_only(same, capacity_blocks=400)
    assert a.per_request_hit_blocks == b.per_request_hit_blocks and a.hit_tokens > 0


def test_events_flow_one_step_per_request_and_digest_is_deterministic():
    reqs = generate("mixed", 3, 60)
    batches = []
    d1, d2 = Digest(), Digest()
    replay_cache_only(reqs, capacity_blocks=600, listeners=[batches.append, d1])
    replay_cache_only(reqs, capacity_blocks=600, listeners=[d2])
    assert len(batches) == 60 and d1.hexdigest() == d2.hexdigest()
    kinds = {type(e) for b in batches for e in b}
    assert {PrefixLookup, BlockPublished, BlocksFreed, BlockEvicted} <= kinds
    assert all(e.step == i for i, b in enumerate(batches) for e in b)
    d3 = Digest()
    replay_cache_only(reqs, capacity_blocks=601, listeners=[d3])
    assert d3.hexdigest() != d1.hexdigest()
    # Belady reports its lookups, so its digest depends on the bound's hits
    lookups, b1, b2 = [], Digest(), Digest()
    res = replay_cache_only(reqs, capacity_blocks=100, policy="belady", listeners=[lookups.extend, b1])
    replay_cache_only(reqs, capacity_blocks=200, policy="belady", listeners=[b2])
    assert [e.num_hit_tokens for e in lookups] == res.per_request_hit_tokens
    assert b1.hexdigest() != b2.hexdigest()


def test_capacity_and_policy_arguments():
    r = [req("a", [1])]
    assert replay_cache_only(r, capacity_tokens=40).capacity_blocks == 10
    # rounded up, as `replay --capacity-tokens` is (the API rounded down: another capacity)
    assert replay_cache_only(r, capacity_tokens=41).capacity_blocks == 11
    with pytest.raises(ConfigError, match="at most one of capacity_blocks / capacity_tokens"):
        replay_cache_only(r, capacity_blocks=4, capacity_tokens=16)
    with pytest.raises(ConfigError, match="policy"):
        replay_cache_only(r, capacity_blocks=4, policy="fifo")
    with pytest.raises(ConfigError, match="capacity_blocks"):
        replay_cache_only(r, capacity_blocks=0)
    progress = []
    replay_cache_only([r[0], req("b", [2])], capacity_blocks=4, progress=progress.append)
    assert progress == [1, 2]


def test_mooncake_sample_hit_rates():
    src = open_trace(MOONCAKE)
    lru = replay_cache_only(src, capacity_blocks=5859)
    opt = replay_cache_only(src, capacity_blocks=5859, policy="belady")
    assert lru.requests == 3993 and lru.prompt_tokens == 61_194_628
    assert lru.hit_tokens == 19_281_874  # token hit rate 31.5% at 5,859 x 512 tokens
    assert opt.hit_tokens == 34_245_373  # Belady: 56.0%
    # an unbounded cache reaches every reuse: the paper's ~2/3 cache ratio
    everything = replay_cache_only(read_trace(MOONCAKE), capacity_blocks=200_000, policy="belady")
    assert 0.60 < everything.block_hit_rate < 0.66 and everything.evictions == 0


def test_every_key_fits_the_digest_and_the_store(tmp_path):
    """Multi-scope and non-chained traces used to make keys beyond 64 bits, which the digest
    (MessagePack) and the store (int64) cannot hold: a crash on a valid trace."""
    from kvtrace.replay.digest import Digest

    traces = {
        "scopes": [req("a", [1, 2], namespace=1), req("b", [1, 2], namespace=2), req("c", [1, 3], namespace=1)],
        "not chained": [req("a", [1, 5]), req("b", [2, 5]), req("c", [1, 5])],
    }
    for name, reqs in traces.items():
        digest = Digest()
        res = replay_cache_only(reqs, capacity_blocks=2, listeners=[digest])
        assert len(digest.hexdigest()) == 64 and res.requests == 3, name


def test_an_unbounded_cache_evicts_nothing_and_is_sized_to_the_trace():
    """No capacity (or inf): the infinite-cache hit rate, through the real manager."""
    import math

    reqs = list(open_trace(MOONCAKE))
    keys = block_keys(reqs)
    total = sum(map(len, keys))
    want, publishes, evictions, _ = lru_reference(keys, total + 1)  # room for every block ever seen
    assert evictions == 0
    for kw in ({}, {"capacity_blocks": math.inf}):
        res = replay_cache_only(reqs, **kw)
        assert res.per_request_hit_blocks == want
        assert (res.evictions, res.publishes, res.oversized, res.capacity_blocks) == (0, publishes, 0, None)
    # an infinite cache is every policy's bound: Belady finds the same hits
    assert replay_cache_only(reqs, policy="belady").per_request_hit_blocks == want
    # the pool the manager built holds the distinct blocks, not a preallocated huge number
    from kvtrace.replay.cache_only import _unbounded_capacity

    assert _unbounded_capacity(keys) < total // 2


def test_the_collector_is_paused_over_the_replay_and_restored_after():
    """The request loop runs without cyclic collection (process.collector_paused); the
    collector is as the caller had it afterwards, also when the caller had it off."""
    import gc

    reqs = list(open_trace(MOONCAKE))[:50]
    seen: list[bool] = []
    assert gc.isenabled()
    replay_cache_only(reqs, capacity_blocks=300, listeners=[lambda events: seen.append(gc.isenabled())])
    assert len(seen) == 50 and not any(seen)
    assert gc.isenabled()
    gc.disable()
    try:
        replay_cache_only(reqs, capacity_blocks=300)
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("policy", ["lru", "belady"])
def test_a_recorded_cache_only_run_reads_back_its_summarys_hit_counters(tmp_path, policy):
    """A Belady run recorded no spans: the dashboard's read API said 0 requests and no hit
    rate, where replay, runs and diff said 40 and 42.6%."""
    from kvtrace.metrics import COUNTER_KEYS
    from kvtrace.replay.run import RunSpec, run_replay
    from kvtrace.store import read

    db = tmp_path / "s.duckdb"
    res = run_replay(RunSpec("gen:chat", limit=40, mode="cache-only", policy=policy, capacity_blocks=100,
                             block_size=16), db=db)
    got = read.hit_counters(db, res.run_id)
    assert got["requests"] == res.summary["requests"] == 40
    for key in (*COUNTER_KEYS, "prefix_cache_hit_rate"):
        assert got[key] == res.summary[key], key


def test_an_unbounded_cache_past_kvtraces_pool_names_the_flag_and_the_way_out(tmp_path, capsys):
    """More distinct blocks than a pool holds, unbounded: the error named CacheConfig's own
    field ('CacheConfig: num_gpu_blocks: 6,300,003 blocks is beyond ...'), nothing typed."""
    from tests.cli.support import assert_one_line, run

    n = 2_100_000
    trace = tmp_path / "m.jsonl"
    with open(trace, "w") as f:
        for i in range(2):
            ids = ",".join(map(str, range(i * n, (i + 1) * n)))
            f.write(f'{{"timestamp":{i},"input_length":{n},"output_length":1,"hash_ids":[{ids}]}}\n')
    code, _, err = run(["replay", str(trace), "--mode", "cache-only", "--trace-block-size", "1"], capsys)
    assert_one_line(code, err, "--capacity-blocks: inf: the unbounded cache would hold 6,300,001 blocks",
                    "replay fewer requests (--limit)")


def test_one_token_blocks_hold_the_capacity_given():
    # At --block-size 1 the extra token each request is presented with filled a block of its
    # own and was published: 50 distinct ids then the same 50 again hit nothing in an
    # unbounded cache (147 evictions), and capacity 3 lost D's hit that any LRU of 3 keeps.
    reqs = [TraceRequest(f"r{i}", i, 1, 1, hash_ids=(i % 50,), hash_block_size=1) for i in range(100)]
    unbounded = replay_cache_only(reqs, block_size=1)
    assert (unbounded.hit_tokens, unbounded.evictions, unbounded.publishes) == (50, 0, 50)
    abcd = [TraceRequest(r, i, 1, 1, hash_ids=(k,), hash_block_size=1)
            for i, (r, k) in enumerate([("A", 0), ("B", 1), ("C", 2), ("D", 0)])]
    run = replay_cache_only(abcd, capacity_blocks=3, block_size=1)
    (point,) = capacity_curve(abcd, [3], policies=("lru",), block_size=1)
    assert run.per_request_hit_blocks == [0, 0, 0, 1] and (run.publishes, run.evictions) == (3, 0)
    assert point.hit_blocks == run.hit_blocks
    # one past the capacity evicts the least recently used, as at any block size
    run = replay_cache_only(abcd, capacity_blocks=2, block_size=1)
    assert run.per_request_hit_blocks == [0, 0, 0, 0] and run.evictions == 2


@pytest.mark.parametrize("seed", range(3))
def test_one_token_blocks_equal_the_bare_reference(seed):
    reqs = [req(r.request_id, r.hash_ids, bs=1) for r in random_trace(seed, 60)]
    keys = chain_keys(reqs)[0]
    for cap in (3, 10, 40):
        res = replay_cache_only(reqs, capacity_blocks=cap, block_size=1)
        ref_hits, ref_pub, ref_ev, _ = lru_reference(keys, cap)
        assert res.per_request_hit_blocks == ref_hits and (res.publishes, res.evictions) == (ref_pub, ref_ev), cap


def test_belady_after_an_oversized_request_still_bounds_lru():
    # an oversized request hit a cached block and left its heap entry naming itself as the
    # block's next use: MIN evicted a block needed sooner, 1 hit where LRU got 2
    r = [req(str(i), ids, bs=1) for i, ids in enumerate([[0], [0, 0, 0], [1], [2], [1]])]
    keys = chain_keys(r)[0]
    lru, opt = sum(lru_reference(keys, 2)[0]), sum(belady_hits(keys, 2)[0])
    assert (lru, opt) == (2, 2)
    for seed in range(20):  # and on random traces whose requests outgrow a small cache
        keys = chain_keys(random_trace(seed, 40))[0]
        for cap in (3, 5, 8):
            assert sum(belady_hits(keys, cap)[0]) >= sum(lru_reference(keys, cap)[0]), (seed, cap)


@pytest.mark.parametrize(("kw", "says"), [
    ({"capacity_tokens": True}, "capacity_tokens: expected an int >= 1 tokens, got True"),
    ({"capacity_tokens": 0}, "capacity_tokens: expected an int >= 1 tokens, got 0"),  # (blamed capacity_blocks)
    ({"capacity_tokens": 1.5}, "capacity_tokens: expected an int >= 1 tokens, got 1.5"),  # (a TypeError)
    ({"capacity_tokens": "16"}, "capacity_tokens: expected an int >= 1 tokens, got '16'"),
    ({"capacity_blocks": True}, "capacity_blocks: expected an int >= 1 blocks, got True"),  # (ran 1 block)
    ({"capacity_blocks": 2.5}, "capacity_blocks: expected an int >= 1 blocks, got 2.5"),
])
def test_a_capacity_that_is_no_count_is_refused_naming_it(kw, says):
    with pytest.raises(ConfigError, match=re.escape(f"cache-only: {says}")):
        replay_cache_only([req("a", [1])], **kw)


@pytest.mark.parametrize("capacities", [[True], [1.5], ["3"], [0]])
def test_a_curve_capacity_that_is_no_count_is_refused(capacities):
    with pytest.raises(ConfigError, match=re.escape("--capacities: ") + ".*expected block counts >= 1"):
        capacity_curve([req("a", [1])], capacities)


def test_numpy_counts_are_counts():
    # (a numpy int is a count to a caller; the curve said "expected block counts >= 1" of 2 and 4)
    import numpy as np

    r = [req("a", [1, 2]), req("b", [1, 2])]
    assert replay_cache_only(r, capacity_blocks=np.int64(4)).capacity_blocks == 4
    assert [p.capacity_blocks for p in capacity_curve(r, [np.int64(2), np.int64(4)], policies=("lru",))] == [2, 4]


def test_belady_keeps_no_block_for_a_request_the_cache_cannot_hold():
    # the next use of 4 was the oversized [4, 7, 8, 9], which reads the cache and never fills
    # it: MIN kept 4 for it and evicted 3, which [3, 10, 11] and [3] needed (3 hits, LRU 4)
    r = [req(str(i), ids, bs=1) for i, ids in enumerate([[1, 2], [3], [4], [4], [1, 5, 6], [4, 7, 8, 9],
                                                           [3, 10, 11], [3]])]
    keys = chain_keys(r)[0]
    assert sum(belady_hits(keys, 2)[0]) >= sum(lru_reference(keys, 2)[0]) == 4
