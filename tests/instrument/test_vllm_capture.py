"""Live vLLM KV-event capture over real ZMQ sockets, gaps and both wire layouts included."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import pytest
import zmq

from kvtrace.instrument.arrow_columns import hash_hex
from kvtrace.instrument.vllm import ChainTracer, KVEvent, capture_vllm, decode_kv_batch
from tests.instrument.helpers import store_rows
from tests.instrument.vllm_publisher import CURRENT, LEGACY, VllmPublisher


def _bytes_hash(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8  # 32 bytes, like sha256_cbor


def _batches(layout, n: int, bytes_hashes: bool):
    """Batch k stores block k (child of k-1) and, from k=3 on, removes block k-3, in KV cache group 0
    (a chain runs within one group: vLLM chains each group's blocks apart)."""
    EventBatch, BlockStored, BlockRemoved, AllBlocksCleared = layout
    mk = _bytes_hash if bytes_hashes else (lambda i: -i if i % 2 else i * 1_000_003)
    out = []
    for k in range(n):
        events = [BlockStored([mk(k + 1)], mk(k) if k else None, [k] * 4, 4, None, "GPU", None,
                              group_idx=0, kv_cache_spec_kind="full_attention")]
        if k >= 3:
            events.append(BlockRemoved([mk(k - 2)], "GPU", group_idx=0))
        if k == n - 1:
            events.append(AllBlocksCleared())
        out.append(EventBatch(1_700_000_000.0 + k * 0.01, events, 0))
    return out


def stats_of(capture_ref) -> int:
    return capture_ref[0].stats.batches if capture_ref else 0


def _run_capture(tmp_path, layout, bytes_hashes, drop: set[int], duplicate: int | None = None, replay: bool = True,
                 arrive: int | None = None):
    """``arrive``: the batches to await before the stop (by default all, or those sent without a replay socket)."""
    pub = VllmPublisher()
    batches = _batches(layout, 20, bytes_hashes)
    received = threading.Event()
    done = threading.Event()
    result = {}

    capture_ref = []

    def on_ready(cap):
        capture_ref.append(cap)
        cap.on_batch = lambda seq, batch: received.set()

    def capture():
        result["stats"] = capture_vllm(pub.endpoint, pub.replay_endpoint if replay else None,
                                       store_path=tmp_path / "live.duckdb",
                                       topic="kv-events", trace_out=tmp_path / "trace.jsonl",
                                       should_stop=done.is_set, on_ready=on_ready)

    t = threading.Thread(target=capture)
    t.start()
    try:
        # seq 0 until the subscription is live (late joiners miss PUB messages); repeats are duplicates
        first = pub.publish(batches[0])
        deadline = time.monotonic() + 20
        while not received.wait(0.05):
            assert time.monotonic() < deadline, "subscriber never connected"
            pub.resend(first)
        for k in range(1, len(batches)):
            pub.publish(batches[k], send=k not in drop)
            if duplicate == k:
                pub.resend(k)
        deadline = time.monotonic() + 20
        if arrive is None:
            arrive = len(batches) - (0 if replay else len(drop))
        while stats_of(capture_ref) < arrive and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        done.set()
        t.join(30)
        pub.close()
    return result["stats"], pub


def test_a_last_batch_dropped_is_recovered_at_the_stop_not_lost_unsaid(tmp_path):
    """PUB dropped the last batch (its high-water mark) and nothing came after to show the gap:
    the capture stored 19 of 20 batches and said nothing was lost, while the publisher's replay
    buffer held it. The stop asks the replay socket for what follows the last batch received."""
    stats, pub = _run_capture(tmp_path, LEGACY, False, drop={19}, arrive=19)
    assert pub.replay_requests == [18]  # (from the last one received, to see the publisher is the same)
    assert stats.batches == 20 and stats.recovered == 1 and stats.lost == 0 and stats.restarts == 0
    rows = store_rows(tmp_path / "live.duckdb", stats.run_id)
    assert sorted(r["step"] for r in rows if r["name"] == "kvtrace.engine.step") == list(range(20))


@pytest.mark.parametrize("layout, bytes_hashes", [(LEGACY, False), (CURRENT, True)],
                         ids=["legacy-int", "current-bytes"])
def test_capture_recovers_a_gap_through_replay(tmp_path, layout, bytes_hashes):
    stats, pub = _run_capture(tmp_path, layout, bytes_hashes, drop={5, 6, 7, 12}, duplicate=9)
    assert stats.gaps == 2 and stats.recovered == 4 and stats.lost == 0
    # (from the last seq held: did the publisher restart?), and at the stop from the last one received
    assert pub.replay_requests == [4, 11, 19]
    assert stats.batches == 20
    assert stats.duplicates >= 1
    rows = store_rows(tmp_path / "live.duckdb", stats.run_id)
    steps = sorted(r["step"] for r in rows if r["name"] == "kvtrace.engine.step")
    assert steps == list(range(20))
    pubs = [r for r in rows if r["name"] == "kvtrace.cache.publish"]
    evicts = [r for r in rows if r["name"] == "kvtrace.cache.evict"]
    assert len(pubs) == 20 and len(evicts) == 17 + 1
    assert {r["source"] for r in rows} == {"vllm"}
    mk = _bytes_hash if bytes_hashes else (lambda i: -i if i % 2 else i * 1_000_003)
    by_step = {r["step"]: r for r in pubs}
    for k in range(20):
        r = by_step[k]
        assert r["block_hashes"] == [hash_hex(mk(k + 1))]
        assert r["parent_block_hash"] == (hash_hex(mk(k)) if k else None)
        assert (r["token_ids"], r["block_size"], r["medium"]) == ([k] * 4, 4, "GPU")
        assert r["group_id"] == 0 and r["kv_cache_spec_kind"] == "full_attention"
        assert r["publish_kind"] == "vllm_stored"
        assert r["num_tokens"] == (k + 1) * 4  # chain depth x block size
        assert r["start_ns"] == round((1_700_000_000.0 + k * 0.01) * 1e9)
    assert sorted(r["evict_reason"] for r in evicts) == ["reset"] + ["vllm_removed"] * 17
    step_ids = {r["span_id"] for r in rows if r["name"] == "kvtrace.engine.step"}
    assert all(r["parent_span_id"] in step_ids for r in pubs + evicts)
    # the reconstructed trace: one request chaining the 20 blocks (each step extends the tail)
    lines = (tmp_path / "trace.jsonl").read_text().splitlines()
    header, reqs = json.loads(lines[0]), [json.loads(x) for x in lines[1:]]
    assert header["kvtrace_trace"] == 1 and header["block_size"] == 4
    assert len(reqs) == 1
    assert reqs[0]["hash_ids"] == list(range(20)) and reqs[0]["input_length"] == 80


def test_decode_tolerates_both_layouts_and_unknown_events():
    import msgspec

    EventBatch, BlockStored, _, _ = LEGACY
    legacy = msgspec.msgpack.encode(EventBatch(1.0, [BlockStored([1, -2], None, [1], 16, None, None, None)]))
    batch, unknown = decode_kv_batch(legacy)
    assert [e.block_hashes for e in batch.events] == [["0000000000000001", "fffffffffffffffe"]]
    assert unknown == 0
    # a map-form batch (EventBatch without array_like) holding an event kind from the future
    doc = {"ts": 2.0, "events": [{"type": "BlockMigrated", "block_hashes": [1]},
                                 {"type": "BlockRemoved", "block_hashes": [b"\x01\x02"], "medium": "CPU"}],
           "data_parallel_rank": 3}
    batch, unknown = decode_kv_batch(msgspec.msgpack.encode(doc))
    assert (batch.ts, batch.dp_rank, unknown) == (2.0, 3, 1)
    assert batch.events[0].kind == "BlockRemoved" and batch.events[0].block_hashes == ["0102"]
    # the oldest layout: no medium, no dp rank
    old = msgspec.msgpack.encode([3.0, [["BlockStored", [7], 6, [1, 2], 2, None], ["BlockRemoved", [6]]]])
    batch, _ = decode_kv_batch(old)
    assert batch.events[0].parent_block_hash == hash_hex(6) and batch.events[1].block_hashes == [hash_hex(6)]


def test_chain_tracer_splits_requests_by_chain_and_time():
    t = ChainTracer(merge_window_ns=1_000)
    st = lambda hashes, parent: KVEvent("BlockStored", hashes, parent, block_size=16)
    t.add(0, st(["a", "b"], None))        # request 1: a b
    t.add(500, st(["c"], "b"))            # chunked prefill continues request 1
    t.add(600, st(["x"], None))           # request 2: x
    t.add(5_000, st(["d"], "b"))          # later, shares a b: request 3 = a b d
    assert [t.chain(r.tail) for r in t.requests] == [["a", "b", "c"], ["x"], ["a", "b", "d"]]


def test_reconstructed_trace_is_written_by_the_native_writer_and_reads_back(tmp_path):
    from kvtrace.instrument.vllm import write_native_trace
    from kvtrace.workload.native import read_header, read_native

    a, b = ChainTracer(), ChainTracer()  # two DP ranks sharing the prefix "p"
    a.add(10, KVEvent("BlockStored", ["p", "q"], None, block_size=16))
    b.add(5, KVEvent("BlockStored", ["p", "r"], None))  # no block size: the trace's
    path = tmp_path / "t.jsonl"
    assert write_native_trace(path, [a, b], source="vllm:test") == 2
    assert read_header(str(path)) == {"kvtrace_trace": 1, "source": "vllm:test", "block_size": 16}
    reqs = list(read_native(str(path)))
    assert [(r.request_id, r.arrival_ns, r.hash_ids, r.input_length, r.output_length) for r in reqs] == [
        ("vllm-0", 0, (0, 1), 32, 0), ("vllm-1", 5, (0, 2), 32, 0)]


def test_capture_flush_is_due_after_its_interval():
    from kvtrace.instrument.vllm import VllmKVCapture

    cap = VllmKVCapture("tcp://127.0.0.1:1", flush_interval_s=10)  # ZMQ connects lazily: no server needed
    try:
        assert cap.socket.type == zmq.SUB
        assert not cap.flush_due(time.monotonic())
        assert cap.flush_due(time.monotonic() + 10)
        cap.flush()
        assert not cap.flush_due(time.monotonic() + 9)
    finally:
        cap.close()


def test_without_a_replay_socket_a_gap_is_counted_as_lost(tmp_path):
    stats, pub = _run_capture(tmp_path, CURRENT, True, drop={4, 5}, replay=False)
    assert (stats.gaps, stats.recovered, stats.lost, stats.batches) == (1, 0, 2, 18)
    assert pub.replay_requests == []
    rows = store_rows(tmp_path / "live.duckdb", stats.run_id, "name, step")
    assert sorted(r["step"] for r in rows if r["name"] == "kvtrace.engine.step") == [0, 1, 2, 3, *range(6, 20)]
    from kvtrace.store import read
    summary = read.run(tmp_path / "live.duckdb", stats.run_id)["summary"]
    assert (summary["lost"], summary["gaps"]) == (2, 1)


def test_dp_endpoint_follows_vllm_offset_convention():
    from kvtrace.errors import ConfigError
    from kvtrace.instrument.vllm import dp_endpoint

    assert dp_endpoint("tcp://10.0.0.5:5557", 0) == "tcp://10.0.0.5:5557"
    assert dp_endpoint("tcp://10.0.0.5:5557", 3) == "tcp://10.0.0.5:5560"
    assert dp_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert dp_endpoint("ipc:///tmp/kv", 0) == "ipc:///tmp/kv"
    assert dp_endpoint("inproc://cache", 1) == "inproc://cache_dp1"
    assert dp_endpoint(None, 4) is None
    with pytest.raises(ConfigError, match=r"^--endpoint: tcp://host: expected tcp://HOST:PORT"):
        dp_endpoint("tcp://host", 1)
    with pytest.raises(ConfigError, match="65535"):
        dp_endpoint("tcp://h:65535", 1)
    # a port ZMQ cannot connect to, no host, an unclosed IPv6 bracket: refused before any socket
    for bad, why in (("tcp://h:99999", "outside 1..65535"), ("tcp://h:0", "outside 1..65535"),
                     ("tcp://:5557", "expected tcp://HOST:PORT"), ("tcp://[::1:5557", "expected tcp://HOST:PORT")):
        with pytest.raises(ConfigError, match=why):
            dp_endpoint(bad, 0)


def test_a_capture_duration_past_any_deadline_is_refused(tmp_path):
    """--duration 1e308 made the poll timeout int(inf) (an OverflowError traceback)."""
    from kvtrace.errors import ConfigError
    from kvtrace.instrument.vllm.capture import capture_vllm

    with pytest.raises(ConfigError, match=r"^--duration: 1e\+308: expected at most"):
        capture_vllm("tcp://127.0.0.1:5557", store_path=str(tmp_path / "c.duckdb"), duration=1e308)
    assert not (tmp_path / "c.duckdb").exists()


def test_capture_follows_every_dp_rank_with_its_own_sequence(tmp_path):
    """Two DP ranks, each its own publisher (vLLM's port + rank) counting seq from 0: the
    capture tracks each rank's sequence, recovers rank 1's gap from rank 1's replay socket,
    and files both into one run. Rank 1's payloads omit the rank (older vLLM), so the
    capture takes it from the endpoint."""
    from kvtrace.instrument.vllm import dp_endpoint
    from kvtrace.store import read
    from tests.instrument.vllm_publisher import dp_publishers

    pubs = dp_publishers(2)
    assert dp_endpoint(pubs[0].endpoint, 1) == pubs[1].endpoint
    assert dp_endpoint(pubs[0].replay_endpoint, 1) == pubs[1].replay_endpoint
    EventBatch, BlockStored, _, _ = CURRENT
    n = 10

    def batch(rank: int, k: int):
        h = lambda i: rank * 1_000 + i
        ev = BlockStored([h(k + 1)], h(k) if k else None, [k] * 4, 4, None, "GPU", None, group_idx=0)
        return EventBatch(1_700_000_000.0 + k * 0.01 + rank * 0.001, [ev], 0 if rank == 0 else None)

    received = [threading.Event(), threading.Event()]
    caps, done, result = [], threading.Event(), {}

    def on_ready(cap):
        rank = len(caps)
        caps.append(cap)
        cap.on_batch = lambda seq, b: received[rank].set()

    def capture():
        result["stats"] = capture_vllm(pubs[0].endpoint, pubs[0].replay_endpoint, dp_size=2,
                                       store_path=tmp_path / "dp.duckdb", topic="kv-events",
                                       trace_out=tmp_path / "dp.jsonl", should_stop=done.is_set, on_ready=on_ready)

    t = threading.Thread(target=capture)
    t.start()
    try:
        for rank, pub in enumerate(pubs):
            first = pub.publish(batch(rank, 0))
            deadline = time.monotonic() + 20
            while not received[rank].wait(0.05):
                assert time.monotonic() < deadline, f"rank {rank} never connected"
                pub.resend(first)
        for k in range(1, n):
            for rank, pub in enumerate(pubs):
                pub.publish(batch(rank, k), send=not (rank == 1 and k in (4, 5)))
        deadline = time.monotonic() + 20
        while len(caps) < 2 or min(c.stats.batches for c in caps) < n:
            assert time.monotonic() < deadline, [c.stats for c in caps]
            time.sleep(0.05)
    finally:
        done.set()
        t.join(30)
        for pub in pubs:
            pub.close()
    stats = result["stats"]
    assert (stats.batches, stats.gaps, stats.recovered, stats.lost) == (2 * n, 1, 2, 0)
    # (rank 1's gap; at the stop, each rank's tail from the last batch it received)
    assert (pubs[0].replay_requests, pubs[1].replay_requests) == ([9], [3, 9])
    rows = store_rows(tmp_path / "dp.duckdb", stats.run_id, "name, step, block_hashes, extra_attributes, "
                                                             "resource_attributes")
    for rank, pub in enumerate(pubs):
        mine = [r for r in rows if r["extra_attributes"]["kvtrace.vllm.dp_rank"] == str(rank)]
        assert {r["resource_attributes"]["kvtrace.vllm.endpoint"] for r in mine} == {pub.endpoint}
        assert sorted(r["step"] for r in mine if r["name"] == "kvtrace.engine.step") == list(range(n))
        stored = sorted((r["step"], r["block_hashes"]) for r in mine if r["name"] == "kvtrace.cache.publish")
        assert stored == [(k, [hash_hex(rank * 1_000 + k + 1)]) for k in range(n)]
    summary = read.run(tmp_path / "dp.duckdb", stats.run_id)["summary"]
    assert [(r["endpoint"], r["batches"], r["recovered"]) for r in summary["ranks"]] == [
        (pubs[0].endpoint, n, 0), (pubs[1].endpoint, n, 2)]
    # one reconstructed request per rank's chain, in arrival order
    reqs = [json.loads(x) for x in (tmp_path / "dp.jsonl").read_text().splitlines()[1:]]
    assert [len(r["hash_ids"]) for r in reqs] == [n, n]


# --- hostile batches, restarts, replay answers that do not decode, nothing received ---------------
def _capture_during(tmp_path, pub, body, until, replay: bool = True, name: str = "hostile.duckdb"):
    """Run ``capture_vllm`` on ``pub`` in a thread: seq 0 (a valid batch) is re-sent until the
    subscription is live, then ``body(pub)`` publishes; stops when ``until(capture)`` holds."""
    EventBatch, BlockStored, _, _ = LEGACY
    received, done, result, caps = threading.Event(), threading.Event(), {}, []

    def on_ready(cap):
        caps.append(cap)
        cap.on_batch = lambda seq, batch: received.set()

    def capture():
        result["stats"] = capture_vllm(pub.endpoint, pub.replay_endpoint if replay else None,
                                       store_path=tmp_path / name, topic="kv-events",
                                       should_stop=done.is_set, on_ready=on_ready)

    t = threading.Thread(target=capture)
    t.start()
    try:
        first = pub.publish(EventBatch(1_700_000_000.0, [BlockStored([1], None, [0] * 4, 4, None, "GPU", None)], 0))
        deadline = time.monotonic() + 20
        while not received.wait(0.05):
            assert time.monotonic() < deadline, "subscriber never connected"
            pub.resend(first)
        body(pub)
        deadline = time.monotonic() + 20
        while not until(caps[0]):
            assert time.monotonic() < deadline, caps[0].stats
            time.sleep(0.05)
    finally:
        done.set()
        t.join(30)
        pub.close()
    return result["stats"]


def _raw_batch(ts, block_size=4, token=1, extra_events=()) -> bytes:
    import msgspec

    return msgspec.msgpack.encode([ts, [["BlockStored", [7], 1, [token] * 4, block_size, None, "GPU"],
                                        *extra_events], 0])


def test_bad_batches_are_counted_once_logged_and_cost_no_other_batch(tmp_path, caplog):
    """NaN, inf and 1e30 timestamps, a block_size of 2^64-1, a token id past int64, garbage and
    a wrong frame count: each is one bad message; the valid batches around them are stored."""
    from kvtrace.store import read

    bad = [_raw_batch(float("nan")), _raw_batch(float("inf")), _raw_batch(1e30), _raw_batch(2.0, 2**64 - 1),
           _raw_batch(2.0, token=2**64 - 1), b"\xc1 not msgpack"]

    def body(pub):
        pub.publish_raw(_raw_batch(1.0))  # seq 1: valid
        for payload in bad:  # seqs 2..7
            pub.publish_raw(payload)
        pub.pub.send_multipart((b"kv-events", b"\x00" * 8))  # two frames: not a batch at all
        pub.publish_raw(_raw_batch(3.0, extra_events=[["BlockMigrated", [1]]]))  # seq 8: valid, 1 unknown event

    with caplog.at_level("WARNING", logger="kvtrace.instrument.vllm.capture"):
        stats = _capture_during(tmp_path, pub := VllmPublisher(), body,
                                lambda cap: cap.stats.batches + cap.stats.bad_messages >= 10)
    assert pub.replay_requests == [8]  # (no gap asked for: only the stop's tail, from the last batch received)
    assert (stats.batches, stats.bad_messages, stats.lost, stats.gaps, stats.unknown_events) == (3, 7, 0, 0, 1)
    assert len([r for r in caplog.records if "bad message" in r.getMessage()]) == 1
    rows = store_rows(tmp_path / "hostile.duckdb", stats.run_id, "name, step, start_ns")
    assert sorted(r["step"] for r in rows if r["name"] == "kvtrace.engine.step") == [0, 1, 8]
    run = read.run(tmp_path / "hostile.duckdb", stats.run_id)
    assert run["status"] == "complete"
    assert (run["summary"]["bad_messages"], run["summary"]["unknown_events"], run["summary"]["restarts"]) == (7, 1, 0)
    assert run["summary"]["nothing_received"] is False


def test_a_replay_answer_that_does_not_decode_counts_as_lost(tmp_path):
    EventBatch, BlockStored, _, _ = LEGACY

    def body(pub):
        pub.publish_raw(b"\xc1 garbage", send=False)  # seq 1: dropped live, garbage in the replay buffer
        pub.publish(EventBatch(1_700_000_002.0, [BlockStored([2], 1, [1] * 4, 4, None, "GPU", None)], 0), send=False)
        pub.publish(EventBatch(1_700_000_003.0, [BlockStored([3], 2, [2] * 4, 4, None, "GPU", None)], 0))

    stats = _capture_during(tmp_path, pub := VllmPublisher(), body, lambda cap: cap.stats.batches >= 3)
    assert pub.replay_requests == [0, 3]  # (the gap; the stop's tail, from the last batch received)
    assert (stats.gaps, stats.recovered, stats.lost, stats.bad_messages, stats.batches) == (1, 1, 1, 1, 3)


def test_a_publisher_restart_keeps_steps_unique(tmp_path):
    """A restarted publisher counts from 0 again: counted as a restart (not duplicates), and
    its batches get steps after the first lifetime's."""
    from kvtrace.store import read

    EventBatch, BlockStored, _, _ = LEGACY
    mk = lambda life, k: EventBatch(1_700_000_000.0 + life * 100 + k, [
        BlockStored([life * 100 + k + 1], None, [k] * 4, 4, None, "GPU", None)], 0)

    def body(pub):
        for k in range(1, 4):  # seqs 1..3 of the first lifetime (PUB/SUB keeps their order)
            pub.publish(mk(0, k))
        with pub._lock:  # the restart: a new lifetime, its counter and replay buffer from scratch
            pub.seq, pub.buffer = 0, []
        for k in range(3):
            pub.publish(mk(1, k))

    stats = _capture_during(tmp_path, VllmPublisher(), body, lambda cap: cap.stats.batches >= 7)
    # (duplicates: seq 0 re-sent until the SUB joined, as many as a loaded box let queue; the
    # new lifetime's batches are not among them, as the 7 batches and their steps show)
    assert (stats.restarts, stats.lost, stats.batches) == (1, 0, 7)
    rows = store_rows(tmp_path / "hostile.duckdb", stats.run_id, "name, step, block_hashes")
    steps = sorted((r["step"], r["block_hashes"]) for r in rows if r["name"] == "kvtrace.cache.publish")
    assert [s for s, _ in steps] == list(range(7))
    assert [h for _, h in steps[4:]] == [[hash_hex(101)], [hash_hex(102)], [hash_hex(103)]]
    assert read.run(tmp_path / "hostile.duckdb", stats.run_id)["summary"]["restarts"] == 1


def test_a_restart_whose_new_seqs_passed_the_old_ones_unseen_is_a_restart(tmp_path):
    """The publisher restarted and the SUB missed its new lifetime's first batches, past the
    seq the old lifetime had reached: it read as a gap after the old sequence, whose
    recovery took the new lifetime's batches at those seqs; the new lifetime's earlier
    batches were never stored, nor counted lost, and no restart counted."""
    EventBatch, BlockStored, _, _ = LEGACY
    mk = lambda life, k: EventBatch(1_700_000_000.0 + life * 100 + k, [
        BlockStored([life * 100 + k + 1], None, [k] * 4, 4, None, "GPU", None)], 0)

    def body(pub):
        for k in range(1, 4):  # seqs 1..3 of the first lifetime
            pub.publish(mk(0, k))
        with pub._lock:  # the restart
            pub.seq, pub.buffer = 0, []
        for k in range(8):  # 0..5 published while the SUB was away (in the replay buffer only), then 6, 7
            pub.publish(mk(1, k), send=k >= 6)

    stats = _capture_during(tmp_path, VllmPublisher(), body, lambda cap: cap.stats.batches >= 12)
    assert (stats.restarts, stats.lost, stats.batches) == (1, 0, 12)
    rows = store_rows(tmp_path / "hostile.duckdb", stats.run_id, "name, step, block_hashes")
    steps = sorted((r["step"], r["block_hashes"]) for r in rows if r["name"] == "kvtrace.cache.publish")
    assert [s for s, _ in steps] == list(range(12))
    assert [h for _, h in steps[4:]] == [[hash_hex(101 + k)] for k in range(8)]


def _send_seq(pub, seq: int, payload: bytes) -> None:
    """One message at ``seq``, whatever the publisher's counter says (a hostile sender)."""
    pub.pub.send_multipart((pub.topic, seq.to_bytes(8, "big"), payload))


def _stored_steps(tmp_path, stats) -> list[int]:
    """The steps of the engine-step spans a ``_capture_during`` run stored, in order."""
    rows = store_rows(tmp_path / "hostile.duckdb", stats.run_id, "name, step")
    return sorted(r["step"] for r in rows if r["name"] == "kvtrace.engine.step")


def test_a_seq_beyond_int64_or_years_ahead_is_one_bad_message(tmp_path):
    """seq 2^64-1 (a valid batch), then 2^62 after 0, used to make every later batch a bad
    message (steps past int64) or count 2^62 batches lost."""
    def body(pub):
        _send_seq(pub, 2**64 - 1, _raw_batch(1.0))
        _send_seq(pub, 2**62, _raw_batch(1.0))
        for _ in range(3):  # seqs 1..3
            pub.publish_raw(_raw_batch(2.0))

    stats = _capture_during(tmp_path, VllmPublisher(), body, lambda cap: cap.stats.batches >= 4)
    assert (stats.batches, stats.bad_messages, stats.lost, stats.restarts) == (4, 2, 0, 0)
    assert _stored_steps(tmp_path, stats) == [0, 1, 2, 3]


@pytest.mark.parametrize("replay", [True, False])
def test_one_stray_backwards_seq_is_a_bad_message_not_a_restart(tmp_path, replay):
    """seq 3 again, with another payload, amid 0..8: it used to be taken as a restart (9
    batches stored twice through replay, or 9 counted lost without it)."""
    def body(pub):
        for _ in range(5):  # seqs 1..5
            pub.publish_raw(_raw_batch(2.0))
        _send_seq(pub, 3, _raw_batch(9.0, token=9))
        for _ in range(3):  # seqs 6..8
            pub.publish_raw(_raw_batch(3.0))

    stats = _capture_during(tmp_path, VllmPublisher(), body, lambda cap: cap.stats.batches >= 9, replay=replay)
    assert (stats.batches, stats.bad_messages, stats.restarts, stats.lost, stats.recovered) == (9, 1, 0, 0, 0)
    assert _stored_steps(tmp_path, stats) == list(range(9))


def test_a_replay_socket_that_never_ends_its_answer_cannot_hold_the_capture(tmp_path):
    """Its answer is read for at most four replay timeouts (and the frames asked for, plus
    slack): the capture still stops at its --duration."""
    EventBatch, BlockStored, _, _ = LEGACY
    pub = VllmPublisher()
    pub.endless_replay = True
    pub.publish(EventBatch(1.0, [BlockStored([1], None, [0] * 4, 4, None, "GPU", None)], 0), send=False)
    ready, stop, started = threading.Event(), threading.Event(), []

    def publish() -> None:  # seq 1.. once the capture runs (a PUB drops what comes before a
        ready.wait(30)  # subscriber: a fixed delay lost them all on a loaded box): a gap at 0,
        while not stop.wait(0.05):  # asked of the endless replay socket
            pub.publish_raw(_raw_batch(2.0))

    publisher = threading.Thread(target=publish)
    publisher.start()
    duration = 3.0
    try:
        stats = capture_vllm(pub.endpoint, pub.replay_endpoint, store_path=tmp_path / "endless.duckdb",
                             topic="kv-events", duration=duration, replay_timeout_s=0.5,
                             on_ready=lambda cap: (started.append(time.monotonic()), ready.set()))
        ended = time.monotonic()
    finally:
        stop.set()
        ready.set()
        publisher.join(10)
        pub.close()
    assert ended - started[0] < duration + 4 * 0.5 + 3  # (from its start: it never returned)
    assert pub.replay_requests and stats.batches >= 1


def test_batches_queued_when_the_capture_stops_are_received_and_counted(tmp_path):
    """A 20,000-event batch keeps the capture busy while 300 more queue up; the stop comes
    meanwhile. The queued ones used to be neither stored nor counted."""
    def body(pub):
        big = _raw_batch(2.0, extra_events=[["BlockStored", [9 + i], 1, [1] * 4, 4, None, "GPU"]
                                            for i in range(20_000)])
        pub.publish_raw(big)
        for _ in range(300):
            pub.publish_raw(_raw_batch(3.0))
        time.sleep(0.3)  # (loopback delivers them into the SUB socket's queue)

    stats = _capture_during(tmp_path, VllmPublisher(), body, lambda cap: True)
    assert (stats.batches, stats.lost, stats.bad_messages) == (302, 0, 0)
    assert _stored_steps(tmp_path, stats) == list(range(302))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nothing_received_warns_marks_the_run_and_exits_1_when_nothing_listened(tmp_path):
    """No publisher at the endpoint: a warning, the run's summary says nothing_received, exit 1.
    A publisher reached that publishes nothing (an idle server): the same mark, exit 0."""
    import subprocess
    import sys

    from kvtrace.store import read

    db = tmp_path / "none.duckdb"
    cmd = [sys.executable, "-m", "kvtrace.cli", "capture", "vllm", "--db", str(db), "--duration", "1"]
    dead = subprocess.run([*cmd, "--endpoint", f"tcp://127.0.0.1:{_free_port()}"], capture_output=True, text=True,
                          timeout=120, check=False)
    pub = VllmPublisher()
    try:
        idle = subprocess.run([*cmd, "--endpoint", pub.endpoint], capture_output=True, text=True, timeout=120,
                              check=False)
    finally:
        pub.close()
    assert dead.returncode == 1, dead.stderr
    assert "nothing received in run r1: its SUB socket never reached" in dead.stderr
    assert "NOTHING RECEIVED" in dead.stderr and "Traceback" not in dead.stderr
    assert idle.returncode == 0, idle.stderr
    assert "nothing received in run r2: connected, but the server published no KV events" in idle.stderr
    for run_id, connected in (("r1", 0), ("r2", 1)):
        run = read.run(db, run_id)
        assert run["status"] == "complete"
        assert run["summary"]["nothing_received"] is True and run["summary"]["connected"] == connected


def test_capture_stopped_by_sigterm_finishes_its_run(tmp_path):
    import signal
    import subprocess
    import sys

    from kvtrace.store import read

    db = tmp_path / "term.duckdb"
    pub = VllmPublisher()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "kvtrace.cli", "capture", "vllm", "--db", str(db),
                                 "--endpoint", pub.endpoint], stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not (db.exists() and read.runs(db).height):  # the run exists: the capture is up
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        pub.close()
    assert proc.returncode in (0, 1), err  # 1 if the signal came before the SUB socket reached the publisher
    assert "kvtrace capture vllm: 0 batches" in err and "Traceback" not in err
    assert read.run(db, "r1")["status"] == "complete"  # not left incomplete: summarised and finished


def test_a_restart_years_into_a_lifetime_is_a_bad_message_not_2_to_the_40_lost():
    """First contact at seq 2^40 (accepted: nothing before it is counted lost), then two
    messages just below it: taken as a restart, they counted 2^40 batches lost."""
    from kvtrace.instrument.vllm.capture import VllmKVCapture

    cap = VllmKVCapture("tcp://127.0.0.1:1", replay_timeout_s=0.01)  # no publisher: messages handed in
    try:
        for seq, ts in ((2**40, 1.0), (2**40 - 5, 2.0), (2**40 - 4, 3.0)):
            cap.receive([b"kv", seq.to_bytes(8, "big"), _raw_batch(ts)])
    finally:
        cap.close()
    assert (cap.stats.batches, cap.stats.restarts, cap.stats.lost, cap.stats.bad_messages) == (1, 0, 0, 2)


def _feed(seqs, **kw):
    from kvtrace.instrument.vllm.capture import VllmKVCapture

    cap = VllmKVCapture("tcp://127.0.0.1:1", replay_timeout_s=0.01, **kw)  # no publisher: messages handed in
    steps = []
    cap.on_batch = lambda seq, batch: steps.append(seq)
    try:
        for i, seq in enumerate(seqs):
            cap.receive([b"kv", seq.to_bytes(8, "big"), _raw_batch(float(i + 1), token=i + 1)])
    finally:
        cap.close()
    s = cap.stats
    return (s.batches, s.restarts, s.lost, s.gaps, s.bad_messages), steps, cap


def test_a_stray_seq_ahead_is_a_bad_message_not_a_gap():
    """A stray seq 102 after 0..2 was taken as a gap (99 counted lost); the old sequence
    then read as a restart, which re-stored 0..2 from the replay buffer."""
    counts, seqs, _ = _feed([0, 1, 2, 102, 3, 4, 5])
    assert counts == (6, 0, 0, 0, 1)
    assert seqs == [0, 1, 2, 3, 4, 5]


def test_a_real_gap_is_recovered_once_the_next_message_follows_it():
    counts, seqs, _ = _feed([0, 1, 2, 5, 6])
    assert counts == (5, 0, 2, 1, 0)  # 3 and 4 lost (no replay socket here)
    assert seqs == [0, 1, 2, 5, 6]
    counts, seqs, _ = _feed([0, 1, 5])  # the publisher went quiet after the gap: taken as one at the end
    assert counts == (3, 0, 3, 1, 0) and seqs == [0, 1, 5]


def test_a_stray_first_message_far_ahead_costs_no_later_batch():
    """A first message at seq 2^63-1, then 0..9: the restart's steps began past int64 and
    every later batch was a bad message."""
    counts, seqs, _ = _feed([2**63 - 1, *range(10)])
    assert counts[0] == 10 and counts[4] == 1
    assert seqs == list(range(10))
    counts, seqs, cap = _feed([2**62, *range(5)])  # in range: stored, and the restart's steps still fit
    assert counts[:2] == (6, 1) and seqs == [2**62, *range(5)]
    assert cap._next_step == 2**62 + 6  # (steps 2^62, then 2^62 + 1 .. 2^62 + 5)


def test_a_message_past_the_size_limit_is_a_bad_message_never_decoded(tmp_path):
    """A 20 MB batch was decoded whole (1.2 GB of memory)."""
    import msgspec

    from kvtrace.instrument.vllm.capture import MAX_MESSAGE_BYTES

    tokens = [1] * (MAX_MESSAGE_BYTES + 64)
    huge = msgspec.msgpack.encode([2.0, [["BlockStored", [9], None, tokens, 4, None, "GPU"]], 0])

    def body(pub):
        pub.publish_raw(huge)  # seq 1 (the replay socket's answer is as large: lost)
        for _ in range(3):  # seqs 2..4
            pub.publish_raw(_raw_batch(3.0))

    stats = _capture_during(tmp_path, VllmPublisher(), body, lambda cap: cap.stats.batches >= 4)
    assert (stats.batches, stats.bad_messages, stats.gaps, stats.lost) == (4, 1, 1, 1)
    assert _stored_steps(tmp_path, stats) == [0, 2, 3, 4]


def test_a_replay_answer_longer_than_the_gap_is_read_to_its_end(tmp_path):
    """vLLM answers a replay request with every batch it holds from the seq asked, not only
    the gap's. Read only 64 frames past the gap, the answer's tail and end marker stayed on
    the socket, and that stale end marker ended the next recovery at once: its batches lost."""
    import zmq

    from kvtrace.instrument.vllm.capture import VllmKVCapture
    from kvtrace.instrument.vllm.wire import END_SEQ

    held = {s: _raw_batch(float(s + 1), token=s + 1) for s in range(400)}  # the publisher's buffer
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            if not router.poll(50):
                continue
            ident, _, first = router.recv_multipart()
            start = int.from_bytes(first, "big")
            for s in range(start, len(held)):  # everything from there, as vLLM does
                if s == start + 100:
                    time.sleep(0.3)  # (a busy server: the tail comes later)
                router.send_multipart([ident, b"", s.to_bytes(8, "big"), held[s]])
            router.send_multipart([ident, b"", END_SEQ, b""])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    cap = VllmKVCapture("tcp://127.0.0.1:1", replay_endpoint=f"tcp://127.0.0.1:{port}", replay_timeout_s=2)
    try:
        for seq in (0, 10, 11, 20, 21):  # two gaps: 1..9, then 12..19 (each answer runs to seq 399)
            cap.receive([b"kv", seq.to_bytes(8, "big"), held[seq]])
    finally:
        cap.close()
        stop.set()
        t.join(5)
        router.close(0)
        ctx.term()
    assert (cap.stats.batches, cap.stats.gaps, cap.stats.recovered, cap.stats.lost) == (22, 2, 17, 0)


def test_batches_still_queued_after_the_drain_are_counted_lost_not_dropped(tmp_path, monkeypatch):
    """Batches that take long to decode left most of the queue unread when the drain's
    time ran out: 15 of 20 neither stored nor counted, the run complete with 0 lost."""
    from kvtrace.instrument.vllm import capture

    monkeypatch.setattr(capture, "DRAIN_S", 0.0)  # (the drain's time already spent)
    receive = capture.VllmKVCapture.receive

    def slow_receive(self, frames):  # a batch that takes 20 ms to decode
        time.sleep(0.02)
        receive(self, frames)

    monkeypatch.setattr(capture.VllmKVCapture, "receive", slow_receive)

    def body(pub):
        for _ in range(300):
            pub.publish_raw(_raw_batch(3.0))
        time.sleep(0.3)

    stats = _capture_during(tmp_path, VllmPublisher(), body, lambda cap: True)
    assert stats.lost > 0 and stats.batches + stats.lost == 301, stats


def test_the_chain_depth_table_is_bounded_oldest_first(monkeypatch):
    """A publisher that never sends BlockRemoved grew it by about 130 MB a million hashes."""
    from kvtrace.instrument.ids import SeededIdGenerator
    from kvtrace.instrument.vllm import rows
    from kvtrace.instrument.vllm.wire import BLOCK_STORED, KVEventBatch

    monkeypatch.setattr(rows, "MAX_TRACKED_BLOCKS", 4)
    r = rows.VllmSpanRows(SeededIdGenerator(0), {})
    r.add(0, KVEventBatch(1.0, [KVEvent(BLOCK_STORED, ["a", "b", "c"], None, block_size=16)]))
    r.add(1, KVEventBatch(2.0, [KVEvent(BLOCK_STORED, ["d", "e"], "c", block_size=16)]))
    assert list(r.depth) == ["b", "c", "d", "e"]  # "a" went first
    r.add(2, KVEventBatch(3.0, [KVEvent(BLOCK_STORED, ["f"], "a", block_size=16),  # a forgotten parent
                                KVEvent(BLOCK_STORED, ["g"], "e", block_size=16)]))
    assert len(r.depth) == 4 and r.depth["g"][0] == 6  # (blocks from the root)
    tokens = r.take().column("num_tokens").to_pylist()
    assert tokens[-3:] == [None, None, 96]  # (step, f, g of the last batch)


def test_a_batch_of_more_values_than_a_step_publishes_is_refused_before_they_are_read():
    """15M one-byte hashes in a 15 MB batch held the capture 47 s and 3.5 GB (each became a
    hex string first), deaf to Ctrl-C; a bad message now, at the cap, however it nests."""
    import msgspec

    from kvtrace.instrument.vllm.wire import MAX_BATCH_ELEMENTS, VllmWireError

    n = MAX_BATCH_ELEMENTS
    ok = msgspec.msgpack.encode([1.0, [["BlockStored", [1] * (n - 1), None, [], 16]]])
    assert len(decode_kv_batch(ok)[0].events[0].block_hashes) == n - 1  # one event + n - 1 hashes: at the cap
    for doc in ([1.0, [["BlockStored", [1] * n, None, [], 16]]],
                [1.0, [["BlockStored", [1], None, [0] * n, 16]]],  # token ids count too
                {"ts": 1.0, "events": [{"type": "BlockRemoved", "block_hashes": [1] * n}]},
                [1.0, [["BlockRemoved", [1] * (n // 4)]] * 5]):  # over several events
        with pytest.raises(VllmWireError, match=f"more than {n:,} in one batch"):
            decode_kv_batch(msgspec.msgpack.encode(doc))


def test_a_batch_of_more_events_than_a_step_publishes_is_refused_before_any_is_decoded():
    """2M events of seven empty arrays each (16 MiB) were 16M objects, 8-17 s and 1.2 GB,
    decoded whole before the batch was refused, the capture deaf to Ctrl-C meanwhile; the
    events array's header now says there are too many before one is read."""
    import tracemalloc

    import msgspec

    from kvtrace.instrument.vllm.wire import MAX_BATCH_EVENTS, VllmWireError

    ok = msgspec.msgpack.encode([1.0, [["AllBlocksCleared"]] * MAX_BATCH_EVENTS])
    assert len(decode_kv_batch(ok)[0].events) == MAX_BATCH_EVENTS
    event = ["BlockStored", [], None, [], 16, None, [], [], [], [], []]
    payload = msgspec.msgpack.encode({"ts": 1.0, "events": [event] * (1 << 20)})
    tracemalloc.start()
    try:
        with pytest.raises(VllmWireError, match=f"more than {MAX_BATCH_EVENTS:,} events in one batch"):
            decode_kv_batch(payload)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak  # nothing of the events was built (decoded whole: about 600 MB)


@pytest.mark.parametrize("doc, needle", [
    (5, "expected [ts, events, dp_rank] or a map"),
    ({1: 2}, "expected [ts, events, dp_rank] or a map"),
    ([1.0], "expected [ts, events, dp_rank] or a map"),
    ([1.0, {"a": 1}], "events must be a list, got dict"),
    ({"ts": 1.0}, "events must be a list, got NoneType"),
    ([1.0, [{"block_hashes": [1]}]], "a map whose type is None, not an event kind"),
    ([1.0, [{"type": 7}]], "a map whose type is 7, not an event kind"),
    # (map forms had no field cap: 1.5M keys were decoded, 350 MB; the array form's was told as a type)
    ({"ts": 1.0, "events": [], **{f"k{i}": 1 for i in range(100)}}, "or a map of string keys: more than 64 fields"),
    ([1.0, [{"type": "BlockStored", **{f"k{i}": 1 for i in range(100)}}]], "got more than 64 fields"),
    ([1.0, [["BlockStored", *[None] * 80]]], "got more than 64 fields"),
    ([1.0, [{1: 2}]], "got a map keyed by other than strings"),
])
def test_a_batch_that_is_no_event_batch_says_what_it_is(doc, needle):
    import msgspec

    from kvtrace.instrument.vllm.wire import VllmWireError

    with pytest.raises(VllmWireError) as info:
        decode_kv_batch(msgspec.msgpack.encode(doc))
    assert needle in str(info.value)

@contextlib.contextmanager
def _queued_at_the_stop(seqs):
    """A capture that accepted seq 0, with ``seqs`` queued on its SUB socket undecoded (a
    publisher of its own); closed, with the publisher, when the block ends."""
    from kvtrace.instrument.vllm.capture import VllmKVCapture

    pub = zmq.Context.instance().socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    cap = VllmKVCapture(f"tcp://127.0.0.1:{port}", replay_timeout_s=0.01)
    try:
        cap.receive([b"kv", (0).to_bytes(8, "big"), _raw_batch(1.0)])  # seq 0: accepted
        time.sleep(0.5)  # (the subscription reaches the publisher)
        for seq in seqs:
            pub.send_multipart([b"kv", seq.to_bytes(8, "big"), _raw_batch(float(seq))])
        deadline = time.monotonic() + 10
        while not cap.socket.poll(0) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # (the rest queued behind the first)
        yield cap
    finally:
        cap.close()
        pub.close(0)


def test_batches_discarded_at_the_stop_count_the_seqs_between_them(monkeypatch):
    """Seqs 2, 4, ..., 20 still queued at the stop (the replay socket dead, the drain over):
    10 messages taken off undecoded were counted 10 lost, where 20 seqs after 0 were never
    stored (the odd ones were never received either)."""
    from kvtrace.instrument.vllm import capture as capture_module
    from kvtrace.instrument.vllm.capture import run_captures

    with _queued_at_the_stop(range(2, 21, 2)) as cap:
        monkeypatch.setattr(capture_module, "DRAIN_S", 0.0)  # nothing decoded after the stop
        run_captures([cap], should_stop=lambda: True)
    assert (cap.stats.batches, cap.stats.lost) == (1, 20)
    assert cap.lost_with_discarded(3, None) == 3  # (no seq read: the messages alone)


def test_a_short_seq_frame_is_named_as_such(caplog):
    """Three frames with a 2-byte seq were logged as 'got 3 frames', the frame count that is right."""
    from kvtrace.instrument.vllm.capture import VllmKVCapture

    cap = VllmKVCapture("tcp://127.0.0.1:1", replay_timeout_s=0.01)  # no publisher: messages handed in
    try:
        with caplog.at_level("WARNING", logger="kvtrace.instrument.vllm.capture"):
            cap.receive([b"kv", b"\x00\x01", _raw_batch(1.0)])
    finally:
        cap.close()
    assert cap.stats.bad_messages == 1
    assert any("got a 2-byte seq" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_a_flush_hands_the_store_one_chunk_however_many_batches_it_holds(tmp_path, monkeypatch):
    """Each batch was its own table, so a flush handed the store one Arrow chunk per batch:
    DuckDB and the store's family split then took about 2 ms a row (8,000 batches: 16 s),
    and a capture stopped amid a burst sat in that commit past any drain limit (SIGTERM
    waited over a minute, nothing stored). Batches queued while the first-contact replay ran
    are flushed together here."""
    from kvtrace.store.writer import Store

    chunks: list[int] = []  # per commit, the most chunks an insert handed DuckDB
    commit = Store._commit

    def spy(self, inserts):
        chunks.append(max(t.column(0).num_chunks for _, _, t in inserts))
        return commit(self, inserts)

    monkeypatch.setattr(Store, "_commit", spy)

    def body(pub):
        for _ in range(2_000):
            pub.publish_raw(_raw_batch(2.0))

    stats = _capture_during(tmp_path, VllmPublisher(), body, lambda cap: cap.stats.batches >= 2_001)
    assert (stats.batches, stats.lost, stats.bad_messages) == (2_001, 0, 0)
    assert _stored_steps(tmp_path, stats) == list(range(2_001))
    assert chunks and max(chunks) == 1, chunks


@contextlib.contextmanager
def _one_replay_answer(frames: list[tuple[int, bytes]]):
    """A replay socket (a ROUTER, as vLLM's) that answers the first request with ``frames``
    (seq, payload) at once, then the end marker; yields its endpoint."""
    from kvtrace.instrument.vllm.wire import END_SEQ

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def serve():
        if router.poll(10_000):
            ident, _, _ = router.recv_multipart()
            for s, payload in frames:
                router.send_multipart([ident, b"", s.to_bytes(8, "big"), payload])
            router.send_multipart([ident, b"", END_SEQ, b""])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        t.join(5)
        router.close(0)
        ctx.term()


def test_a_long_first_contact_answer_is_stored_as_it_comes(tmp_path):
    """First contact's replay answer is the publisher's whole buffer (thousands of batches,
    seconds to read): it was stored only once read to its end, so a kill meanwhile lost it
    all. Its batches are now stored whenever a flush is due (here: after each), in seq order,
    and one that comes out of order after the rest."""
    from kvtrace.instrument.vllm.capture import VllmKVCapture
    from kvtrace.store.writer import Store

    order = [*range(0, 20), 25, *range(20, 25), *range(26, 40)]  # 20..24 come after 25
    store = Store.open(tmp_path / "first.duckdb")
    run_id = store.create_run("capture")
    flushed_at: list[int] = []  # batches accepted by each commit
    commit = store.flush
    with _one_replay_answer([(s, _raw_batch(float(s + 1), token=s + 1)) for s in order]) as replay:
        cap = VllmKVCapture("tcp://127.0.0.1:1", replay_endpoint=replay, store=store, run_id=run_id,
                            replay_timeout_s=5, flush_interval_s=0)

        def counted():
            flushed_at.append(cap.stats.batches)
            return commit()

        store.flush = counted
        try:
            cap.receive([b"kv", (40).to_bytes(8, "big"), _raw_batch(41.0, token=41)])  # first contact at seq 40
        finally:
            cap.close()
            store.finish_run(run_id)
            store.close()
    assert (cap.stats.batches, cap.stats.recovered, cap.stats.lost) == (41, 40, 0)
    assert [n for n in flushed_at if n < 40][:3] == [1, 2, 3]  # committed while the answer was read
    rows = store_rows(tmp_path / "first.duckdb", run_id)
    steps = [r["step"] for r in rows if r["name"] == "kvtrace.engine.step"]  # (append order)
    assert sorted(steps) == list(range(41)) and steps[:21] == [*range(20), 25]


def test_storing_a_long_replay_answer_does_not_use_up_its_time(tmp_path):
    """Since the answer is stored as it comes, decoding and committing it ran against the
    answer's own time (four replay timeouts): a first contact's answer of 10,000 eight-event
    batches was cut after 8 s, 2,000 of its batches never stored and none counted lost.
    Here each commit is slow (the store's work, not the replay socket's), and every batch
    of the answer must still be stored."""
    from kvtrace.instrument.vllm.capture import VllmKVCapture
    from kvtrace.store.writer import Store

    n = 30
    store = Store.open(tmp_path / "slow.duckdb")
    run_id = store.create_run("capture")
    replay_timeout_s = 0.5  # the answer's time: 2 s, which the commits below take twice over
    commit = store.flush

    def slow_commit():
        time.sleep(4 * replay_timeout_s * 2 / n)
        return commit()

    # the whole answer at once, as vLLM sends it
    with _one_replay_answer([(s, _raw_batch(float(s + 1), token=s + 1)) for s in range(n)]) as replay:
        cap = VllmKVCapture("tcp://127.0.0.1:1", replay_endpoint=replay, store=store, run_id=run_id,
                            replay_timeout_s=replay_timeout_s, flush_interval_s=0)
        store.flush = slow_commit
        try:
            cap.receive([b"kv", n.to_bytes(8, "big"), _raw_batch(float(n + 1), token=n + 1)])  # first contact at n
        finally:
            cap.close()
            store.finish_run(run_id)
            store.close()
    assert (cap.stats.batches, cap.stats.recovered, cap.stats.lost) == (n + 1, n, 0)
    steps = [r["step"] for r in store_rows(tmp_path / "slow.duckdb", run_id) if r["name"] == "kvtrace.engine.step"]
    assert steps == list(range(n + 1))


def test_batches_the_publisher_no_longer_held_at_first_contact_are_counted(tmp_path):
    """First contact at seq 10 with a replay buffer holding 3..9: the 3 batches sent before
    the capture and dropped by the publisher were counted nowhere (not lost: never ours)."""
    from kvtrace.instrument.vllm.capture import VllmKVCapture, capture_report

    with _one_replay_answer([(s, _raw_batch(float(s + 1))) for s in range(3, 10)]) as replay:
        cap = VllmKVCapture("tcp://127.0.0.1:1", replay_endpoint=replay, replay_timeout_s=5)
        try:
            cap.receive([b"kv", (10).to_bytes(8, "big"), _raw_batch(11.0)])
        finally:
            cap.close()
    stats = cap.stats
    assert (stats.batches, stats.recovered, stats.lost, stats.missed_before_contact) == (8, 7, 0, 3)
    assert "3 missed before contact" in capture_report(stats)


def _nested_empties(n: int) -> bytes:
    """msgpack of [[] x n] (a one-byte empty array each)."""
    return b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n


@pytest.mark.parametrize("where", ["unread field", "ts", "past the envelope", "inside block_hashes"])
def test_a_batch_nesting_millions_of_arrays_is_never_built(where):
    """16M empty arrays inside one event's extra_keys, or as the ts, or after the envelope's
    third element were decoded whole (1.2 GB, seconds) where the element count looked one
    level down only (a393fa2): what is not read is skipped, a value deeper than its field can
    be is refused at its first array."""
    import tracemalloc

    import msgspec

    from kvtrace.instrument.vllm.wire import VllmWireError

    n = 4_000_000
    name, ts = msgspec.msgpack.encode("BlockStored"), msgspec.msgpack.encode(1.0)
    hashes = b"\x91\x01"
    if where == "inside block_hashes":
        hashes = b"\x91" + _nested_empties(n)
    # [tag, block_hashes, parent, token_ids, block_size, lora_id, medium, lora_name, extra_keys]
    extra = b"\x91" + _nested_empties(n) if where == "unread field" else b"\xc0"
    event = b"\x99" + name + hashes + b"\xc0\x90\x10\xc0\xc0\xc0" + extra
    if where == "ts":
        payload = b"\x93" + _nested_empties(n) + b"\x91" + event + b"\x00"
    elif where == "past the envelope":
        payload = b"\xdc" + (n + 3).to_bytes(2, "big") if n + 3 < 1 << 16 else (
            b"\xdd" + (n + 3).to_bytes(4, "big"))
        payload += ts + b"\x91" + event + b"\x00" + b"\x90" * n
    else:
        payload = b"\x93" + ts + b"\x91" + event + b"\x00"
    tracemalloc.start()
    try:
        if where == "unread field":
            batch, _ = decode_kv_batch(payload)
            assert batch.events[0].block_hashes == [hash_hex(1)]
        else:
            with pytest.raises(VllmWireError) as info:
                decode_kv_batch(payload)
            assert "\n" not in str(info.value)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak  # (decoded whole: hundreds of MB)


def test_the_stops_tail_is_not_asked_of_a_publisher_gone(tmp_path):
    """The stop's request for what followed the last batch (5b70a87) waited out a replay
    timeout for each DP rank whose server was gone: it is asked only of a publisher the SUB
    socket is still connected to."""

    def body(pub):
        pub.pub.close(0)  # the server's PUB socket gone; its replay socket still answers

    stats = _capture_during(tmp_path, pub := VllmPublisher(), body, lambda cap: not cap._linked, name="gone.duckdb")
    assert stats.batches == 1 and pub.replay_requests == []  # (no gap, and no tail asked of a server gone)


def test_every_ranks_tail_shares_one_replay_timeout(tmp_path):
    """Each rank's tail waited up to its own replay timeout: a replay socket that never
    answers held a stop of 8 ranks 16 s. The stop leaves every rank one timeout in all."""
    from kvtrace.instrument.vllm.capture import VllmKVCapture, run_captures

    ctx = zmq.Context()
    pubs, deaf = [], []
    try:
        for _ in range(2):
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            port = pub.bind_to_random_port("tcp://127.0.0.1")
            router = ctx.socket(zmq.ROUTER)  # (takes requests, answers none)
            router.setsockopt(zmq.LINGER, 0)
            rport = router.bind_to_random_port("tcp://127.0.0.1")
            pubs.append((pub, port))
            deaf.append((router, rport))
        caps = [VllmKVCapture(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}", replay_timeout_s=0.5,
                              dp_rank=rank) for rank, ((_, port), (_, rport)) in enumerate(zip(pubs, deaf))]
        batch = _raw_batch(1.0)
        sent = threading.Event()

        def publish():
            while not sent.is_set():
                for pub, _ in pubs:
                    pub.send_multipart([b"", (0).to_bytes(8, "big"), batch])
                time.sleep(0.02)

        sender = threading.Thread(target=publish)
        sender.start()
        try:
            run_captures(caps, should_stop=lambda: all(c.stats.batches for c in caps))
        finally:
            sent.set()
            sender.join()
        asked = [bool(router.poll(0)) for router, _ in deaf]
        assert [c.stats.batches > 0 for c in caps] == [True, True]
        assert asked == [True, False]  # (the first rank's tail took the whole timeout; the second not asked)
    finally:
        for cap in locals().get("caps", []):
            cap.close()
        for sock, _ in (*pubs, *deaf):
            sock.close(0)
        ctx.term()


def test_a_captures_summary_counts_its_published_and_evicted_blocks_as_every_view_does(tmp_path):
    """A live capture's summary counts messages and events, not blocks: the dashboard's Overview
    (and runs, diff) said evictions "–" beside an Evictions page charting the removals."""
    from kvtrace.store import read
    from kvtrace.store.read.summary import summary_with_spans

    stats, _ = _run_capture(tmp_path, CURRENT, True, drop=set())
    db = tmp_path / "live.duckdb"
    record = read.run(db, stats.run_id)
    assert "evictions" not in record["summary"]  # (what the capture stores: the case at hand)
    summary = summary_with_spans(db, stats.run_id, record["summary"])
    rows = store_rows(db, stats.run_id)
    evicted = sum(len(r["block_hashes"] or ()) for r in rows if r["name"] == "kvtrace.cache.evict")
    published = sum(len(r["block_hashes"] or ()) for r in rows if r["name"] == "kvtrace.cache.publish")
    assert (summary["publishes"], summary["evictions"]) == (published, evicted) and evicted >= 17
    assert summary["batches"] == 20 and sum(summary["evictions_by_reason"].values()) == evicted


def test_a_backlog_at_the_stop_is_taken_off_whole_and_counted(monkeypatch, caplog):
    """A backlog the discard's time bound could not read (1 s, ~150k messages, where a stop
    found 200k queued) left 6,173 batches in no count and the newest seq unseen. Here the
    clock runs 0.05 s a look, so the old bound took 20 messages of 200; the whole queue is
    taken now (its RCVHWM at most), and a queue outlasting the bound is said to."""
    from kvtrace.instrument.vllm import capture as capture_module
    from kvtrace.instrument.vllm.capture import run_captures

    with _queued_at_the_stop(range(1, 201)) as cap:
        monkeypatch.setattr(capture_module, "DRAIN_S", 0.0)  # nothing decoded after the stop
        ticks = iter(range(10**9))

        class FastClock:  # 0.05 s more at every look
            sleep = staticmethod(time.sleep)

            @staticmethod
            def monotonic() -> float:
                return next(ticks) * 0.05

        monkeypatch.setattr(capture_module, "time", FastClock)
        try:
            with caplog.at_level("WARNING", logger="kvtrace.instrument.vllm.capture"):
                run_captures([cap], should_stop=lambda: True)
        finally:
            monkeypatch.undo()  # (the real clock again for the close)
    assert (cap.stats.batches, cap.stats.lost) == (1, 200)
    assert not any("in no count" in r.getMessage() for r in caplog.records)


def test_a_queue_that_outlasts_the_discard_is_said_to(monkeypatch, caplog):
    """Batches still queued when the discard's time ran out were in no count, without a word."""
    from kvtrace.instrument.vllm import capture as capture_module
    from kvtrace.instrument.vllm.capture import run_captures

    with _queued_at_the_stop(range(1, 101)) as cap:
        monkeypatch.setattr(capture_module, "DRAIN_S", 0.0)
        monkeypatch.setattr(capture_module, "DISCARD_S", 0.0)  # (no time to take any off)
        with caplog.at_level("WARNING", logger="kvtrace.instrument.vllm.capture"):
            run_captures([cap], should_stop=lambda: True)
    said = [r.getMessage() for r in caplog.records if "in no count" in r.getMessage()]
    assert cap.stats.batches == 1 and len(said) == 1, [r.getMessage() for r in caplog.records]
