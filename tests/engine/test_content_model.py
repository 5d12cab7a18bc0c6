"""The exact content model: closed-form chunks equal the per-token recurrence, for any chunking."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrace.cache import CacheConfig, FullAttentionSpec, MambaSpec
from kvtrace.engine.content import ContentModel, P, kv_sum_closed_form, kv_values, lane_multipliers
from kvtrace.engine.storage import DeviceStorage
from kvtrace.workload.tokens import VOCAB_SIZE


def naive_state(tokens, lanes=4):
    s = [0] * lanes
    for t in tokens:
        s = [(m * x + int(t)) % P for m, x in zip(lane_multipliers(lanes), s)]
    return s


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=300),
    cuts=st.lists(st.integers(1, 299), max_size=6),
)
def test_any_chunking_gives_the_per_token_state(tokens, cuts):
    model = ContentModel(4)
    tok = torch.tensor(tokens, dtype=torch.int64)
    bounds = sorted({c for c in cuts if c < len(tokens)} | {len(tokens)})
    state = torch.zeros((1, 4), dtype=torch.int64)
    start = 0
    for end in bounds:  # one segment per chunk, each from the previous chunk's state
        state = model.advance(
            state, tok[start:end], torch.arange(start, end), torch.tensor([0]), torch.tensor([start]),
            torch.tensor([0]), torch.tensor([end]),
        )
        start = end
    assert state[0].tolist() == naive_state(tokens)


def test_batched_segments_and_mid_chunk_queries_match_naive():
    rng = np.random.default_rng(7)
    model = ContentModel(4)
    a = rng.integers(0, VOCAB_SIZE, 50)
    b = rng.integers(0, VOCAB_SIZE, 70)
    # a: positions [0, 50) from zero; b: positions [30, 100) from the naive state at 30
    s_b0 = naive_state(b[:0])  # placeholder, recomputed below
    full_b = np.concatenate([rng.integers(0, VOCAB_SIZE, 30), b])
    s_b0 = naive_state(full_b[:30])
    out = model.advance(
        torch.tensor([[0] * 4, s_b0], dtype=torch.int64),
        torch.tensor(np.concatenate([a, b]), dtype=torch.int64),
        torch.tensor(list(range(50)) + list(range(30, 100))),
        torch.tensor([0, 50]), torch.tensor([0, 30]),
        torch.tensor([0, 1, 0, 1]), torch.tensor([50, 100, 17, 64]),
    )
    assert out[0].tolist() == naive_state(a)
    assert out[1].tolist() == naive_state(full_b)
    assert out[2].tolist() == naive_state(a[:17])
    assert out[3].tolist() == naive_state(full_b[:64])


def test_kv_values_and_closed_form_sum_agree_and_never_overflow():
    tok = torch.tensor([VOCAB_SIZE - 1] * 1000, dtype=torch.int64)
    pos = torch.arange(2**30, 2**30 + 1000, dtype=torch.int64)
    kv = kv_values(tok, pos)
    assert int(kv.min()) >= 0 and int(kv.max()) < P
    assert int(kv.sum()) % P == kv_sum_closed_form(int(tok.sum()), 2**30, 2**30 + 1000)


def test_power_tables_grow_consistently():
    model = ContentModel(3)
    model.ensure(10_000)
    m = lane_multipliers(3)
    for k in (0, 1, 4095, 4096, 9999):
        assert model.pow[k].tolist() == [pow(x, k, P) for x in m]
        assert ((model.pow[k] * model.inv_pow[k]) % P).tolist() == [1, 1, 1]


def test_storage_copies_and_block_sums_follow_content():
    cc = CacheConfig(groups=(FullAttentionSpec(4), MambaSpec(4, num_lanes=2)), num_gpu_blocks=8, hash_block_size=4)
    st_ = DeviceStorage(cc, "cpu")
    vals = torch.tensor([5, 6, 7, 8, 9], dtype=torch.int64)
    st_.write_kv(0, torch.tensor([1, 1, 1, 1, 2]), torch.tensor([0, 1, 2, 3, 0]), vals)
    assert st_.block_sums(0, torch.tensor([1, 2])).tolist() == [26, 9]
    st_.write_states(1, torch.tensor([3]), torch.tensor([[11, 12]]))
    # chained copies run in order: 1->4 then 4->5 copies the original block 1
    n = st_.copy_blocks([(0, 1, 4, "r", "x"), (0, 4, 5, "r", "x"), (1, 3, 6, "r", "x")])
    assert n == 3
    assert st_.read_kv(0, torch.tensor([5]))[0].tolist() == [5, 6, 7, 8]
    assert st_.block_sums(0, torch.tensor([5])).tolist() == [26]
    assert st_.read_states(1, torch.tensor([6])).tolist() == [[11, 12]]
    assert st_.fingerprints(0, [1], [4]) == st_.fingerprints(0, [5], [4])
    assert st_.fingerprints(0, [1], [2]) != st_.fingerprints(0, [1], [4])


def test_expected_fingerprints_match_storage_fingerprints():
    from kvtrace.engine.reference import expected_kv_fingerprint, expected_state_fingerprint

    cc = CacheConfig(groups=(FullAttentionSpec(16), MambaSpec(16, num_lanes=4)), num_gpu_blocks=4, hash_block_size=16)
    st_ = DeviceStorage(cc, "cpu")
    rng = np.random.default_rng(5)
    tok = rng.integers(0, VOCAB_SIZE, 11)
    pos = torch.arange(4000, 4011)
    st_.write_kv(0, torch.full((11,), 2), torch.arange(11), kv_values(torch.from_numpy(tok), pos))
    assert st_.fingerprints(0, [2], [11]) == [expected_kv_fingerprint(tok, 4000, 4011, 16)]
    assert st_.fingerprints(0, [2], [10]) == [expected_kv_fingerprint(tok[:10], 4000, 4010, 16)]
    assert st_.fingerprints(0, [2], [11]) != [expected_kv_fingerprint(tok[::-1].copy(), 4000, 4011, 16)]
    state = (5, P - 1, 77, 123456)
    st_.write_states(1, torch.tensor([3]), torch.tensor([state]))
    assert st_.fingerprints(1, [3]) == [expected_state_fingerprint(state)]


@settings(max_examples=30, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["append", "write", "copy"]), st.integers(0, 2**31 - 2),
                              st.integers(0, 7), st.integers(0, 7)), min_size=1, max_size=60))
def test_append_kv_prefix_sums_are_the_slots_whatever_wrote_them(ops):
    """The decode write remembers each block's prefix sum; any other write or copy in
    between must make it read the slots again, and block sums must stay exact."""
    bs = 4
    cc = CacheConfig(groups=(FullAttentionSpec(bs),), num_gpu_blocks=8, hash_block_size=4)
    st_ = DeviceStorage(cc, "cpu")
    fill = [0] * 8  # the next slot the decode writer appends to, per block
    for kind, value, a, b in ops:
        v = torch.tensor([value % P], dtype=torch.int64)
        if kind == "append":
            blocks = sorted({a, b})  # distinct, as append_kv requires
            slots = [fill[x] for x in blocks]
            vals = torch.tensor([(value + k) % P for k in range(len(blocks))], dtype=torch.int64)
            got = st_.append_kv(0, torch.tensor(blocks), torch.tensor(slots), vals)
            data = st_.data[0]
            assert got.tolist() == [int(data[x, : s + 1].sum()) % P for x, s in zip(blocks, slots)]
            for x in blocks:
                fill[x] = (fill[x] + 1) % bs
        elif kind == "write":  # another writer, anywhere in block a
            st_.write_kv(0, torch.tensor([a]), torch.tensor([b % bs]), v)
        else:
            st_.copy_blocks([(0, a, b, "r", "x")])
        sums = st_.block_sums(0, torch.arange(8)).tolist()
        assert sums == [int(r.sum()) % P for r in st_.data[0]]
