"""kvtrace.instrument: cache and engine events -> OpenTelemetry spans -> store / OTLP.

Public API:
- ``KVCacheInstrumentor``: subscribes to an engine or cache manager, emits spans in bulk.
- ``SeededIdGenerator``: deterministic span/trace ids (an OTel ``IdGenerator``).
- ``BulkSpanProcessor``: a never-dropping SDK span processor with a columnar fast path.
- ``DuckDBSpanExporter``: an SDK ``SpanExporter`` writing Arrow batches to the store.
- ``build_tracer_provider``: store and/or OTLP wiring in one call; ``recording``: the same
  as a context manager that flushes and shuts down on exit (errors included).
- ``SpanBatch``, ``table_to_readable_spans``, ``readable_spans_to_table``: conversions;
  ``kvtrace.instrument.span_kinds``: what each event kind becomes (a declarative table).
- ``kvtrace.instrument.otlp.serve_collector``: OTLP/HTTP and gRPC receiver into the store.
- ``kvtrace.instrument.vllm.capture_vllm``: live vLLM KV events (ZMQ) into the store.
"""

from typing import TYPE_CHECKING

from kvtrace.lazy import lazy_exports

# Loaded on first use: the light modules here (the collector's and the capture's option
# checks) are imported by the CLI before it knows a command line is good, without
# pyarrow, the OTel SDK or DuckDB.
_EXPORTS = {
    "BATCH_SCHEMA": "batch",
    "SpanBatch": "batch",
    "readable_spans_to_table": "convert",
    "table_to_readable_spans": "convert",
    "DuckDBSpanExporter": "exporter",
    "SeededIdGenerator": "ids",
    "KVCacheInstrumentor": "instrumentor",
    "SpansNotDelivered": "pipeline",
    "build_tracer_provider": "pipeline",
    "otlp_span_exporter": "pipeline",
    "recording": "pipeline",
    "BulkSpanProcessor": "processor",
    "SpanBatchBuilder": "spans",
}
__all__ = [  # _EXPORTS' names, spelled out for the linters
    "BATCH_SCHEMA",
    "BulkSpanProcessor",
    "DuckDBSpanExporter",
    "KVCacheInstrumentor",
    "SeededIdGenerator",
    "SpanBatch",
    "SpanBatchBuilder",
    "SpansNotDelivered",
    "build_tracer_provider",
    "otlp_span_exporter",
    "readable_spans_to_table",
    "recording",
    "table_to_readable_spans",
]

__getattr__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from kvtrace.instrument.batch import BATCH_SCHEMA, SpanBatch
    from kvtrace.instrument.convert import readable_spans_to_table, table_to_readable_spans
    from kvtrace.instrument.exporter import DuckDBSpanExporter
    from kvtrace.instrument.ids import SeededIdGenerator
    from kvtrace.instrument.instrumentor import KVCacheInstrumentor
    from kvtrace.instrument.pipeline import SpansNotDelivered, build_tracer_provider, otlp_span_exporter, recording
    from kvtrace.instrument.processor import BulkSpanProcessor
    from kvtrace.instrument.spans import SpanBatchBuilder
