"""The instrumentor on the real cache manager and the real engine."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvtrace.cache import CacheConfig, FullAttentionSpec, KVCacheManager, Request
from kvtrace.engine.engine import Engine
from kvtrace.errors import KVTraceError
from kvtrace.instrument import KVCacheInstrumentor, SeededIdGenerator, build_tracer_provider
from kvtrace.store.writer import Store
from kvtrace.workload import TraceRequest
from tests.instrument.helpers import store_rows

SPAN_OF = {"BlockPublished": "kvtrace.cache.publish", "BlockEvicted": "kvtrace.cache.evict",
           "BlockCopied": "kvtrace.cache.cow", "PrefixLookup": "kvtrace.cache.lookup",
           "BlocksFreed": "kvtrace.cache.free", "StaleHashLeft": "kvtrace.cache.stale_left",
           "RequestFinished": "kvtrace.request", "StaleHashFound": "kvtrace.verify.stale_hash",
           "DivergentOutput": "kvtrace.verify.divergent_output"}


def _workload(n=16):
    return [TraceRequest(f"r{i}", i * 4_000_000, 64 * (2 + i % 3), 4,
                         hash_ids=tuple(range(i % 2 * 100, i % 2 * 100 + 2 + i % 3)), hash_block_size=64)
            for i in range(n)]


def _engine_run(path, run_id="e"):
    seen = []
    with Store.open(path) as store:
        store.create_run("engine", run_id=run_id)
        provider = build_tracer_provider(store=store, run_id=run_id, seed=11)
        inst = KVCacheInstrumentor(provider, run_id=run_id, flush_spans=256).instrument()
        result = Engine("kimi-hybrid").run(_workload(), listeners=[seen.append, inst])
        inst.uninstrument()
        provider.force_flush()
        provider.shutdown()
        store.finish_run(run_id)
    return seen, result, inst


def test_engine_replay_every_event_becomes_one_stored_span(tmp_path):
    seen, result, inst = _engine_run(tmp_path / "e.duckdb")
    want = Counter({"kvtrace.engine.step": len(seen)})
    for b in seen:
        want.update(SPAN_OF[type(e).__name__] for e in (*b.cache_events, *b.engine_events))
    rows = store_rows(tmp_path / "e.duckdb", "e")
    assert Counter(r["name"] for r in rows) == want
    assert inst.spans_emitted == sum(want.values()) == len(rows)
    # request spans carry the engine's own latency numbers
    reqs = {r["request_id"]: r for r in rows if r["name"] == "kvtrace.request"}
    assert len(reqs) == 16
    for rec in result.requests:
        r = reqs[rec.request_id]
        assert r["ttft_ns"] == rec.first_token_ns - rec.arrival_ns
        assert (r["start_ns"], r["end_ns"]) == (rec.arrival_ns, rec.finish_ns)
        assert r["itl_ns"] == list(rec.itl_ns)
        assert r["num_hit_tokens"] == rec.num_local_hit_tokens
    # every cache span sits inside its step's virtual window
    steps = {r["span_id"]: r for r in rows if r["name"] == "kvtrace.engine.step"}
    for r in rows:
        if r["name"].startswith("kvtrace.cache."):
            step = steps[r["parent_span_id"]]
            assert step["start_ns"] <= r["start_ns"] <= step["end_ns"]


def test_engine_replay_twice_gives_identical_rows(tmp_path):
    _engine_run(tmp_path / "a.duckdb")
    _engine_run(tmp_path / "b.duckdb")
    assert store_rows(tmp_path / "a.duckdb", "e") == store_rows(tmp_path / "b.duckdb", "e")


def test_instrument_and_uninstrument_a_cache_manager():
    exporter = InMemorySpanExporter()
    provider = TracerProvider(id_generator=SeededIdGenerator(0))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    manager = KVCacheManager(CacheConfig(groups=(FullAttentionSpec(16),), num_gpu_blocks=20, hash_block_size=16))
    inst = KVCacheInstrumentor(provider, step_ns=1_000)
    inst.instrument(manager)
    inst.instrument(manager)  # idempotent: one subscription
    assert inst.is_instrumented

    def serve(rid, tokens):
        req = Request(rid, np.asarray(tokens, dtype=np.int64))
        blocks, hit, _ = manager.get_computed_blocks(req)
        assert manager.allocate_slots(req, len(tokens) - hit, hit, blocks) is not None
        req.num_computed_tokens = len(tokens)
        manager.new_step_starts()
        manager.free(req)
        manager.new_step_starts()

    serve("a", list(range(40)))
    inst.uninstrument()
    names = Counter(s.name for s in exporter.get_finished_spans())
    assert names["kvtrace.cache.lookup"] == 1 and names["kvtrace.cache.publish"] >= 1
    assert names["kvtrace.cache.free"] >= 1
    assert names["kvtrace.engine.step"] == 2  # cache-only mode: one step span per event batch
    lookup = next(s for s in exporter.get_finished_spans() if s.name == "kvtrace.cache.lookup")
    assert lookup.attributes["kvtrace.request.id"] == "a"
    assert lookup.start_time == 0  # step 0 at step_ns = 1000
    before = len(exporter.get_finished_spans())
    serve("b", list(range(40)))  # no longer subscribed
    inst.flush()
    assert len(exporter.get_finished_spans()) == before
    assert not inst.is_instrumented


def test_instrument_refuses_a_target_without_subscribe_or_run():
    with pytest.raises(KVTraceError, match="listeners"):
        KVCacheInstrumentor(TracerProvider()).instrument(object())


def test_instrument_and_uninstrument_an_engine():
    exporter = InMemorySpanExporter()
    provider = TracerProvider(id_generator=SeededIdGenerator(0))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    engine = Engine("kimi-hybrid")
    inst = KVCacheInstrumentor(provider).instrument(engine)
    seen = []
    engine.run(_workload(4), listeners=[seen.append])  # the caller's listeners still run
    inst.uninstrument()
    spans = exporter.get_finished_spans()
    assert seen and len([s for s in spans if s.name == "kvtrace.engine.step"]) == len(seen)
    assert len([s for s in spans if s.name == "kvtrace.request"]) == 4
    assert "run" not in vars(engine)  # the class's run is back
    engine.run(_workload(4))
    inst.flush()
    assert len(exporter.get_finished_spans()) == len(spans)
