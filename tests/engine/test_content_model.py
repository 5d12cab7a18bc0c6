"""The exact content model: closed-form chunks equal the per-token recurrence, for any chunking.

Every test runs on both array paths (kvtrace.engine.arrays): numpy, the CPU's, and torch,
a GPU's, here on the CPU.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtrace.cache import CacheConfig, FullAttentionSpec, MambaSpec
from kvtrace.engine.arrays import TORCH_CPU, Arrays
from kvtrace.engine.content import ContentModel, P, kv_sum_closed_form, kv_values, lane_multipliers
from kvtrace.engine.storage import DeviceStorage
from kvtrace.workload.lines import VOCAB_SIZE


@pytest.fixture(params=["cpu", TORCH_CPU])
def xp(request) -> Arrays:
    return Arrays(request.param)


def naive_state(tokens, lanes=4):
    s = [0] * lanes
    for t in tokens:
        s = [(m * x + int(t)) % P for m, x in zip(lane_multipliers(lanes), s)]
    return s


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    tokens=st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=300),
    cuts=st.lists(st.integers(1, 299), max_size=6),
)
def test_any_chunking_gives_the_per_token_state(xp, tokens, cuts):
    model = ContentModel(4, xp)
    tok = xp.ints(tokens)
    bounds = sorted({c for c in cuts if c < len(tokens)} | {len(tokens)})
    state = xp.zeros((1, 4))
    start = 0
    for end in bounds:  # one segment per chunk, each from the previous chunk's state
        state = model.advance(
            state, tok[start:end], xp.arange(start, end), xp.ints([0]), xp.ints([start]), xp.ints([0]), xp.ints([end]),
        )
        start = end
    assert state[0].tolist() == naive_state(tokens)


def test_batched_segments_and_mid_chunk_queries_match_naive(xp):
    rng = np.random.default_rng(7)
    model = ContentModel(4, xp)
    a = rng.integers(0, VOCAB_SIZE, 50)
    b = rng.integers(0, VOCAB_SIZE, 70)
    # a: positions [0, 50) from zero; b: positions [30, 100) from the naive state at 30
    s_b0 = naive_state(b[:0])  # placeholder, recomputed below
    full_b = np.concatenate([rng.integers(0, VOCAB_SIZE, 30), b])
    s_b0 = naive_state(full_b[:30])
    out = model.advance(
        xp.ints([[0] * 4, s_b0]),
        xp.from_host(np.concatenate([a, b])),
        xp.ints(list(range(50)) + list(range(30, 100))),
        xp.ints([0, 50]), xp.ints([0, 30]),
        xp.ints([0, 1, 0, 1]), xp.ints([50, 100, 17, 64]),
    )
    assert out[0].tolist() == naive_state(a)
    assert out[1].tolist() == naive_state(full_b)
    assert out[2].tolist() == naive_state(a[:17])
    assert out[3].tolist() == naive_state(full_b[:64])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    segments=st.lists(st.tuples(st.integers(0, 40_000), st.integers(1, 20_000)), min_size=1, max_size=3),
    mids=st.lists(st.floats(0.01, 1.0), max_size=3),
    seed=st.integers(0, 2**32 - 1),
)
def test_advance_by_dot_products_is_the_running_sums(xp, segments, mids, seed):
    """With each segment's range known (the worker's steps), the host takes one dot product per
    query (``_advance_by_dot``); without, the running sum over all the terms: the same states,
    for chunks longer than one unreduced matmul (2^13 terms) too, and queries inside them."""
    rng = np.random.default_rng(seed)
    model = ContentModel(4, xp)
    lens = [n for _, n in segments]
    starts = [a for a, _ in segments]
    tokens = xp.from_host(rng.integers(0, VOCAB_SIZE, sum(lens)))
    positions = xp.from_host(np.concatenate([np.arange(a, a + n) for a, n in segments]))
    offsets = np.concatenate([[0], np.cumsum(lens)[:-1]])
    q_seg = list(range(len(segments))) + [k % len(segments) for k in range(len(mids))]
    q_end = [a + n for a, n in segments]
    q_end += [starts[s] + max(1, int(f * lens[s])) for s, f in zip(q_seg[len(segments):], mids)]
    states = xp.from_host(rng.integers(0, P, (len(segments), 4)))
    args = (states, tokens, positions, xp.from_host(offsets), xp.ints(starts), xp.ints(q_seg), xp.ints(q_end))
    by_dot = model.advance(*args, max_end=max(q_end), ranges=[(a, a + n) for a, n in segments])
    by_sums = model.advance(*args)
    assert by_dot.tolist() == by_sums.tolist()


def test_kv_values_and_closed_form_sum_agree_and_never_overflow(xp):
    tok = xp.ints([VOCAB_SIZE - 1] * 1000)
    pos = xp.arange(2**30, 2**30 + 1000)
    kv = kv_values(tok, pos)
    assert int(kv.min()) >= 0 and int(kv.max()) < P
    assert int(kv.sum()) % P == kv_sum_closed_form(int(tok.sum()), 2**30, 2**30 + 1000)


def test_power_tables_grow_consistently(xp):
    model = ContentModel(3, xp)
    model.ensure(10_000)
    m = lane_multipliers(3)
    for k in (0, 1, 4095, 4096, 9999):
        assert model.pow[k].tolist() == [pow(x, k, P) for x in m]
        assert ((model.pow[k] * model.inv_pow[k]) % P).tolist() == [1, 1, 1]


def test_storage_copies_and_block_sums_follow_content(xp):
    cc = CacheConfig(groups=(FullAttentionSpec(4), MambaSpec(4, num_lanes=2)), num_gpu_blocks=8, hash_block_size=4)
    st_ = DeviceStorage(cc, xp.name)
    vals = xp.ints([5, 6, 7, 8, 9])
    st_.write_kv(0, xp.ints([1, 1, 1, 1, 2]), xp.ints([0, 1, 2, 3, 0]), vals)
    assert st_.block_sums(0, xp.ints([1, 2])).tolist() == [26, 9]
    st_.write_states(1, xp.ints([3]), xp.ints([[11, 12]]))
    # chained copies run in order: 1->4 then 4->5 copies the original block 1
    n = st_.copy_blocks([(0, 1, 4, "r", "x"), (0, 4, 5, "r", "x"), (1, 3, 6, "r", "x")])
    assert n == 3
    assert st_.read_kv(0, xp.ints([5]))[0].tolist() == [5, 6, 7, 8]
    assert st_.block_sums(0, xp.ints([5])).tolist() == [26]
    assert st_.read_states(1, xp.ints([6])).tolist() == [[11, 12]]
    assert st_.fingerprints(0, [1], [4]) == st_.fingerprints(0, [5], [4])
    assert st_.fingerprints(0, [1], [2]) != st_.fingerprints(0, [1], [4])


def test_expected_fingerprints_match_storage_fingerprints(xp):
    from kvtrace.engine.reference import expected_kv_fingerprint, expected_state_fingerprint

    cc = CacheConfig(groups=(FullAttentionSpec(16), MambaSpec(16, num_lanes=4)), num_gpu_blocks=4, hash_block_size=16)
    st_ = DeviceStorage(cc, xp.name)
    rng = np.random.default_rng(5)
    tok = rng.integers(0, VOCAB_SIZE, 11)
    pos = xp.arange(4000, 4011)
    st_.write_kv(0, xp.full(11, 2), xp.arange(11), kv_values(xp.from_host(tok), pos))
    assert st_.fingerprints(0, [2], [11]) == [expected_kv_fingerprint(tok, 4000, 4011, 16)]
    assert st_.fingerprints(0, [2], [10]) == [expected_kv_fingerprint(tok[:10], 4000, 4010, 16)]
    assert st_.fingerprints(0, [2], [11]) != [expected_kv_fingerprint(tok[::-1].copy(), 4000, 4011, 16)]
    state = (5, P - 1, 77, 123456)
    st_.write_states(1, xp.ints([3]), xp.ints([state]))
    assert st_.fingerprints(1, [3]) == [expected_state_fingerprint(state)]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["append", "write", "copy"]), st.integers(0, 2**31 - 2),
                              st.integers(0, 7), st.integers(0, 7)), min_size=1, max_size=60))
def test_append_kv_prefix_sums_are_the_slots_whatever_wrote_them(xp, ops):
    """The decode write remembers each block's prefix sum; any other write or copy in
    between must make it read the slots again, and block sums must stay exact."""
    bs = 4
    cc = CacheConfig(groups=(FullAttentionSpec(bs),), num_gpu_blocks=8, hash_block_size=4)
    st_ = DeviceStorage(cc, xp.name)
    fill = [0] * 8  # the next slot the decode writer appends to, per block
    for kind, value, a, b in ops:
        v = xp.ints([value % P])
        if kind == "append":
            blocks = sorted({a, b})  # distinct, as append_kv requires
            slots = [fill[x] for x in blocks]
            vals = xp.ints([(value + k) % P for k in range(len(blocks))])
            got = st_.append_kv(0, xp.ints(blocks), xp.ints(slots), vals)
            data = st_.data[0]
            assert got.tolist() == [int(data[x, : s + 1].sum()) % P for x, s in zip(blocks, slots)]
            for x in blocks:
                fill[x] = (fill[x] + 1) % bs
        elif kind == "write":  # another writer, anywhere in block a
            st_.write_kv(0, xp.ints([a]), xp.ints([b % bs]), v)
        else:
            st_.copy_blocks([(0, a, b, "r", "x")])
        sums = st_.block_sums(0, xp.arange(8)).tolist()
        assert sums == [int(r.sum()) % P for r in st_.data[0]]
