"""Events -> spans for the synthetic workloads, the way kvtrace makes them."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import pyarrow as pa

from kvtrace.engine.events import StepBatch
from kvtrace.instrument import SeededIdGenerator, SpanBatch, SpanBatchBuilder, recording


def span_batches(steps: Iterable[StepBatch], seed: int = 0, flush_spans: int = 32_768) -> Iterator[SpanBatch]:
    """The spans of ``steps`` as ``SpanBatch``es of about ``flush_spans`` (``SpanBatchBuilder``)."""
    builder = SpanBatchBuilder(SeededIdGenerator(seed))
    for s in steps:
        builder.add_step(s.step.step, s.step.start_ns, s.step.end_ns, s.cache_events, s.engine_events, s.step)
        if builder.pending_spans >= flush_spans:
            batch = builder.build()
            if batch is not None:
                yield batch
    last = builder.build()
    if last is not None:
        yield last


def spans_table(steps: Iterable[StepBatch], seed: int = 0) -> pa.Table:
    """The spans of ``steps`` as one Arrow table in the store's span schema (no run_id)."""
    tables = [b.table for b in span_batches(steps, seed, flush_spans=1 << 62)]
    return pa.concat_tables(tables, promote_options="default") if tables else pa.table({})


def write_steps(store, run_id: str, steps: Sequence[StepBatch], seed: int = 0) -> int:
    """Record ``steps`` into ``run_id`` the way a replay does (``recording``); returns the span count."""
    with recording(store=store, run_id=run_id, seed=seed) as inst:
        for batch in steps:
            inst(batch)
    return inst.spans_emitted
