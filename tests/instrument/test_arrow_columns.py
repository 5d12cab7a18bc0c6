"""Hash columns: bytes and int hashes render as documented, vectorised or not; int lists."""

from __future__ import annotations

import msgspec
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtrace.instrument.arrow_columns import hash_hex, hex_lists, hex_strings, int_lists, optional_hex
from kvtrace.instrument.vllm import decode_kv_batch


def test_int_hashes_render_like_vllm_int_hashes():
    ints = [0, 5, 2**63 - 1, -1, 2**64 - 1]
    got = hex_strings(ints).to_pylist()
    assert got == ["0000000000000000", "0000000000000005", "7fffffffffffffff", "ffffffffffffffff",
                   "ffffffffffffffff"]
    assert got == [hash_hex(i) for i in ints]  # the vectorised path agrees with the scalar one
    # the vLLM capture renders its int hashes the same way
    stored = msgspec.msgpack.encode([0.0, [["BlockStored", ints, None, [], 16, None]]])
    assert decode_kv_batch(stored)[0].events[0].block_hashes == got


def test_wide_int_keys_keep_their_scope_and_sign():
    scoped = 3 * 2**64 + 10
    interned = -(2**64) - 7
    assert hex_strings([scoped, 1]).to_pylist() == ["3000000000000000a", "0000000000000001"]
    assert optional_hex([None, interned]).to_pylist() == [None, "-10000000000000007"]


def test_bytes_hashes_of_mixed_width_and_lists():
    assert hex_strings([b"\x01\xff", b"\x00"]).to_pylist() == ["01ff", "00"]
    assert hex_lists([(b"\xab",), (), (1, 2)]).to_pylist() == [["ab"], [], ["0000000000000001", "0000000000000002"]]


@given(st.lists(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=6).map(tuple), max_size=40))
def test_int_lists_hold_every_int64_tuple_as_pyarrow_would(lists):
    got = int_lists(lists)
    assert got.type == pa.list_(pa.int64())
    assert got.equals(pa.array(lists, pa.list_(pa.int64())))


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 2**64])
def test_an_int_list_value_beyond_int64_is_an_overflow(value):
    with pytest.raises(OverflowError):
        int_lists([(1, 2), (value,)])
