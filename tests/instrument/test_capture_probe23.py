"""The twenty-third session's probe of ``kvtrace capture vllm``: what a hybrid model's
server publishes (one BlockStored per KV cache group, every group with the same hashes at
its own block size, a BlockRemoved in one group while another still holds the block) is
stored and reconstructed as vLLM means it.

The expected numbers are computed independently of the capture: the events' hashes are
made from the prefix length they stand for (``_h``), so a publish's ``num_tokens`` must be
the prefix length of its last hash, and a request's prompt the prefix of its last block.
"""

from __future__ import annotations

import json
import warnings

import pytest

from kvtrace.instrument.arrow_columns import hash_hex
from kvtrace.instrument.ids import SeededIdGenerator
from kvtrace.instrument.vllm import ChainTracer, KVEvent, capture_vllm
from kvtrace.instrument.vllm.rows import VllmSpanRows
from kvtrace.instrument.vllm.wire import BLOCK_REMOVED, BLOCK_STORED, KVEventBatch
from tests.instrument.helpers import capture_batches, store_rows

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # requests' charset warning on import
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, ZmqEventPublisher
    from vllm.distributed.kv_events import KVEventBatch as VllmBatch

TOPIC = "kv"
T0 = 1_700_000_000.0


def _h(prefix_tokens: int, request: int = 0) -> int:
    """vLLM's hash of a prompt's first ``prefix_tokens`` tokens (request ``request``'s own
    tokens past its shared prefix: a distinct hash)."""
    return 10_000_000 * request + prefix_tokens


def _prefix_of(hash_text: str) -> int:
    return int(hash_text, 16) % 10_000_000


def _stored(ends: list[int], parent: int | None, block_size: int, group: int, kind: str,
            request: int = 0) -> BlockStored:
    """vLLM's BlockStored for the blocks ending at ``ends`` (prefix tokens), under ``parent``."""
    return BlockStored(block_hashes=[_h(p, request if p > 64 else 0) for p in ends],
                       parent_block_hash=None if parent is None else _h(parent, request if parent > 64 else 0),
                       token_ids=list(range(len(ends) * block_size)), block_size=block_size, lora_id=None,
                       medium="GPU", lora_name=None, group_idx=group, kv_cache_spec_kind=kind)


def _hybrid_batches() -> list[VllmBatch]:
    """A hybrid model: group 0 full attention in 16-token blocks, group 1 Mamba in 32-token
    blocks (both hashed every 16 tokens: group 1's hashes are every other one of group 0's).
    Request 0: a 64-token prompt, then 32 more (chunked prefill); group 1 then evicts the
    64-token block group 0 still holds; request 1 shares the 64-token prefix, 5 s later."""
    fa, mamba = "full_attention", "mamba"
    return [
        VllmBatch(ts=T0, events=[_stored([16, 32, 48, 64], None, 16, 0, fa), _stored([32, 64], None, 32, 1, mamba)]),
        VllmBatch(ts=T0 + 0.1, events=[_stored([80, 96], 64, 16, 0, fa), _stored([96], 64, 32, 1, mamba)]),
        VllmBatch(ts=T0 + 0.2, events=[BlockRemoved(block_hashes=[_h(64)], medium="GPU", group_idx=1)]),
        VllmBatch(ts=T0 + 5.0, events=[_stored([80], 64, 16, 0, fa, request=1)]),
    ]


def _as_kvtrace(batch: VllmBatch) -> KVEventBatch:
    """vLLM's batch as the capture decodes it (for the unit tests below)."""
    import msgspec

    from kvtrace.instrument.vllm import decode_kv_batch

    return decode_kv_batch(msgspec.msgpack.encode(batch))[0]


def test_a_hybrid_models_publishes_say_their_prefix_in_tokens_whatever_the_groups_block_size():
    rows = VllmSpanRows(SeededIdGenerator(0), {})
    for step, batch in enumerate(_hybrid_batches()):
        rows.add(step, _as_kvtrace(batch))
    table = rows.take()
    assert table is not None
    got = [(h[-1], n) for name, h, n in zip(table.column("name").to_pylist(), table.column("block_hashes").to_pylist(),
                                             table.column("num_tokens").to_pylist())
           if name == "kvtrace.cache.publish"]
    assert len(got) == 5
    for last_hash, num_tokens in got:  # the prefix the last block's hash stands for
        assert num_tokens == _prefix_of(last_hash), (last_hash, num_tokens)


def test_one_groups_block_removed_leaves_the_block_another_group_holds_a_parent():
    rows = VllmSpanRows(SeededIdGenerator(0), {})
    ev = lambda hashes, parent, group: KVEvent(BLOCK_STORED, hashes, parent, block_size=16, group_idx=group)
    rows.add(0, KVEventBatch(1.0, [ev(["a", "b"], None, 0), ev(["a", "b"], None, 1)]))
    rows.add(1, KVEventBatch(2.0, [KVEvent(BLOCK_REMOVED, ["b"], group_idx=1)]))
    rows.add(2, KVEventBatch(3.0, [ev(["c"], "b", 0)]))  # group 0 still holds b
    rows.add(3, KVEventBatch(4.0, [KVEvent(BLOCK_REMOVED, ["b"], group_idx=0)]))
    rows.add(4, KVEventBatch(5.0, [ev(["d"], "b", 0)]))  # nobody holds b now: its depth is forgotten
    table = rows.take()
    assert table is not None
    tokens = [n for name, n in zip(table.column("name").to_pylist(), table.column("num_tokens").to_pylist())
              if name == "kvtrace.cache.publish"]
    assert tokens == [32, 32, 48, None]


def test_a_hybrid_models_reconstructed_trace_has_each_request_once_with_its_prompt():
    tracer = ChainTracer()
    for batch in _hybrid_batches():
        for ev in _as_kvtrace(batch).events:
            tracer.add(round(batch.ts * 1e9), ev)
    chains = [tracer.chain(r.tail) for r in tracer.requests]
    assert [[_prefix_of(h) for h in c] for c in chains] == [[16, 32, 48, 64, 80, 96], [16, 32, 48, 64, 80]]
    assert [r.block_size for r in tracer.requests] == [16, 16]


def test_a_hybrid_model_captured_from_vllms_own_publisher_is_stored_and_rebuilt_as_it_was_sent(tmp_path):
    """End to end: vLLM 0.33's ZmqEventPublisher, kvtrace's capture, the store and the
    native trace, each checked against what was sent."""
    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)
    pub_ep, replay_ep = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    pub = ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=replay_ep, topic=TOPIC)
    sent = _hybrid_batches()
    stats = capture_batches(pub, pub_ep, replay_ep, sent, tmp_path, topic=TOPIC)
    assert (stats.batches, stats.events, stats.lost, stats.bad_messages, stats.requests) == (4, 6, 0, 0, 2)
    rows = store_rows(tmp_path / "s.duckdb", stats.run_id, "name, step, block_hashes, parent_block_hash, num_tokens, "
                                                          "block_size, group_id, kv_cache_spec_kind, evict_reason")
    publishes = [r for r in rows if r["name"] == "kvtrace.cache.publish"]
    sent_stored = [(k, ev) for k, b in enumerate(sent) for ev in b.events if isinstance(ev, BlockStored)]
    assert len(publishes) == len(sent_stored)
    for r, (k, ev) in zip(publishes, sent_stored):
        assert r["step"] == k and r["block_hashes"] == [hash_hex(h) for h in ev.block_hashes]
        assert r["parent_block_hash"] == (None if ev.parent_block_hash is None else hash_hex(ev.parent_block_hash))
        assert (r["group_id"], r["block_size"], r["kv_cache_spec_kind"]) == (ev.group_idx, ev.block_size,
                                                                             ev.kv_cache_spec_kind)
        assert r["num_tokens"] == ev.block_hashes[-1] % 10_000_000  # the prefix its last hash stands for
    # the cache's contents, folded from the stored spans and from what was sent: the same
    held: set = set()
    for r in rows:
        if r["name"] == "kvtrace.cache.publish":
            held |= {(r["group_id"], h) for h in r["block_hashes"]}
        elif r["name"] == "kvtrace.cache.evict":
            held -= {(r["group_id"], h) for h in r["block_hashes"]}
    want: set = set()
    for b in sent:
        for ev in b.events:
            keys = {(ev.group_idx, hash_hex(h)) for h in ev.block_hashes}
            want = want | keys if isinstance(ev, BlockStored) else want - keys
    assert held == want
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    reqs = [json.loads(x) for x in lines[1:]]
    assert [(r["input_length"], r["block_size"], r["arrival_ns"]) for r in reqs] == [(96, 16, 0), (80, 16, 5 * 10**9)]
    assert reqs[0]["hash_ids"][:4] == reqs[1]["hash_ids"][:4]  # the shared 64-token prefix


def test_each_dp_ranks_summary_counts_its_own_reconstructed_requests(tmp_path):
    """The run's summary said ``requests: 3`` and, for each rank, ``requests: 0``."""
    import duckdb

    from tests.instrument.vllm_publisher import CURRENT, dp_publishers

    EventBatch, Stored, _, _ = CURRENT
    pubs = dp_publishers(2)
    roots = [[1, 2], [3]]  # rank 0 stores two unrelated chains (two requests), rank 1 one
    try:
        for rank, pub in enumerate(pubs):
            for k, root in enumerate(roots[rank]):  # sent before the capture joins: asked of the replay socket
                pub.publish(EventBatch(T0 + 10 * k, [Stored([root * 100], None, [0] * 4, 4, None, "GPU", None)], rank),
                            send=False)
        caps: list = []
        stats = capture_vllm(pubs[0].endpoint, pubs[0].replay_endpoint, dp_size=2, store_path=tmp_path / "s.duckdb",
                             topic="kv-events", trace_out=tmp_path / "t.jsonl", on_ready=caps.append,
                             should_stop=lambda: len(caps) == 2 and all(c.stats.connected for c in caps))
    finally:
        for pub in pubs:
            pub.close()
    assert (stats.batches, stats.requests) == (3, 3)
    con = duckdb.connect(str(tmp_path / "s.duckdb"), read_only=True)
    try:
        summary = json.loads(con.execute("SELECT summary FROM runs WHERE run_id = ?", [stats.run_id]).fetchone()[0])
    finally:
        con.close()
    assert [r["requests"] for r in summary["ranks"]] == [2, 1]
    assert summary["requests"] == sum(r["requests"] for r in summary["ranks"])


def test_a_bytes_hash_longer_than_any_vllm_hash_is_a_bad_message():
    """A 1 MiB hash was stored whole and kept as a chain-depth key: fifteen a batch grew the
    capture by 30 MB a batch, to 1.5 GB after 40 (up to 2^21 keys)."""
    import msgspec
    import pytest

    from kvtrace.instrument.vllm import VllmWireError, decode_kv_batch
    from kvtrace.instrument.vllm.wire import MAX_HASH_BYTES

    def payload(block_hash: bytes, parent: bytes | None = None) -> bytes:
        return msgspec.msgpack.encode([T0, [["BlockStored", [block_hash], parent, [1], 16, None, "GPU", None]], 0])

    longest = b"\x07" * MAX_HASH_BYTES  # (vLLM's own are 32 bytes or 16)
    assert decode_kv_batch(payload(longest, longest))[0].events[0].block_hashes == [longest.hex()]
    with pytest.raises(VllmWireError, match=r"^vLLM KV event: block hash of 1,048,576 bytes"):
        decode_kv_batch(payload(b"\x07" * (1 << 20)))
    with pytest.raises(VllmWireError, match=rf"^vLLM KV event: parent_block_hash of {MAX_HASH_BYTES + 1} bytes"):
        decode_kv_batch(payload(longest, longest + b"\x00"))


def test_a_capture_without_a_trace_leaves_requests_unsaid_in_its_run(tmp_path):
    """``kvtrace runs`` listed a capture without --trace-out as 0 requests: the summary's
    ``requests`` counts the requests rebuilt for the trace, and none was rebuilt."""
    from typer.testing import CliRunner

    from kvtrace.cli import app
    from tests.instrument.vllm_publisher import CURRENT, VllmPublisher

    EventBatch, Stored, _, _ = CURRENT
    pub = VllmPublisher()
    try:
        pub.publish(EventBatch(T0, [Stored([1], None, [0] * 4, 4, None, "GPU", None)], 0), send=False)
        caps: list = []
        stats = capture_vllm(pub.endpoint, pub.replay_endpoint, store_path=tmp_path / "s.duckdb", topic="kv-events",
                             on_ready=caps.append, should_stop=lambda: bool(caps) and caps[0].stats.connected == 1)
    finally:
        pub.close()
    assert stats.batches == 1
    result = CliRunner().invoke(app, ["runs", "--db", str(tmp_path / "s.duckdb"), "--json"])
    assert result.exit_code == 0, result.output
    (run,) = json.loads(result.output)["runs"]
    assert run["requests"] is None


def test_distinct_group_indexes_past_64_share_one_bit_and_grow_nothing():
    rows = VllmSpanRows(SeededIdGenerator(0), {})
    events = [KVEvent(BLOCK_STORED, [f"h{g}"], None, block_size=16, group_idx=g) for g in range(10_000)]
    rows.add(0, KVEventBatch(1.0, events))
    assert len(rows._group_bits) == 63
    rows.add(1, KVEventBatch(2.0, [KVEvent(BLOCK_STORED, ["x"], "h9999", block_size=16, group_idx=9_999)]))
    table = rows.take()
    assert table is not None and table.column("num_tokens").to_pylist()[-1] == 32


@pytest.mark.parametrize("coarse_first", [False, True])
def test_a_hybrid_prompt_over_groups_of_other_block_sizes_is_one_request_of_its_length(coarse_first):
    """Groups of 16- and 32-token blocks: a coarse block's hash is the fine block's ending
    where it ends, so one chain of both ran on through the other's parents: a 48-token
    prompt came out as 48 and 64 tokens, or (the coarse group's event first) 32 and 32."""
    from kvtrace.instrument.vllm.reconstruct import native_requests


    def stored(ends, parent, size, group):
        return KVEvent(BLOCK_STORED, [f"h{e}" for e in ends], None if parent is None else f"h{parent}",
                       block_size=size, group_idx=group, kv_cache_spec_kind="full_attention")

    first = [stored([16, 32, 48], None, 16, 0), stored([32], None, 32, 1)]
    later = [stored([64, 80], 48, 16, 0), stored([64], 32, 32, 1)]  # (the next chunk, 2 s on: another request)
    tracer = ChainTracer()
    for t_ns, events in ((0, first), (2_000_000_000, later)):
        for ev in reversed(events) if coarse_first else events:
            tracer.add(t_ns, ev)
    requests, block_size = native_requests([tracer])
    assert block_size == 16
    assert [(r.input_length, r.hash_block_size, len(r.hash_ids)) for r in requests] == [(48, 16, 3), (80, 16, 5)]
