"""``DuckDBSpanExporter``: spans into the kvtrace store, in bulk Arrow appends.

A real SDK ``SpanExporter`` (``export(Sequence[ReadableSpan])``), plus the columnar fast
path ``export_batch(SpanBatch)`` that ``BulkSpanProcessor`` uses: the batch is already an
Arrow table in the store schema, so it is handed to ``Store.append_spans`` as is.

The store is owned by the caller (the exporter never closes it); it is not thread-safe,
so while a background processor exports, the caller should not write to the same store
until ``force_flush`` returns.
"""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from kvtrace.errors import ConfigError
from kvtrace.instrument.batch import SpanBatch
from kvtrace.instrument.convert import readable_spans_to_table
from kvtrace.names import shown_value

# What the exporter calls of its store: a kvtrace Store's, or a sweep worker's in-memory sink
STORE_METHODS = ("append_spans", "flush_if_due", "flush", "release")


def check_span_sink(store: object, run_id: object, where: str) -> None:
    """Refuse, at ``where``, a store the exporter cannot write to (a path given for an open
    store was taken, and the first hand-over was an AttributeError inside the run) and a run
    id that is no string."""
    if not all(callable(getattr(store, m, None)) for m in STORE_METHODS):
        raise ConfigError(where, "store", f"expected an open kvtrace Store (kvtrace.store.Store.open(path)), "
                                          f"got {shown_value(store)}")
    if not isinstance(run_id, str) or not run_id:
        raise ConfigError(where, "run_id", f"expected the id of a run created in the store, got {shown_value(run_id)}")


class DuckDBSpanExporter(SpanExporter):
    def __init__(self, store, run_id: str):
        """``store``: an open ``kvtrace.store.writer.Store``; ``run_id``: a run created in it."""
        check_span_sink(store, run_id, "DuckDBSpanExporter")
        self.store = store
        self.run_id = run_id
        self.spans_written = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        self.spans_written += self.store.append_spans(readable_spans_to_table(spans), run_id=self.run_id)
        return SpanExportResult.SUCCESS

    def export_batch(self, batch: SpanBatch) -> SpanExportResult:
        for part in batch.parts:  # one per store family: appended without re-splitting
            self.spans_written += self.store.append_spans(part, run_id=self.run_id, flush_when_due=False)
        self.store.flush_if_due()  # a batch is never split over two flushes (two file opens)
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self.store.flush()
        # the recording is done for now: a store that holds its file lets it go, so readers
        # need not wait for whatever the caller does next (a slow OTLP export, say)
        self.store.release()
        return True

    def shutdown(self) -> None:
        self.store.flush()
