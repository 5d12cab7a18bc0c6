"""The run digest: canonical, order-sensitive, sensitive to every field."""

from __future__ import annotations

import hashlib

import msgspec
import numpy as np

from kvtrace.cache.events import BlockEvicted, BlockPublished, PrefixLookup
from kvtrace.engine.events import RequestFinished, StepBatch, StepExecuted
from kvtrace.replay.digest import VERSION_LINE, Digest, encode_event, first_difference


def pub(step=1, h=b"\x01\xff", ids=(3, 4)) -> BlockPublished:
    return BlockPublished(step, "r0", 0, "full", ids, (h, b"\x00"), 32)


def step(i=1, usage=(0.25,)) -> StepExecuted:
    return StepExecuted(i, 100, 200, 32, 0, 1, 0, 0, 0, usage)


def run(events_per_step) -> str:
    d = Digest()
    for i, evs in enumerate(events_per_step):
        d.on_step(StepBatch(step(i), evs, ()))
    return d.hexdigest()


def test_digest_is_sha256_of_documented_msgpack():
    d = Digest()
    d.on_cache_events([pub()])
    # [[type name, fields in order...]] as MessagePack, written out by hand
    body = msgspec.msgpack.encode([["BlockPublished", 1, "r0", 0, "full", [3, 4], [b"\x01\xff", b"\x00"], 32]])
    assert d.hexdigest() == hashlib.sha256(VERSION_LINE + body).hexdigest()
    assert d.num_events == 1
    # engine deliveries: [step, cache events, engine events]
    e = Digest()
    e.on_step(StepBatch(step(), [pub()], ()))
    body = msgspec.msgpack.encode([["StepExecuted", 1, 100, 200, 32, 0, 1, 0, 0, 0, [0.25]],
                                   [["BlockPublished", 1, "r0", 0, "full", [3, 4], [b"\x01\xff", b"\x00"], 32]],
                                   []])
    assert e.hexdigest() == hashlib.sha256(VERSION_LINE + body).hexdigest()


def test_buffered_deliveries_hash_as_one_update_each():
    """The digest encodes deliveries into one buffer hashed every MiB: the bytes hashed are
    those of one ``update`` per delivery, across flushes, and ``hexdigest`` may be read
    mid-run."""
    big = BlockPublished(0, "r0", 0, "full", tuple(range(30_000)), tuple(range(1 << 40, (1 << 40) + 30_000)), 1)
    deliveries = [[pub(i), big] if i % 3 == 0 else [pub(i)] for i in range(40)]  # ~5 MiB: several flushes
    want = hashlib.sha256(VERSION_LINE)
    d = Digest()
    for i, evs in enumerate(deliveries):
        d.on_cache_events(evs)
        want.update(msgspec.msgpack.encode(evs))
        if i == 20:
            assert d.hexdigest() == want.hexdigest()
    assert d.hexdigest() == want.hexdigest() and d.num_events == 54


def test_same_events_same_digest_any_change_differs():
    base = [[pub(0)], [pub(1), BlockEvicted(1, 0, "lru", (3,), (b"\x01",), (1,), (0,), "r1")]]
    assert run(base) == run([list(x) for x in base])
    assert run(base) != run([base[0], base[1][::-1]])  # order matters
    assert run(base) != run([[pub(0, h=b"\x02\xff")], base[1]])  # one hash byte
    assert run(base) != run([[], base[0] + base[1]])  # which step an event belongs to
    # numpy ints in an event encode like Python ints
    assert run([[pub(0, ids=(np.int64(3), np.int64(4)))], base[1]]) == run(base)


def test_usage_floats_are_exact():
    a = Digest()
    a.on_step(StepBatch(step(usage=(0.1 + 0.2,)), [], ()))
    b = Digest()
    b.on_step(StepBatch(step(usage=(0.3,)), [], ()))
    assert a.hexdigest() != b.hexdigest()  # 0.30000000000000004 != 0.3


def test_engine_events_and_batches_are_counted():
    fin = RequestFinished("r0", None, 0, 1, 2, 3, 10, 2, 0, 0, 10, 0, 0, (5,), ((1, 2, 10),))
    d = Digest()
    d.on_step(StepBatch(step(), [pub()], [fin]))
    assert d.num_steps == 1 and d.num_events == 3
    e = Digest()
    e([pub()])  # usable directly as a cache listener
    assert e.num_events == 1 and e.hexdigest() != Digest().hexdigest()


def test_text_encoding_and_first_difference():
    assert encode_event(pub()) == 'BlockPublished|1|"r0"|0|"full"|[3,4]|[x01ff,x00]|32\n'
    ev = PrefixLookup(2, "r|1", 64, 32, (32, 16), 32, 0, None, b"\xab", -1)
    assert encode_event(ev) == 'PrefixLookup|2|"r|1"|64|32|[32,16]|32|0|~|xab|-1\n'
    assert encode_event(step()).endswith("|[0x1.0000000000000p-2]\n")
    assert first_difference([pub(), ev], [pub(), ev]) is None
    i, a, b = first_difference([pub(), ev], [pub(), pub(h=b"\x09")])
    assert i == 1 and a.startswith("PrefixLookup") and "x09" in b
    assert first_difference([pub()], [pub(), ev])[:2] == (1, None)
