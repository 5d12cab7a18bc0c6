"""The twenty-fifth session's probe of ``kvtrace capture vllm``: a server that offloads KV
blocks to a second tier (vLLM 0.33's OffloadingConnector, SimpleCPUOffload, Mooncake's store)
publishes that tier's ``BlockStored`` / ``BlockRemoved`` in the same stream as the GPU's,
``medium`` naming the tier ("CPU", "STORAGE"). A block copied to the CPU is no new request's
prompt, and the CPU dropping its copy does not take the block off the GPU.

The expected numbers are computed independently of the capture: each hash is the prefix
length, in tokens, that its block ends (``_h``), so a publish's ``num_tokens`` must be the
prefix of its last hash and a rebuilt request's prompt the prefix of its last block.
"""

from __future__ import annotations

import logging
import warnings

import msgspec

from kvtrace.instrument.ids import SeededIdGenerator
from kvtrace.instrument.vllm import ChainTracer, KVEvent, decode_kv_batch
from kvtrace.instrument.vllm.reconstruct import native_requests
from kvtrace.instrument.vllm.rows import VllmSpanRows
from kvtrace.instrument.vllm.wire import BLOCK_STORED, MEDIUM_KEY_CHARS, KVEventBatch
from kvtrace.workload.native import read_header, read_native
from tests.instrument.helpers import capture_batches, store_rows

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # requests' charset warning on import
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, ZmqEventPublisher
    from vllm.distributed.kv_events import KVEventBatch as VllmBatch

T0 = 1_700_000_000.0
BS = 16


def _h(prefix_tokens: int) -> int:
    return prefix_tokens  # (the hash of the prompt's first ``prefix_tokens`` tokens)


def _stored(ends: list[int], parent: int | None, medium: str = "GPU", placeholder: bool = False) -> BlockStored:
    """The BlockStored of the blocks ending at ``ends`` under ``parent``; ``placeholder``: the
    OffloadingConnector's for a block whose metadata it lacks (no parent, tokens or size)."""
    if placeholder:
        return BlockStored(block_hashes=[_h(e) for e in ends], parent_block_hash=None, token_ids=[], block_size=0,
                           lora_id=None, medium=medium, lora_name=None, group_idx=0)
    return BlockStored(block_hashes=[_h(e) for e in ends], parent_block_hash=None if parent is None else _h(parent),
                       token_ids=list(range(len(ends) * BS)), block_size=BS, lora_id=None, medium=medium,
                       lora_name=None, group_idx=0, kv_cache_spec_kind="full_attention")


def _offloading_batches() -> list[VllmBatch]:
    """Request A: a 64-token prompt on the GPU; 2 s on its first three blocks are offloaded to
    the CPU (in two stores, the second a placeholder), and the CPU drops its copy of the
    48-token block; 2 s on again request B extends A's prompt on the GPU by two blocks; the
    GPU evicts B's last three blocks, and C stores A's last block again."""
    return [
        VllmBatch(ts=T0, events=[_stored([16, 32, 48, 64], None)]),
        VllmBatch(ts=T0 + 2.0, events=[_stored([16, 32], None, "CPU"), _stored([48], None, "CPU", placeholder=True)]),
        VllmBatch(ts=T0 + 2.1, events=[BlockRemoved(block_hashes=[_h(48)], medium="CPU", group_idx=0)]),
        VllmBatch(ts=T0 + 4.0, events=[_stored([80], 64), _stored([96], 80)]),
        VllmBatch(ts=T0 + 5.0, events=[BlockRemoved(block_hashes=[_h(96), _h(80), _h(64)], medium="GPU", group_idx=0)]),
        VllmBatch(ts=T0 + 6.0, events=[_stored([64], 48)]),  # (C: A's prompt again, under the block the GPU holds)
    ]


def _decoded(batch: VllmBatch):
    return decode_kv_batch(msgspec.msgpack.encode(batch))[0]


def _publish_tokens(table) -> list[tuple[int, int | None]]:
    return [(int(h[-1], 16), n) for name, h, n in zip(table.column("name").to_pylist(),
                                                      table.column("block_hashes").to_pylist(),
                                                      table.column("num_tokens").to_pylist())
            if name == "kvtrace.cache.publish" and n is not None]


def test_a_cpu_tiers_copies_leave_every_gpu_publish_its_prefix_in_tokens():
    """The CPU's placeholder store (no parent) set the 48-token block's depth to one block, and
    the CPU's BlockRemoved forgot the block the GPU still held: C's publish said 32 tokens, or none."""
    rows = VllmSpanRows(SeededIdGenerator(0), {})
    for step, batch in enumerate(_offloading_batches()):
        rows.add(step, _decoded(batch))
    table = rows.take()
    assert table is not None
    got = _publish_tokens(table)
    assert [h for h, _ in got] == [64, 32, 80, 96, 64]  # (every publish with a prefix, the placeholder's none)
    for last_hash, num_tokens in got:
        assert num_tokens == last_hash, (last_hash, num_tokens)


def test_a_block_copied_to_the_cpu_is_no_request_of_the_rebuilt_trace():
    """The CPU's copies were chained with the GPU's stores: two requests more than were
    served (a 32-token and a 16-token prompt, 2 s after A)."""
    tracer = ChainTracer()
    for batch in _offloading_batches():
        for ev in _decoded(batch).events:
            tracer.add(round(batch.ts * 1e9), ev)
    requests, block_size = native_requests([tracer])
    assert block_size == BS
    assert [(r.arrival_ns, r.input_length) for r in requests] == [(0, 64), (4_000_000_000, 96), (6_000_000_000, 64)]


def test_an_offloading_servers_capture_is_stored_and_rebuilt_from_its_gpu_tier(tmp_path):
    """End to end through vLLM 0.33's own ZmqEventPublisher: the store's num_tokens and the
    written trace, each against the prefixes the hashes stand for."""
    logging.getLogger("vllm").setLevel(logging.ERROR)
    pub = ZmqEventPublisher(0, endpoint=f"ipc://{tmp_path}/pub", replay_endpoint=f"ipc://{tmp_path}/replay",
                            topic="kv")
    sent = _offloading_batches()
    stats = capture_batches(pub, f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay", sent, tmp_path)
    assert (stats.batches, stats.lost, stats.bad_messages) == (len(sent), 0, 0)
    rows = store_rows(tmp_path / "s.duckdb", stats.run_id, "name, block_hashes, num_tokens, medium")
    gpu = [(int(r["block_hashes"][-1], 16), r["num_tokens"]) for r in rows
           if r["name"] == "kvtrace.cache.publish" and r["medium"] == "GPU"]
    assert [n for _, n in gpu] == [h for h, _ in gpu] == [64, 80, 96, 64]
    assert read_header(str(tmp_path / "t.jsonl"))["block_size"] == BS
    requests = list(read_native(str(tmp_path / "t.jsonl")))
    assert [r.input_length for r in requests] == [64, 96, 64]



def test_a_stream_of_long_distinct_media_keeps_no_more_than_their_first_characters():
    """Tiers are told apart by ``medium``: each distinct one, up to a message's 16 MiB, was kept
    whole once per tier and group (63 of them in the rows, 64 in the tracer: a gigabyte)."""
    events = [KVEvent(BLOCK_STORED, [f"h{i}"], None, [0] * BS, BS, medium=f"{i:03}" + "x" * 100_000, group_idx=0)
              for i in range(100)]
    rows = VllmSpanRows(SeededIdGenerator(0), {})
    rows.add(0, KVEventBatch(T0, events))
    tracer = ChainTracer()
    for ev in events:
        tracer.add(0, ev)
    kept = [medium for medium, _ in rows._group_bits] + [medium for _, medium, _ in tracer._groups]
    assert len(kept) == 63 + 64 and max(len(m or "") for m in kept) == MEDIUM_KEY_CHARS


def test_a_coarse_groups_partial_tail_entries_do_not_make_it_the_group_the_trace_is_read_from():
    """vLLM 0.33 keys a prompt's tail inside a coarse group's block (``cache_partial_block``):
    a BlockStored of one hash-block (16 tokens) under the hash 16 tokens before it. The
    group's smallest block size then tied with the fine group's, the lower index won, and a
    100-token prompt came out as two requests, of 64 and of 32 tokens (two block sizes)."""
    coarse = [KVEvent(BLOCK_STORED, ["h64"], None, list(range(64)), 64, medium="GPU", group_idx=0),
              KVEvent(BLOCK_STORED, ["h96"], "h80", list(range(16)), BS, medium="GPU", group_idx=0)]
    fine = [KVEvent(BLOCK_STORED, [f"h{e}" for e in range(16, 97, 16)], None, list(range(96)), BS, medium="GPU",
                    group_idx=1)]
    for events in (coarse + fine, fine + coarse):
        tracer = ChainTracer()
        for ev in events:
            tracer.add(0, ev)
        requests, block_size = native_requests([tracer])
        assert block_size == BS
        assert [(r.input_length, r.hash_block_size) for r in requests] == [(96, BS)]
