"""Fuzz: vLLM KV-event messages (``decode_kv_batch``, ``VllmSpanRows``, ``VllmKVCapture.receive``).

Payloads are vLLM's own wire format (the msgspec structs of tests/instrument/vllm_publisher.py,
array-like and tagged-map layouts), then mutated: fields replaced with hostile msgpack values,
bytes flipped or cut, frames of the wrong shape. The invariant: ``decode_kv_batch`` and the
rows refuse with a one-line KVTraceError (``VllmWireError``, ``UnstorableValue``), never
another exception; a capture fed any message counts it good or bad and never raises, and
what it accepted lands in a real store.
"""

from __future__ import annotations

import copy
import math

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtrace.instrument.ids import SeededIdGenerator
from kvtrace.instrument.vllm.capture import VllmKVCapture
from kvtrace.instrument.vllm.rows import VllmSpanRows
from kvtrace.instrument.vllm.wire import REMOVED_FIELDS, STORED_FIELDS, decode_kv_batch
from tests.fuzz.support import fuzz, one_line_error
from tests.instrument.vllm_publisher import CURRENT, LEGACY

U64 = (1 << 64) - 1
HASHES = st.one_of(st.integers(-(2**63), U64), st.binary(min_size=1, max_size=32))
EDGE = st.sampled_from([0, -1, 2**31, 2**32, 2**63 - 1, -(2**63), U64, 1e30, -1e30, math.nan, math.inf, -math.inf,
                        -0.0, 1.7e308, "", "x", b"", b"\xff" * 9, None, True, [], {}, [None], {"a": 1}])
HOSTILE = st.one_of(EDGE, st.integers(-(2**63), U64), st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=4), st.binary(max_size=6), st.lists(EDGE, max_size=3),
                    st.dictionaries(st.text(max_size=3), EDGE, max_size=2))


@st.composite
def batch(draw):
    """One EventBatch as vLLM's publisher encodes it (either layout)."""
    EventBatch, BlockStored, BlockRemoved, AllBlocksCleared = draw(st.sampled_from([LEGACY, CURRENT]))
    events = []
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["stored", "removed", "cleared"]))
        if kind == "stored":
            hashes = draw(st.lists(HASHES, min_size=1, max_size=3))
            bs = draw(st.sampled_from([1, 16]))
            tokens = draw(st.lists(st.integers(0, 2**31), min_size=bs * len(hashes), max_size=bs * len(hashes)))
            events.append(BlockStored(hashes, draw(st.none() | HASHES), tokens, bs, draw(st.none() | st.integers(0, 9)),
                          draw(st.sampled_from(["GPU", None])), draw(st.none() | st.text(max_size=3)),
                          group_idx=draw(st.none() | st.integers(0, 3)),
                          kv_cache_spec_kind=draw(st.sampled_from([None, "full_attention", "mamba"]))))
        elif kind == "removed":
            events.append(BlockRemoved(draw(st.lists(HASHES, max_size=3)), draw(st.sampled_from(["GPU", None])),
                                       group_idx=draw(st.none() | st.integers(0, 3))))
        else:
            events.append(AllBlocksCleared())
    ts = draw(st.floats(0, 2e9))
    rank = draw(st.none() | st.integers(0, 7))
    return msgspec.msgpack.decode(msgspec.msgpack.encode(EventBatch(ts, events, rank)))  # the plain wire value


def mutate(value, data):
    """``value`` (a decoded wire value) with one node replaced by a hostile one."""
    spots = []

    def walk(v):
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
        for k, x in items:
            spots.append((v, k))
            walk(x)

    walk(value)
    if spots:
        container, key = data.draw(st.sampled_from(spots))
        # a copy: hypothesis may hand out one object twice, and a node put inside itself is a cycle
        container[key] = copy.deepcopy(data.draw(HOSTILE))
    return value


def check_rows(payload: bytes, rows: VllmSpanRows) -> bool:
    """True when the payload became rows; False after checking the refusal."""
    try:
        b, _ = decode_kv_batch(payload)
        rows.add(7, b)
    except Exception as err:  # the invariant is about every exception
        one_line_error(err)
        return False
    return True


def new_rows() -> VllmSpanRows:
    return VllmSpanRows(SeededIdGenerator(0), {"service.name": "vllm"})


@fuzz(150)
@given(wire=batch(), data=st.data())
def test_hostile_fields(wire, data):
    for _ in range(data.draw(st.integers(0, 3))):
        wire = mutate(wire, data)
    rows = new_rows()
    check_rows(msgspec.msgpack.encode(wire), rows)
    rows.take()  # what was accepted is one table in the store schema


@fuzz(80)
@given(wire=batch(), data=st.data())
def test_payload_bytes_mutated(wire, data):
    raw = bytearray(msgspec.msgpack.encode(wire))
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(raw)))
        chunk = data.draw(st.binary(min_size=1, max_size=4))
        if data.draw(st.booleans()):
            raw[at:at + len(chunk)] = chunk
        else:
            del raw[at:at + len(chunk)]
    rows = new_rows()
    check_rows(bytes(raw), rows)
    rows.take()


@fuzz(60)
@given(payload=st.binary(max_size=200))
def test_arbitrary_payloads(payload):
    rows = new_rows()
    check_rows(payload, rows)
    rows.take()


@pytest.fixture(scope="module")
def capture():
    """One real capture (a SUB socket on a port nothing publishes to): messages are handed
    to ``receive`` as its poll loop would, without a publisher's timing."""
    cap = VllmKVCapture("tcp://127.0.0.1:1", replay_timeout_s=0.01)
    yield cap
    cap.close()


@fuzz(80)
@given(wire=batch(), data=st.data())
def test_capture_counts_every_message_and_keeps_the_good_ones(capture, wire, data):
    """Frames of any shape: the capture never raises, and each message it accepts adds
    exactly its batch (bad ones are counted, and never cost a good one); a backwards seq
    is held until the next message says whether it was a restart or a stray one."""
    payload = msgspec.msgpack.encode(mutate(wire, data) if data.draw(st.booleans()) else wire)
    seq = data.draw(st.one_of(st.integers(0, 3), st.just(capture.last_seq or 0)))
    frames = data.draw(st.sampled_from(["ok", "short", "seq width", "extra"]))
    msg = {"ok": [b"kv", seq.to_bytes(8, "big"), payload], "short": [b"kv", payload],
           "seq width": [b"kv", b"\x00" * 3, payload], "extra": [b"kv", seq.to_bytes(8, "big"), payload, b""]}[frames]
    before = capture.stats.batches + capture.stats.bad_messages + capture.stats.duplicates + capture.held
    capture.receive(msg)
    after = capture.stats.batches + capture.stats.bad_messages + capture.stats.duplicates + capture.held
    assert after >= before + 1 or capture.stats.restarts  # a restart's recovery may count it as lost instead
    capture.flush()  # no store: the rows become one table, which must not fail


def test_capture_rows_reach_a_real_store(tmp_path):
    """A valid batch after hostile ones (a NaN ts, a block_size past int32, no msgpack):
    stored, and the hostile ones counted, costing nothing."""
    from kvtrace.store import Store
    from tests.instrument.helpers import count_spans

    EventBatch, BlockStored, _, _ = CURRENT
    path = tmp_path / "cap.duckdb"
    with Store.open(path) as store:
        run_id = store.create_run("capture", mode="vllm")
        cap = VllmKVCapture("tcp://127.0.0.1:1", store=store, run_id=run_id, replay_timeout_s=0.01)
        try:
            bad = [msgspec.msgpack.encode([math.nan, []]),
                   msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1], U64]]]), b"\xc1"]
            for seq, payload in enumerate(bad):
                cap.receive([b"kv", seq.to_bytes(8, "big"), payload])
            good = msgspec.msgpack.encode(EventBatch(5.0, [BlockStored([1, 2], None, [1, 2], 1, None, "GPU", None)]))
            cap.receive([b"kv", len(bad).to_bytes(8, "big"), good])
            cap.flush()
        finally:
            cap.close()
    assert cap.stats.bad_messages == len(bad) and cap.stats.batches == 1
    assert count_spans(path, run_id) == 2  # the batch's step span and its one event


# -- regressions the fuzzer found ------------------------------------------------------------------
def test_a_ts_that_rounds_past_the_stores_ns_is_refused_as_ts():
    """The largest ts below (2^63 - 1) / 1e9 s passed the wire's check and was 2^63 ns once
    rounded by the rows: refused there as "start time ...", naming no ts."""
    from kvtrace.errors import KVTraceError
    from kvtrace.instrument.vllm.wire import _MAX_TS_S, VllmWireError

    stored = ["BlockStored", [1], None, [1], 1, None, "GPU", None]
    with pytest.raises(VllmWireError) as info:
        decode_kv_batch(msgspec.msgpack.encode([_MAX_TS_S, [stored]]))
    one_line_error(info.value, "vLLM KV event batch: ts must be seconds")
    below = math.nextafter(_MAX_TS_S, 0)
    while True:  # the largest ts the wire takes: the rows store it
        try:
            b, _ = decode_kv_batch(msgspec.msgpack.encode([below, [stored]]))
            break
        except KVTraceError:
            below = math.nextafter(below, 0)
    rows = new_rows()
    rows.add(0, b)
    assert rows.take().num_rows == 2


# -- grammar-aware: one field of a valid batch hostile, named; one batch in every layout, read the same -----
FIELD_HOSTILE = {
    "hash": st.one_of(st.sampled_from([-(2**63), 2**64 - 1, 1.0, math.nan, "ab", None, True, [1], {}]),
                      st.binary(max_size=40), st.integers(-(2**63), U64)),
    "int": st.one_of(st.sampled_from([0, -1, 1, 2**31 - 1, 2**31, -(2**31) - 1, 2**63 - 1, 2**63, U64, -(2**63),
                                      16.0, 1.5, math.nan, math.inf, "16", b"16", True, None, [16], {"a": 1}]),
                     st.integers(-(2**63), U64)),
    "str": st.one_of(st.sampled_from(["", "GPU", "é", "\x00", "🙂" * 50, b"GPU", 1, None, True, [], {}]),
                     st.text(max_size=8)),
    "list": st.one_of(st.sampled_from([None, [], 5, "ab", b"ab", {"a": 1}, [[1]], [None], [1.5], [True], [-1],
                                       [U64], [-(2**63)], [2**63]]),
                      st.lists(st.integers(-(2**63), U64), max_size=4)),
}
FIELD_KINDS = {"block_hashes": "list", "parent_block_hash": "hash", "token_ids": "list", "block_size": "int",
               "lora_id": "int", "medium": "str", "lora_name": "str", "extra_keys": "list", "group_idx": "int",
               "kv_cache_spec_kind": "str", "kv_cache_spec_sliding_window": "int"}
# the words a refusal names each field by (a list's item by its own name)
FIELD_WORDS = {"block_hashes": ("block_hashes", "block hash"), "token_ids": ("token_ids", "token id")}


@fuzz(120)
@given(wire=batch(), data=st.data())
def test_one_typed_hostile_field_is_refused_naming_it(wire, data):
    """A valid batch with one field of one event (or the batch's ts or rank) given a hostile
    value of a kind chosen for it: stored, or refused whole in one line naming the field."""
    events = wire["events"] if isinstance(wire, dict) else wire[1]
    if events and data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(events) - 1))
        ev = events[i]
        tag = ev["type"] if isinstance(ev, dict) else ev[0]
        names = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS}.get(tag, ())
        if not names:
            return
        name = data.draw(st.sampled_from(names))
        value = copy.deepcopy(data.draw(FIELD_HOSTILE[FIELD_KINDS[name]]))
        if isinstance(ev, dict):
            ev[name] = value
        else:
            at = 1 + names.index(name)
            ev.extend([None] * (at + 1 - len(ev)))  # (an older layout stops earlier)
            ev[at] = value
    else:
        name = data.draw(st.sampled_from(["ts", "data_parallel_rank"]))
        value = data.draw(FIELD_HOSTILE["int"] | st.floats(allow_nan=True, allow_infinity=True))
        if isinstance(wire, dict):
            wire[name] = value
        else:
            wire.extend([None] * (3 - len(wire)))
            wire[0 if name == "ts" else 2] = value
    payload = msgspec.msgpack.encode(wire)
    try:
        b, _ = decode_kv_batch(payload)
        rows = new_rows()
        rows.add(7, b)
        rows.take()
    except Exception as err:  # the invariant is about every exception
        text = one_line_error(err)
        assert any(w in text for w in FIELD_WORDS.get(name, (name,))), f"{name} not named: {text!r}"


@fuzz(80)
@given(wire=batch(), data=st.data())
def test_one_batch_in_every_layout_decodes_the_same(wire, data):
    """The array-like batch and the map one, array-like events and tagged maps, with fields
    a newer vLLM appends (ignored): one batch, decoded the same."""
    events = wire["events"] if isinstance(wire, dict) else wire[1]
    ts, rank = (wire["ts"], wire.get("data_parallel_rank")) if isinstance(wire, dict) else \
        (wire[0], wire[2] if len(wire) > 2 else None)
    want = decode_kv_batch(msgspec.msgpack.encode(wire))

    def other(ev):
        tag = ev["type"] if isinstance(ev, dict) else ev[0]
        names = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS}.get(tag, ())
        fields = {k: v for k, v in ev.items() if k != "type"} if isinstance(ev, dict) else dict(zip(names, ev[1:]))
        if data.draw(st.booleans()):  # a tagged map, and a key no version has
            return {"type": tag, **fields, **({"future_field": [1, "x"]} if data.draw(st.booleans()) else {})}
        return [tag, *(fields.get(n) for n in names), *(["future"] if data.draw(st.booleans()) else [])]

    evs = [other(e) for e in events]
    layout = data.draw(st.sampled_from(["array", "map"]))
    again = [ts, evs, rank] if layout == "array" else {"ts": ts, "events": evs, "data_parallel_rank": rank}
    assert decode_kv_batch(msgspec.msgpack.encode(again)) == want
