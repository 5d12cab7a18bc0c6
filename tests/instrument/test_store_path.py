"""Spans into the real DuckDB store: determinism, nothing dropped, fast path == SDK path."""

from __future__ import annotations

from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider

from kvtrace.instrument import (
    BulkSpanProcessor,
    DuckDBSpanExporter,
    KVCacheInstrumentor,
    SeededIdGenerator,
    SpanBatchBuilder,
    build_tracer_provider,
    table_to_readable_spans,
)
from kvtrace.store.writer import Store
from tests.instrument.helpers import count_spans, one_of_each_step, store_rows
from tests.support.synthetic_spans import synthetic_steps


def record(path, steps, seed=0, background=True, flush_spans=4096, run_id="run"):
    with Store.open(path) as store:
        store.create_run("t", run_id=run_id, created="2026-01-01T00:00:00Z")
        provider = build_tracer_provider(store=store, run_id=run_id, seed=seed, background=background)
        inst = KVCacheInstrumentor(provider, run_id=run_id, flush_spans=flush_spans)
        for batch in steps:
            inst(batch)
        provider.force_flush()
        inst.force_flush()
        provider.shutdown()
        store.finish_run(run_id)
    return inst


def test_same_replay_stores_identical_rows(tmp_path):
    steps = list(synthetic_steps(300, seed=4))
    record(tmp_path / "a.duckdb", steps, seed=9)
    record(tmp_path / "b.duckdb", steps, seed=9, background=False)
    a = store_rows(tmp_path / "a.duckdb", "run")
    b = store_rows(tmp_path / "b.duckdb", "run")
    assert len(a) > 3000
    assert a == b


def test_seed_changes_ids_but_not_content(tmp_path):
    steps = list(synthetic_steps(50, seed=4))
    record(tmp_path / "a.duckdb", steps, seed=1)
    record(tmp_path / "b.duckdb", steps, seed=2)
    a = store_rows(tmp_path / "a.duckdb", "run")
    b = store_rows(tmp_path / "b.duckdb", "run")
    assert [r["span_id"] for r in a] != [r["span_id"] for r in b]
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("trace_id", "span_id", "parent_span_id", "links")}
                          for r in rows]
    assert strip(a) == strip(b)


def test_nothing_dropped_on_a_large_run(tmp_path):
    """>200k spans through a background processor with a 1-batch queue: emitted == stored."""
    path = tmp_path / "big.duckdb"
    with Store.open(path) as store:
        store.create_run("big", run_id="big")
        processor = BulkSpanProcessor(DuckDBSpanExporter(store, "big"), background=True, max_queued_batches=1)
        provider = TracerProvider(id_generator=SeededIdGenerator(0))
        provider.add_span_processor(processor)
        inst = KVCacheInstrumentor(provider, run_id="big", flush_spans=8192)
        steps = list(synthetic_steps(1_000, seed=2))
        for _ in range(16):  # the same real event objects, replayed: counting is what matters
            for batch in steps:
                inst(batch)
        inst.force_flush()
        assert processor.spans_failed == 0
        store.finish_run("big")
    assert inst.spans_emitted > 200_000
    assert processor.spans_received == processor.spans_exported == inst.spans_emitted
    assert count_spans(path, "big") == inst.spans_emitted


def test_sdk_spans_through_the_bulk_processor_are_all_stored(tmp_path):
    """Spans made with tracer.start_span go through on_end, batched, never dropped."""
    path = tmp_path / "sdk.duckdb"
    with Store.open(path) as store:
        store.create_run("sdk", run_id="sdk")
        processor = BulkSpanProcessor(DuckDBSpanExporter(store, "sdk"), background=True,
                                      max_export_batch_size=64, max_queued_batches=1)
        provider = TracerProvider(id_generator=SeededIdGenerator(0))
        provider.add_span_processor(processor)
        tracer = provider.get_tracer("t")
        for i in range(3000):
            with tracer.start_as_current_span("outer", attributes={"kvtrace.step": i, "x.custom": "v"}):
                tracer.start_span("inner", attributes={"kvtrace.group": 1}).end()
        provider.shutdown()
        store.finish_run("sdk")
    assert processor.spans_exported == 6000
    rows = store_rows(path, "sdk", "name, step, group_id, extra_attributes, parent_span_id")
    assert len(rows) == 6000
    outer = [r for r in rows if r["name"] == "outer"]
    assert sorted(r["step"] for r in outer) == list(range(3000))
    assert all(r["extra_attributes"] == {"x.custom": "v"} for r in outer)
    assert all(r["group_id"] == 1 and r["parent_span_id"] for r in rows if r["name"] == "inner")


def test_fast_path_and_readable_span_path_store_the_same_rows(tmp_path):
    """The columnar batch and its ReadableSpans, each through DuckDBSpanExporter."""
    builder = SpanBatchBuilder(SeededIdGenerator(3))
    for step in [one_of_each_step(3), *synthetic_steps(40, seed=1)]:
        builder.add_step(step.step.step, step.step.start_ns, step.step.end_ns, step.cache_events,
                         step.engine_events, step.step)
    batch = builder.build()
    path = tmp_path / "paths.duckdb"
    with Store.open(path) as store:
        for run in ("fast", "sdk"):
            store.create_run(run, run_id=run)
        DuckDBSpanExporter(store, "fast").export_batch(batch)
        DuckDBSpanExporter(store, "sdk").export(table_to_readable_spans(batch.table))
        store.finish_run("fast")
        store.finish_run("sdk")
    fast, sdk = store_rows(path, "fast"), store_rows(path, "sdk")
    assert len(fast) == batch.num_spans > 500
    assert fast == sdk


def test_exporter_failure_is_raised_not_swallowed(tmp_path):
    with Store.open(tmp_path / "f.duckdb") as store:
        processor = BulkSpanProcessor(DuckDBSpanExporter(store, "no-such-run"), background=True)
        inst = KVCacheInstrumentor(TracerProvider(), processors=[processor])
        inst(one_of_each_step())
        inst.flush()
        with pytest.raises(Exception, match="no-such-run"):
            processor.force_flush()
        assert processor.spans_failed == 10


_CHILD = """
import sys
from kvtrace.instrument import KVCacheInstrumentor, build_tracer_provider
from tests.support.synthetic_spans import synthetic_steps
from kvtrace.store.writer import Store
with Store.open(sys.argv[1]) as store:
    store.create_run("t", run_id="run", created="2026-01-01T00:00:00Z")
    provider = build_tracer_provider(store=store, run_id="run", seed=5)
    inst = KVCacheInstrumentor(provider, run_id="run", flush_spans=500)
    for batch in synthetic_steps(80, seed=3):
        inst(batch)
    inst.force_flush()
    provider.shutdown()
    store.finish_run("run")
"""


def test_identical_rows_across_processes(tmp_path):
    """Separate interpreters (different hash seeds): nothing per-process leaks into rows."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    for name, hashseed in (("p1.duckdb", "1"), ("p2.duckdb", "2")):
        env = dict(os.environ, PYTHONHASHSEED=hashseed, PYTHONPATH=str(root))
        subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / name)], check=True, env=env, cwd=root)
    a, b = store_rows(tmp_path / "p1.duckdb", "run"), store_rows(tmp_path / "p2.duckdb", "run")
    assert len(a) > 800 and a == b


def test_recording_flushes_everything_when_the_run_fails(tmp_path):
    from kvtrace.instrument import recording

    path = tmp_path / "crash.duckdb"
    with pytest.raises(RuntimeError, match="engine blew up"), Store.open(path) as store:
        store.create_run("crash", run_id="crash")
        with recording(store=store, run_id="crash", seed=1) as inst:
            for i, batch in enumerate(synthetic_steps(200, seed=6)):
                inst(batch)
                if i == 150:
                    raise RuntimeError("engine blew up")
    assert inst.spans_emitted > 1500
    assert count_spans(path, "crash") == inst.spans_emitted
    from kvtrace.store import read
    assert read.run(path, "crash")["status"] == "failed"
