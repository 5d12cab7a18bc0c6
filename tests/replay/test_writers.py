"""Writers: native is lossless, Mooncake keeps the prefix-sharing structure."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvtrace.replay.readers import native_header, open_trace, read_trace
from kvtrace.replay.writers import BlockInterner, write_mooncake
from kvtrace.workload import TraceRequest
from kvtrace.workload.native import write_native
from tests.conftest import TRACES

MOONCAKE = TRACES / "mooncake_synthetic_trace.jsonl"
WEKA = TRACES / "weka_sample"
AZURE = TRACES / "AzureLLMInferenceTrace_conv.csv"


def same(a: TraceRequest, b: TraceRequest) -> bool:
    toks = (a.token_ids is None and b.token_ids is None) or (
        a.token_ids is not None and b.token_ids is not None and np.array_equal(a.token_ids, b.token_ids)
    )
    return toks and all(
        getattr(a, k) == getattr(b, k)
        for k in ("request_id", "arrival_ns", "input_length", "output_length", "hash_ids", "hash_block_size",
                  "namespace", "session_id", "cache_salt", "expected_output")
    )


def mixed_requests() -> list[TraceRequest]:
    return [
        TraceRequest("a", 0, 40, 3, hash_ids=(5, 6, 7), hash_block_size=16, session_id="s", namespace=9),
        TraceRequest("b", 10, 4, 2, token_ids=np.array([1, 2, 3, 4], dtype=np.int64), cache_salt="t",
                     expected_output=(8, 9)),
        TraceRequest("c", 10, 17, 0, hash_ids=(5, 1), hash_block_size=16),
    ]


def test_native_round_trip_is_lossless_and_byte_stable(tmp_path):
    reqs = mixed_requests()
    p = tmp_path / "n.jsonl"
    assert write_native(reqs, p) == 3
    back = read_trace(p)
    assert all(same(x, y) for x, y in zip(reqs, back)) and len(back) == 3
    q = tmp_path / "n2.jsonl"
    write_native(back, q)
    assert p.read_bytes() == q.read_bytes()


def test_mooncake_to_native_to_mooncake(tmp_path):
    src = open_trace(MOONCAKE, limit=300)
    native = tmp_path / "n.jsonl"
    write_native(src, native)
    assert native_header(native)["source"] == f"mooncake:sha256:{src.source_id}"
    a, b = list(src), read_trace(native)
    assert all(same(x, y) for x, y in zip(a, b)) and len(b) == 300
    mc = tmp_path / "m.jsonl"
    assert write_mooncake(b, mc) == 300
    again = read_trace(mc)
    # ids were in first-appearance order already, so they survive re-assignment
    assert [r.hash_ids for r in again] == [r.hash_ids for r in a]
    assert [r.arrival_ns for r in again] == [r.arrival_ns for r in a]
    first = json.loads(mc.read_text().splitlines()[0])
    assert set(first) == {"timestamp", "input_length", "output_length", "hash_ids"}


@pytest.mark.parametrize("path,limit", [(WEKA, None), (AZURE, 500)])
def test_every_format_converts_to_native_losslessly(tmp_path, path, limit):
    src = open_trace(path, limit=limit)
    out = tmp_path / "n.jsonl"
    n = write_native(src, out)
    back = read_trace(out)
    assert n == len(back) == len(list(src))
    assert all(same(x, y) for x, y in zip(src, back))
    # the expanded prompts (namespaced ids, synthetic tails) are the same tokens
    assert np.array_equal(back[-1].prompt_token_ids(), list(src)[-1].prompt_token_ids())


def test_mooncake_reblocking_keeps_sharing(tmp_path):
    # 16-token ids re-blocked at 32: two requests sharing 2 fine blocks share 1 coarse block
    reqs = [
        TraceRequest("x", 0, 64, 1, hash_ids=(1, 2, 3, 4), hash_block_size=16),
        TraceRequest("y", 1_500_000, 50, 1, hash_ids=(1, 2, 9, 10), hash_block_size=16),
        TraceRequest("z", 2_000_000, 20, 1, hash_ids=(7, 8), hash_block_size=16),
    ]
    p = tmp_path / "m.jsonl"
    write_mooncake(reqs, p, block_size=32)
    x, y, z = read_trace(p, block_size=32)
    assert x.hash_ids == (0, 1) and y.hash_ids == (0, 2) and z.hash_ids == (3,)
    assert y.arrival_ns == 1_000_000  # floored to whole ms


def test_interner_from_tokens_matches_equal_content():
    toks = np.arange(40, dtype=np.int64)
    a = TraceRequest("a", 0, 40, 1, token_ids=toks)
    b = TraceRequest("b", 0, 36, 1, token_ids=toks[:36].copy())
    c = TraceRequest("c", 0, 40, 1, token_ids=toks, cache_salt="other")
    it = BlockInterner(16)
    ia, ib, ic = it.block_ids(a), it.block_ids(b), it.block_ids(c)
    assert ia[:2] == ib[:2] and ia[2] != ib[2]  # the partial tails differ in content
    assert ic[0] != ia[0]  # a salt changes the first block and so the whole chain


def test_failed_write_leaves_no_file(tmp_path):
    def broken():
        yield mixed_requests()[0]
        raise RuntimeError("source died")

    p = tmp_path / "out.jsonl"
    with pytest.raises(RuntimeError):
        write_native(broken(), p)
    assert not p.exists() and list(tmp_path.iterdir()) == []


def test_a_replaced_output_keeps_its_permissions(tmp_path, capsys):
    """generate and convert write through a temporary file renamed over the old one: a
    0600 file became 0644 (the umask's)."""
    import os
    import stat

    from tests.cli.support import run

    out = tmp_path / "private.jsonl"
    out.write_text("x\n")
    os.chmod(out, 0o600)
    code, _, err = run(["generate", "chat", "--requests", "2", "-o", str(out)], capsys)
    assert code == 0, err
    assert stat.S_IMODE(out.stat().st_mode) == 0o600 and len(out.read_text().splitlines()) >= 2
    new = tmp_path / "new.jsonl"  # a new file: as the umask makes it
    code, _, err = run(["convert", str(out), "-o", str(new)], capsys)
    assert code == 0, err
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(new.stat().st_mode) == 0o666 & ~umask
