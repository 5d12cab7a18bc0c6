"""A cached key that points at the wrong content, built behind the cache manager's back (as
a manager bug would): the content checks must see it. The auditor compares each cached
key's block with the content its prefix defines; the worker samples from the blocks its
table names and checks each token against the no-cache reference."""

from __future__ import annotations

import numpy as np
import pytest

from kvtrace.cache import FullAttentionSpec, MambaSpec
from kvtrace.engine import Engine, get_preset
from kvtrace.engine.events import DivergentOutput, StaleHashFound
from kvtrace.workload import TraceRequest

S = 10**9


def _request(rid: str, arrival_ns: int, first_token: int, prompt: int) -> TraceRequest:
    return TraceRequest(rid, arrival_ns, prompt, 4, token_ids=np.arange(first_token, first_token + prompt))


class _Wrong:
    """The engine's manager, but for what ``twist`` changes in what it tells the engine."""

    def __init__(self, inner, twist):
        self.inner, self.twist = inner, twist

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def cached_entries(self):
        return self.twist("entries", self.inner, list(self.inner.cached_entries()))

    def get_block_ids(self, request_id):
        return self.twist(request_id, self.inner, tuple(list(g) for g in self.inner.get_block_ids(request_id)))


def _run(preset, work, twist):
    engine = Engine(preset, audit_interval=1)
    make = engine._manager
    engine._manager = lambda: _Wrong(make(), twist)
    batches: list = []
    result = engine.run(work, [batches.append])
    found = [e for b in batches for e in b.engine_events if isinstance(e, (StaleHashFound, DivergentOutput))]
    return result.summary, found


@pytest.mark.parametrize("wrong", [False, True])
def test_a_key_mapped_to_another_prefix_block_is_a_stale_hash(wrong):
    # a and b: two prompts with a first block each; the first cached key then claims b's block
    work = [_request("a", 0, 1000, 64), _request("b", S, 5000, 64)]

    def twist(what, _, value):
        if wrong and what == "entries":
            first = value[0]
            other = next((e for e in value[1:] if e[0] == first[0] and e[3] == first[3] and e[2] != first[2]), None)
            if other is not None:
                value[0] = (first[0], first[1], other[2], first[3])
        return value

    summary, found = _run(get_preset("dense-attention"), work, twist)
    assert summary["stale_hashes"] == (1 if wrong else 0)
    assert summary["divergent_outputs"] == 0
    if wrong:
        (stale,) = found
        assert isinstance(stale, StaleHashFound) and stale.expected_fingerprint != stale.actual_fingerprint


@pytest.mark.parametrize("group", [0, 1], ids=["attention", "state"])
def test_a_hit_handed_another_prefix_block_diverges(group):
    """c resends a's prompt and hits it; its table is handed b's block in place of a hit block
    (attention: the first; state: the one holding the state at the hit)."""
    preset = get_preset("kimi-hybrid", groups=(FullAttentionSpec(64), MambaSpec(64)), hash_block_size=64,
                        capacity_blocks=200)
    work = [_request("a", 0, 1000, 200), _request("b", S, 5000, 200), _request("c", 2 * S, 1000, 200)]
    slot = 0 if group == 0 else 2  # state at 192 tokens: the third 64-token slot
    b_table: list = []

    def twist(what, inner, value):
        if what == "b" and not b_table:
            b_table.append(value[group][slot])
        if what == "c" and wrong:
            value[group][slot] = b_table[0]
        return value

    for wrong in (False, True):
        summary, found = _run(preset, work, twist)
        assert summary["prefix_cache_hits"] == 192 and summary["stale_hashes"] == 0
        if not wrong:
            assert summary["divergent_outputs"] == 0 and not found
        else:
            assert summary["divergent_outputs"] == 4
            assert {e.request_id for e in found} == {"c"} and all(isinstance(e, DivergentOutput) for e in found)
