"""The decode step's C loops (kvtrace/engine/_decode.pyx) are its numpy path, faster.

Every workload of the fast-path tests runs twice, once with the compiled kernels and once
with the worker's numpy path, and must give the same events, summary and request records;
the kernels' edge cases (two requests naming one block, a prefix sum the storage no longer
holds, a request off its reference tip) are checked against numpy directly.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvtrace import compiled
from kvtrace.cache import CacheConfig, FullAttentionSpec, MambaSpec
from kvtrace.engine import Worker
from kvtrace.engine import worker as worker_module
from kvtrace.engine.content import P, kv_values
from kvtrace.engine.memory import DEVICE_ENV
from kvtrace.engine.storage import DeviceStorage, first_sums
from tests.engine.test_decode_fast_path import _cases, _run

KERNELS = compiled.kernels(worker_module.DECODE_KERNELS)


def test_the_install_compiled_the_kernels():
    """``make install`` builds them (setup.py, Cython); this fails when it did not."""
    assert KERNELS is not None, compiled.kernels_mode()
    assert compiled.kernels_mode() == "compiled (Cython)"


@pytest.mark.parametrize("name,engine_preset,work", list(_cases()), ids=lambda v: v if isinstance(v, str) else "")
def test_kernels_and_numpy_give_the_same_events_and_outputs(name, engine_preset, work, monkeypatch):
    # the kernels are the numpy (cpu) path's: on it whatever device $KVTRACE_DEVICE names for
    # the rest of the suite (bench/gpu_check.sh runs it with cuda and torch:cpu too)
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    taken = [0]
    real = Worker._decode_write_kernels

    def counted(self, *args):
        taken[0] += 1
        return real(self, *args)

    prefills = [0]
    real_prefill = DeviceStorage.prefill_kv_rows

    def counted_prefill(self, *args):
        prefills[0] += 1
        return real_prefill(self, *args)

    monkeypatch.setattr(Worker, "_decode_write_kernels", counted)
    monkeypatch.setattr(DeviceStorage, "prefill_kv_rows", counted_prefill)
    fast = _run(engine_preset, work, True, monkeypatch)
    if name != "attention-swa-mamba":  # a sliding window: the worker's general path only
        assert taken[0] > 0, "the workload never took the kernels"
    assert prefills[0] > 0, "no prefill chunk took the kernel"
    monkeypatch.setattr(worker_module, "kernels", lambda module: None)
    numpy_run = _run(engine_preset, work, True, monkeypatch)
    assert fast[0] == numpy_run[0]
    assert fast[1] == numpy_run[1]
    assert fast[2] == numpy_run[2]


def _storage():
    cc = CacheConfig(groups=(FullAttentionSpec(8), MambaSpec(8)), num_gpu_blocks=32, hash_block_size=8)
    storage = DeviceStorage(cc, "cpu")
    rng = np.random.default_rng(7)
    storage.data[0][:] = rng.integers(0, P, size=storage.data[0].shape)
    storage.block_sum[0][:] = storage.data[0].sum(1) % P
    storage.data[1][:] = rng.integers(0, P, size=storage.data[1].shape)
    return storage


def _append_both(a: DeviceStorage, b: DeviceStorage, table, rows, pos, toks) -> None:
    """The kernel's append into ``a`` and numpy's into ``b``: the same sums and storage."""
    total = np.zeros(rows.shape[0], dtype=np.int64)
    assert a.append_kv_rows(KERNELS, 0, table, rows, pos, toks, total)
    q = pos // 8
    want = b.append_kv(0, table[rows, q], pos - q * 8, kv_values(toks, pos))
    assert total.tolist() == want.tolist()
    for x, y in ((a.data[0], b.data[0]), (a.block_sum[0], b.block_sum[0]), (a.stamp[0], b.stamp[0]),
                 *zip(a._prefix[0], b._prefix[0])):
        assert np.array_equal(x, y)


def test_attention_append_matches_numpy_and_refuses_a_shared_block():
    table = np.array([[3, 4, 5, 0], [6, 7, 0, 0], [9, 10, 11, 12]], dtype=np.int64)
    rows = np.array([0, 1, 2], dtype=np.int64)
    toks = np.array([5, 262_143, 0], dtype=np.int64)
    for step in range(3):  # the second and third steps use the remembered prefix sums
        pos = np.array([17, 9, 26], dtype=np.int64)  # (four steps stay inside each table)
        a, b = _storage(), _storage()
        for _ in range(step + 1):
            _append_both(a, b, table, rows, pos, toks)
            pos = pos + 1
        # a copy into a block restamps it: the kernel reads that block's slots back
        a.copy_blocks([(0, 20, 4)])
        b.copy_blocks([(0, 20, 4)])
        _append_both(a, b, table, rows, pos, toks)

    shared = np.array([[3, 4], [6, 4]], dtype=np.int64)  # both rows' block 1 is block 4
    s = _storage()
    before = [s.data[0].copy(), s.block_sum[0].copy(), s.stamp[0].copy(), s._last_stamp]
    total = np.zeros(2, dtype=np.int64)
    ok = s.append_kv_rows(KERNELS, 0, shared, np.array([0, 1]), np.array([8, 9]), np.array([1, 2]), total)
    assert not ok
    assert np.array_equal(s.data[0], before[0]) and np.array_equal(s.block_sum[0], before[1])
    assert np.array_equal(s.stamp[0], before[2]) and s._last_stamp == before[3] and not total.any()


def test_an_index_outside_a_table_or_the_storage_is_an_index_error():
    """numpy raises IndexError there; the unchecked loops must too, never read past an array."""
    s = _storage()
    table = np.array([[3, 4], [6, 99]], dtype=np.int64)  # 99: no such block
    one = np.zeros(1, dtype=np.int64)
    with pytest.raises(IndexError):
        s.append_kv_rows(KERNELS, 0, table, np.array([0]), np.array([16]), one, one.copy())  # column 2
    with pytest.raises(IndexError):
        s.append_kv_rows(KERNELS, 0, table, np.array([2]), np.array([0]), one, one.copy())  # row 2
    with pytest.raises(IndexError):
        s.append_kv_rows(KERNELS, 0, table, np.array([1]), np.array([8]), one, one.copy())  # block 99
    with pytest.raises(IndexError):
        KERNELS.full_block_sums(s.block_sum[0], table, 8, np.array([1]), np.array([16]), one.copy())
    with pytest.raises(IndexError):
        KERNELS.state_step(s.data[1], table, 8, np.ones(4, dtype=np.int64), np.array([1]), np.array([9]), one,
                           one.copy())


def test_state_step_and_full_block_sums_match_numpy():
    s = _storage()
    table = np.array([[3, 4, 5], [6, 7, 8]], dtype=np.int64)
    rows = np.array([1, 0], dtype=np.int64)
    pos = np.array([16, 13], dtype=np.int64)  # at a block's start (state moves to a new block), inside one
    toks = np.array([11, 262_143], dtype=np.int64)
    m = np.array([48_271, 69_621, 16_807, 39_373], dtype=np.int64)
    src = table[rows, (pos + 7) // 8 - 1]
    dst = table[rows, pos // 8]
    want_states = (s.data[1][src] * m + toks[:, None]) % P
    total = np.zeros(2, dtype=np.int64)
    KERNELS.state_step(s.data[1], table, 8, m, rows, pos, toks, total)
    assert np.array_equal(s.data[1][dst], want_states)
    assert total.tolist() == want_states.sum(1).tolist()

    total = np.zeros(2, dtype=np.int64)
    KERNELS.full_block_sums(s.block_sum[0], table, 8, rows, pos, total)
    w = int((pos // 8).max())
    want = first_sums(s.arrays, s.block_sum[0][table[:, :w][rows]], pos // 8)
    assert total.tolist() == want.tolist()


def test_advance_tips_marks_requests_off_their_tip():
    tip_state = np.array([[1, 2], [3, 4], [5, 6]], dtype=np.int64)
    tip_tsum = np.array([10, 20, 30], dtype=np.int64)
    tip_n = np.array([7, -1, 9], dtype=np.int64)
    m = np.array([48_271, 69_621], dtype=np.int64)
    rows = np.array([0, 1, 2], dtype=np.int64)
    pos = np.array([7, 4, 9], dtype=np.int64)
    toks = np.array([3, 4, 5], dtype=np.int64)
    total = np.array([P + 5, 2 * P + 262_200, 17], dtype=np.int64)
    out, ref = np.empty(3, dtype=np.int64), np.empty(3, dtype=np.int64)
    KERNELS.advance_tips(tip_state, tip_tsum, tip_n, m, 1, 1, 262_144, rows, pos, toks, total, out, ref)
    assert out.tolist() == (total % P % 262_144).tolist()
    assert ref[1] == -1 and tip_n.tolist() == [8, -1, 10]
    assert tip_state[1].tolist() == [3, 4] and tip_tsum[1] == 20  # off its tip: untouched
    for i in (0, 2):
        st = [(s0 * mk + int(toks[i])) % P for s0, mk in zip([[1, 2], [3, 4], [5, 6]][i], m.tolist())]
        assert tip_state[i].tolist() == st
        e, ts = int(pos[i]) + 1, [10, 20, 30][i] + int(toks[i])
        kv = (1_103_515_245 * (ts % P) + 12_345_679 * ((e - 1) * e // 2 % P) + (2_654_435_761 % P) * e) % P
        assert ref[i] == (sum(st) % P + kv) % P % 262_144


def test_attention_prefill_matches_the_numpy_write_and_checks_its_input():
    """Chunks across block edges, partial first and last blocks, a chunk of one token and
    one of none: the same slots, block sums and stamps as ``write_kv``."""
    rng = np.random.default_rng(11)
    table = np.array([[3, 4, 5, 0], [6, 7, 0, 0], [9, 10, 11, 12], [13, 0, 0, 0]], dtype=np.int64)
    rows = np.array([0, 1, 2, 3], dtype=np.int64)
    starts = np.array([5, 8, 1, 7], dtype=np.int64)
    lens = np.array([14, 1, 30, 0], dtype=np.int64)
    toks = rng.integers(0, 1 << 17, int(lens.sum())).astype(np.int64)
    a, b = _storage(), _storage()
    a.prefill_kv_rows(KERNELS, 0, table, rows, starts, lens, toks)
    pos = np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in zip(starts, lens)])
    blocks = np.concatenate([table[r, pos_r // 8] for r, pos_r in
                             zip(rows, np.split(pos, np.cumsum(lens)[:-1]))])
    touched = np.unique(blocks)
    b.write_kv(0, blocks, pos % 8, kv_values(toks, pos), touched)
    for x, y in ((a.data[0], b.data[0]), (a.block_sum[0], b.block_sum[0]), (a.stamp[0], b.stamp[0])):
        assert np.array_equal(x, y)
    assert a._last_stamp == b._last_stamp
    with pytest.raises(ValueError, match="31 chunk tokens, 30 given"):
        a.prefill_kv_rows(KERNELS, 0, table, rows[:3], starts[:3], np.array([14, 1, 16]), toks[:30])
    before = a.data[0].copy()
    with pytest.raises(IndexError, match="out of bounds"):  # past the table's width: nothing written
        a.prefill_kv_rows(KERNELS, 0, table, rows[1:2], np.array([30]), np.array([3]), toks[:3])
    assert np.array_equal(a.data[0], before)
