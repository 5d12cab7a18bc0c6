"""The hasher's trace-block memo is bounded (``MAX_TRACE_MEMO_UNITS``): a Mooncake-like day's
replay kept every (parent, trace block) it met, 4-5 KB a request, the largest thing an engine
replay retained per request (found by the memory probe, session 30). Emptying it changes no key:
it caches a pure function."""

from __future__ import annotations

import pytest

from kvtrace.cache import hashing
from kvtrace.cache.hashing import BlockHasher
from kvtrace.cache.request import Request


def _requests(per_block_tokens: int) -> list[Request]:
    # every request a new prefix of 4 trace blocks, half of them resent (memo hits)
    return [Request(f"r{i}", None, trace_block_ids=tuple(range(4 * (i // 2), 4 * (i // 2) + 4)),
                    trace_block_size=per_block_tokens, num_prompt_tokens=4 * per_block_tokens)
            for i in range(400)]


@pytest.mark.parametrize("trace_block_size", [16, 64])  # one unit a trace block, and four
def test_the_trace_memo_stays_within_its_bound_and_changes_no_key(monkeypatch, trace_block_size):
    unbounded = BlockHasher("sha256_cbor", 16)
    expected = []
    for r in _requests(trace_block_size):
        unbounded.update(r)
        expected.append(list(r.block_hashes))
    units = sum(len(v) if isinstance(v, tuple) else 1 for d in unbounded._trace_memo.values() for v in d.values())
    assert units == 200 * 4 * trace_block_size // 16  # (unbounded: every block it met)

    monkeypatch.setattr(hashing, "MAX_TRACE_MEMO_UNITS", 50)
    bounded = BlockHasher("sha256_cbor", 16)
    most = 0
    for r, want in zip(_requests(trace_block_size), expected, strict=True):
        bounded.update(r)
        assert list(r.block_hashes) == want
        held = sum(len(v) if isinstance(v, tuple) else 1 for d in bounded._trace_memo.values() for v in d.values())
        assert held == bounded._memo_units
        most = max(most, held)
    assert most <= 50 + 4 * trace_block_size // 16  # (emptied before a request past the bound)
