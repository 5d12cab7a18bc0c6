"""Seeded ids, and the attribute table kept in step with the store schema."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from opentelemetry.sdk.trace import TracerProvider

from kvtrace.instrument import SeededIdGenerator
from kvtrace.store.schema import ATTRIBUTE_COLUMNS, GENAI_CACHE_READ, INFERRED_ATTRIBUTE, SPAN_NAMES

DOC = Path(__file__).resolve().parents[2] / "README.md"  # the one attribute table


def test_ids_are_a_function_of_seed_and_order():
    a, b, c = SeededIdGenerator(1), SeededIdGenerator(1), SeededIdGenerator(2)
    seq_a = [a.generate_span_id() for _ in range(100)]
    assert seq_a == [b.generate_span_id() for _ in range(100)]
    assert seq_a != [c.generate_span_id() for _ in range(100)]
    assert len(set(seq_a)) == 100 and all(0 < x < 2**64 for x in seq_a)
    t = a.generate_trace_id()
    assert 0 < t < 2**128 and t == b.generate_trace_id()


def test_bulk_ids_match_the_sdk_interface():
    gen = SeededIdGenerator(7)
    bulk = gen.span_ids(np.arange(0, 50))
    one_by_one = SeededIdGenerator(7)
    assert bulk.dtype == np.uint64
    assert bulk.tolist() == [one_by_one.generate_span_id() for _ in range(50)]
    hi, lo = gen.trace_ids(np.arange(50, 60))
    one_by_one.reserve(0)
    assert [(int(h) << 64) | int(low) for h, low in zip(hi, lo)] == [one_by_one.generate_trace_id() for _ in range(10)]


def test_sdk_tracer_with_the_seeded_generator_is_reproducible():
    def ids():
        tracer = TracerProvider(id_generator=SeededIdGenerator(3)).get_tracer("t")
        spans = [tracer.start_span("x") for _ in range(5)]
        return [(s.context.trace_id, s.context.span_id) for s in spans]
    assert ids() == ids()


def test_request_ids_are_keyed_by_seed_and_request():
    g1, g2 = SeededIdGenerator(1), SeededIdGenerator(2)
    assert g1.request_ids("r7") == SeededIdGenerator(1).request_ids("r7")
    assert g1.request_ids("r7") != g1.request_ids("r8")
    assert g1.request_ids("r7") != g2.request_ids("r7")
    hi, lo, span = g1.request_ids("r7")
    assert (hi or lo) and span and max(hi, lo, span) < 2**64


def test_attribute_table_documents_every_typed_attribute_and_span():
    text = DOC.read_text()
    for key in [*ATTRIBUTE_COLUMNS, GENAI_CACHE_READ, INFERRED_ATTRIBUTE]:
        assert f"| `{key}` |" in text, key
    for col in ATTRIBUTE_COLUMNS.values():
        assert f"`{col}`" in text, col
    for name in SPAN_NAMES:
        assert f"`{name}`" in text, name
