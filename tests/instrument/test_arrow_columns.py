"""Hash columns: bytes and int hashes render as documented, vectorised or not; int lists and their statistics."""

from __future__ import annotations

import msgspec
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtrace.instrument.arrow_columns import Ragged, hash_hex, hex_lists, hex_strings, int_lists, optional_hex
from kvtrace.instrument.vllm import decode_kv_batch
from kvtrace.numeric import percentile, sorted_percentile


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


def test_int_and_bytes_hashes_in_one_list():
    """An int first, bytes after (the vllm backend's eviction of a key whose publish it did
    not see carries the event's 64-bit int): each rendered as alone, no ValueError."""
    assert hex_strings([1, b"\xab\xcd"]).to_pylist() == ["0000000000000001", "abcd"]
    assert hex_lists([(2, b"\x01")]).to_pylist() == [["0000000000000002", "01"]]


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


_INT_TUPLES = st.lists(st.one_of(
    st.lists(st.integers(0, 10**7), max_size=9),  # ITLs in ns: the vectorised path
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4),  # beyond float's exact ints: Python's
).map(tuple), max_size=30)


@given(_INT_TUPLES)
def test_ragged_means_maxima_and_percentiles_are_pythons_to_the_last_bit(lists):
    """The request span's ITL columns, computed once per batch in numpy, equal the
    per-request Python definitions (kvtrace.numeric) exactly, empty lists NULL."""
    ragged = Ragged(lists)
    assert ragged.means().to_pylist() == [sum(v) / len(v) if v else None for v in lists]
    assert ragged.maxima().to_pylist() == [max(v) if v else None for v in lists]
    for q in (0, 50, 90, 99, 100):
        want = [float(sorted_percentile(sorted(v), q)) if v else None for v in lists]
        got = ragged.percentiles(q).to_pylist()
        assert got == want, q
        if all(abs(x) < 2**52 for v in lists for x in v):  # numpy's definition too, where floats are exact
            assert [percentile(v, q) if v else None for v in lists] == want


def test_ragged_of_is_shared_by_the_columns_of_one_value_list_only():
    values = [(3, 1, 2), ()]
    first = Ragged.of(values)
    assert Ragged.of(values) is first  # the ITL columns of one segment: one flat array, one sort
    assert Ragged.of(list(values)) is not first  # an equal but other list is its own


def test_int_lists_of_a_list_changed_in_place_are_its_new_values():
    """Only the span builder's segment columns share a Ragged (lists made once); a list
    reused by its caller is read afresh each time."""
    buf = [(1, 2)]
    assert int_lists(buf).to_pylist() == [[1, 2]]
    buf[0] = (3,)
    assert int_lists(buf).to_pylist() == [[3]]
