"""The fast paths of the audit and the reference equal the plain formulas they replace:
fingerprints folded without a per-term reduction, the floor-division reduction, the
in-place token synthesis and the table-backed trace block memo.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtrace import compiled
from kvtrace.engine.arrays import TORCH_CPU, Arrays
from kvtrace.engine.content import FINGERPRINT_BASE, ContentModel, P, fingerprint_rows, reduce_inplace
from kvtrace.engine.reference import (
    PrefixOracle,
    TraceBlockMemo,
    modular_matmul,
)
from kvtrace.engine.request import EngineRequest
from kvtrace.workload import TraceRequest, tokens
from kvtrace.workload.lines import VOCAB_SIZE
from kvtrace.workload.tokens import block_tokens, blocks_tokens, tokens_for_block_ids

MASK64 = (1 << 64) - 1


@pytest.fixture(params=["cpu", TORCH_CPU])
def xp(request) -> Arrays:
    return Arrays(request.param)


def plain_fingerprints(values: np.ndarray, num_valid: np.ndarray | None) -> list[int]:
    """The formula as first written: every term reduced, then summed (Python ints)."""
    out = []
    for k, row in enumerate(values.tolist()):
        n = len(row) if num_valid is None else int(num_valid[k])
        out.append(sum(v * pow(FINGERPRINT_BASE, i, P) % P for i, v in enumerate(row[:n])) % P)
    return out


residues = st.one_of(st.integers(0, P - 1), st.sampled_from([0, 1, P - 2, P - 1]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), width=st.one_of(st.integers(1, 40), st.integers(1, 1024)), num_rows=st.integers(1, 6))
def test_fingerprints_equal_the_plain_formula(xp, data, width, num_rows):
    fill = data.draw(st.sampled_from(["random", "max", "mixed"]))
    if fill == "max":
        values = np.full((num_rows, width), P - 1, dtype=np.int64)
    else:
        values = np.array(data.draw(st.lists(st.lists(residues, min_size=width, max_size=width),
                                             min_size=num_rows, max_size=num_rows)), dtype=np.int64)
        if fill == "mixed":
            values[:, ::2] = P - 1
    num_valid = data.draw(st.none() | st.lists(st.integers(0, width + 1), min_size=num_rows, max_size=num_rows))
    nv = None if num_valid is None else np.array(num_valid, dtype=np.int64)
    want = plain_fingerprints(values, nv)
    got = fingerprint_rows(xp, xp.from_host(values), None if nv is None else xp.from_host(nv))
    assert xp.host(got).tolist() == want
    # folding picked rows of a table: few (gathered) or most (the whole table folded)
    picks = data.draw(st.lists(st.integers(0, num_rows - 1), min_size=1, max_size=2 * num_rows))
    rows = np.array(picks, dtype=np.int64)
    sub_nv = None if nv is None else nv[rows]
    got = fingerprint_rows(xp, xp.from_host(values), None if sub_nv is None else xp.from_host(sub_nv),
                           rows=xp.from_host(rows))
    assert xp.host(got).tolist() == plain_fingerprints(values[rows], sub_nv)


def test_fingerprints_wider_than_one_unreduced_fold(xp):
    values = np.random.default_rng(5).integers(0, P, (2, 40_000))
    values[0] = P - 1
    assert xp.host(fingerprint_rows(xp, xp.from_host(values))).tolist() == plain_fingerprints(values, None)


def test_reduce_inplace_is_floor_mod(xp):
    x = np.random.default_rng(1).integers(-(2**63), 2**63 - 1, 1000, dtype=np.int64)
    x[:4] = [-(2**63), 2**63 - 1, -1, P]
    assert xp.host(reduce_inplace(xp.from_host(x.copy()))).tolist() == (x % P).tolist()


def splitmix_token(block_id: int, j: int, namespace: int) -> int:
    """Token j of a block id, in Python ints (the definition ``blocks_tokens`` vectorises)."""
    z = (namespace * 0x1F123BB5 + block_id * 0x5851F42D4C957F2D + j + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return (z ^ (z >> 31)) % VOCAB_SIZE


@settings(max_examples=40, deadline=None)
@given(ids=st.lists(st.integers(-(2**63), 2**64 - 1), max_size=4), block_size=st.integers(1, 70),
       namespace=st.integers(0, 2**40))
def test_block_tokens_follow_their_definition(ids, block_size, namespace):
    """The C pass (``_tokens.pyx``, what ``blocks_tokens`` runs when compiled) and the numpy
    one both give the definition's tokens."""
    got = blocks_tokens(ids, block_size, namespace)
    assert got.dtype == np.int64 and got.shape == (len(ids), block_size)
    want = [[splitmix_token(b, j, namespace) for j in range(block_size)] for b in ids]
    assert got.tolist() == want
    assert tokens.blocks_tokens_numpy(tokens._seeds(ids, namespace), block_size).tolist() == want
    if ids:
        assert block_tokens(ids[0], block_size, namespace).tolist() == got[0].tolist()



@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 2**63 - 1), max_size=5), block_size=st.integers(1, 40),
       input_length=st.integers(0, 220), namespace=st.integers(0, 2**40))
def test_a_prompts_tokens_are_its_blocks_cut_to_its_length(ids, block_size, input_length, namespace):
    """Made block by block only as far as the prompt reaches (a 2^31-token block size once
    allocated 16 GiB for a 5-token prompt), the same tokens as whole blocks cut."""
    got = tokens_for_block_ids(tuple(ids), block_size, input_length, namespace)
    want = [splitmix_token(b, j, namespace) for b in ids for j in range(block_size)][:input_length]
    assert got.dtype == np.int64 and got.tolist() == want


def test_a_huge_block_size_makes_only_the_prompts_tokens():
    import tracemalloc

    tracemalloc.start()  # (numpy reports its buffers to tracemalloc)
    try:
        got = tokens_for_block_ids((7,), 2**31, 5)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got.tolist() == [splitmix_token(7, j, 0) for j in range(5)]
    assert peak < 1 << 20, peak

def test_the_install_compiled_the_token_kernel_and_it_checks_its_shapes():
    kernel = compiled.kernels(tokens.KERNELS)
    assert kernel is not None, compiled.kernels_mode()  # make install compiles it (Cython)
    seeds = np.arange(3, dtype=np.uint64)
    with pytest.raises(ValueError, match="3 seeds for 2 rows"):
        kernel.fill_blocks(seeds, np.empty((2, 4), dtype=np.int64), VOCAB_SIZE)
    out = np.empty((3, 0), dtype=np.int64)
    kernel.fill_blocks(seeds, out, VOCAB_SIZE)  # empty blocks: nothing written, nothing read
    assert blocks_tokens([], 8).shape == (0, 8)


def _request(i: int, hash_ids: tuple[int, ...], input_length: int, block_size: int) -> EngineRequest:
    return EngineRequest(TraceRequest(request_id=f"r{i}", arrival_ns=0, input_length=input_length, output_length=1,
                                      hash_ids=hash_ids, hash_block_size=block_size))


def test_trace_block_memo_gives_each_blocks_effect_however_small_its_cap():
    model = ContentModel(4, "cpu")
    bs = 16
    rng = np.random.default_rng(2)
    work = [tuple(int(i) for i in rng.integers(0, 12, int(rng.integers(1, 9)))) for _ in range(30)]
    for cap in (3, 8, 1 << 20):  # 3: most calls clear it; a request may hold more ids than the cap
        memo = TraceBlockMemo(model, max_entries=cap)
        widest = 0  # a call's distinct ids are all held at once, even past the cap
        for k, ids in enumerate(work):
            widest = max(widest, len(set(ids)))
            toks = blocks_tokens(ids, bs)
            want = np.concatenate([modular_matmul(toks, model.descending_powers(bs)), toks.sum(1)[:, None]], axis=1)
            given_tokens = toks.reshape(-1) if k % 2 else None
            assert memo.get_many(0, bs, ids, given_tokens).tolist() == want.tolist()
            assert memo.num_rows <= max(cap, widest)


def test_oracles_with_the_memo_match_the_tokens_alone():
    model = ContentModel(4, "cpu")
    memo = TraceBlockMemo(model, max_entries=5)
    bs = 32
    for k, ids in enumerate([(1, 2, 3), (1, 2, 4, 5), (7,), (1, 2, 3, 9, 1), (6, 6, 6)]):
        n = len(ids) * bs - k  # the last block cut short in all but the first
        fast = PrefixOracle(model, _request(k, ids, n, bs), memo)
        plain = PrefixOracle(model, _request(k, ids, n, bs))
        for e in range(0, n + 1, 8):
            assert fast.point(e) == plain.point(e), (ids, e)


@pytest.mark.parametrize("name", ["hybrid-all-on", "kimi-mooncake-preempting", "attention-partial-hits",
                                  "study-external-hit-running-cow-off"])
def test_the_audits_guessed_key_positions_are_the_indexed_ones(name, monkeypatch):
    """``on_published`` places a key by guessing (keys a block apart, the last standing for
    the event's tokens), checked against the request's hashes, before it asks the index:
    every expectation, and so every event, is the same with the guess off; both ways run."""
    from kvtrace.engine import Engine
    from kvtrace.engine.audit import StaleHashAuditor
    from kvtrace.replay.digest import Digest
    from tests.engine.test_decode_fast_path import _cases

    case = next(c for c in _cases() if c[0] == name)
    looked_up = [0]
    real = StaleHashAuditor._num_tokens_of

    def counted(self, request, block_hash):
        looked_up[0] += 1
        return real(self, request, block_hash)

    monkeypatch.setattr(StaleHashAuditor, "_num_tokens_of", counted)
    digests, lookups = [], []
    for guess in (True, False):
        monkeypatch.setattr(StaleHashAuditor, "guess_positions", guess)
        looked_up[0] = 0
        d = Digest()
        Engine(case[1], audit_interval=7).run(case[2], [d.on_step])
        digests.append(d.hexdigest())
        lookups.append(looked_up[0])
    assert digests[0] == digests[1]
    assert lookups[1] > lookups[0]  # the guess placed keys (and the index placed every key)
