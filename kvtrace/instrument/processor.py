"""A span processor that never drops.

The SDK's ``BatchSpanProcessor`` drops spans when its queue is full. ``BulkSpanProcessor``
implements the same SDK ``SpanProcessor`` interface but applies back-pressure instead:

- columnar batches (``on_batch``) go straight to exporters that accept them
  (``export_batch``, e.g. ``DuckDBSpanExporter``); other exporters get ``ReadableSpan``s
  made from the batch, in chunks of ``max_export_batch_size`` spans and at most
  ``max_export_bytes`` of Arrow data (a span larger than that goes alone);
- SDK spans (``on_end``) are buffered and exported in chunks of the same size;
- with ``background=True`` exports run on one worker thread behind a bounded queue, and a
  full queue blocks the producer (it never discards); between batches that thread calls
  ``idle_flush`` (if given: a store's ``flush_when_idle``) so the store's once-a-second
  commit comes on time, not at the next batch. An exporter error is re-raised in
  the producer on its next call, so a failure is never silent.

``spans_received == spans_exported + spans_failed`` always holds after ``force_flush``;
``spans_failed`` counts spans an exporter answered ``FAILURE`` for (e.g. an unreachable
OTLP collector after its own retries). After a failure the exporter is given a rest of
``failure_backoff_s`` during which batches count as failed without being tried, so a
dead collector costs one exporter timeout per rest, not one per chunk.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from kvtrace.errors import ConfigError
from kvtrace.instrument.batch import SpanBatch
from kvtrace.instrument.convert import table_to_readable_spans
from kvtrace.names import shown_value

_log = logging.getLogger(__name__)
_STOP = object()
# The Arrow size of the spans one export sends (their OTLP protobuf measured 0.8-1.0x that):
# the OTel Collector's gRPC receiver takes 4 MiB by default (kvtrace collect 16 MiB, the SDK's
# HTTP exporter drops a request over 64 MiB), and a span of a long prompt at 16-token blocks
# carries thousands of block ids and hashes: 512 of 128k-token prompts made one 142 MB request.
MAX_EXPORT_BYTES = 3 * 1024 * 1024
# How often a background worker with an ``idle_flush`` calls it while rows wait and no batch
# comes: a fraction of the store's one-second commit interval.
IDLE_FLUSH_S = 0.25


@runtime_checkable
class ColumnarSpanExporter(Protocol):
    """An exporter that takes a whole ``SpanBatch`` (Arrow) at once."""

    def export_batch(self, batch: SpanBatch) -> SpanExportResult: ...


class BulkSpanProcessor(SpanProcessor):
    def __init__(
        self,
        exporter: SpanExporter,
        *,
        max_export_batch_size: int = 2048,
        max_export_bytes: int = MAX_EXPORT_BYTES,
        background: bool = False,
        max_queued_batches: int = 4,
        resource: Resource | None = None,
        run_id: str | None = None,
        failure_backoff_s: float = 10.0,
        time_offset_ns: int = 0,
        number_spans: bool = False,
        idle_flush: Callable[[], bool] | None = None,
    ):
        """``resource``/``run_id``: used when batches are turned into ``ReadableSpan``s;
        so are ``time_offset_ns`` (added to their times) and ``number_spans`` (each gets
        its ordinal among the batches' spans as ``kvtrace.seq``): an OTLP export's.
        ``idle_flush`` (with ``background``): called on the worker thread every
        ``IDLE_FLUSH_S`` that no batch comes, from a batch's export until it returns False
        (nothing left to do: no rows to commit, no file held that a reader may wait for).
        A store commits once a second, but only when spans are appended: the spans of one
        hand-over waited for the next one, seconds later where an engine's steps are slow,
        and a kill -9 lost them (2.4 s behind on the Mooncake trace, 5.9 s at
        ``dense-attention``); a reader waited for it too. Its errors reach the producer as
        an export's."""
        # (else an AttributeError at the first export, on the worker thread where there is one)
        if not any(callable(getattr(exporter, m, None)) for m in ("export", "export_batch")):
            raise ConfigError("BulkSpanProcessor", "exporter",
                              f"expected an OTel SpanExporter or a columnar one, got {shown_value(exporter)}")
        self.exporter = exporter
        self.max_export_batch_size = max_export_batch_size
        self.max_export_bytes = max_export_bytes
        self.resource = resource
        self.run_id = run_id
        self.time_offset_ns = time_offset_ns
        self.number_spans = number_spans
        self._next_seq = 0  # batch spans numbered so far (worker thread only)
        # the exporter again when it takes whole batches (``export_batch``), else None
        self.columnar: ColumnarSpanExporter | None = exporter if isinstance(exporter, ColumnarSpanExporter) else None
        self.spans_received = 0
        self.spans_exported = 0
        self.spans_failed = 0
        self.failure_backoff_s = failure_backoff_s
        self._resting_until = 0.0
        self._give_up_at: float | None = None  # (``give_up_after``) from then on nothing is tried
        self._pending: list[ReadableSpan] = []
        self._lock = threading.Lock()
        self.idle_flush = idle_flush
        # held by the worker while it exports or calls idle_flush, and by force_flush while the
        # exporter flushes: the store is not thread-safe, and idle_flush may run at any moment
        self._exporting = threading.Lock()
        self._error: BaseException | None = None
        self._shutdown = False
        self._queue: queue.Queue | None = None
        self._worker: threading.Thread | None = None
        if background:
            self._queue = queue.Queue(maxsize=max_queued_batches)
            self._worker = threading.Thread(target=self._run, name="kvtrace-span-export", daemon=True)
            self._worker.start()

    # -- SDK SpanProcessor ---------------------------------------------------------------------
    def on_start(self, span, parent_context=None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if not span.context.trace_flags.sampled:
            return
        with self._lock:
            self._pending.append(span)
            self.spans_received += 1
            if len(self._pending) < self.max_export_batch_size:
                return
            chunk, self._pending = self._pending, []
        self._submit(chunk)

    def send_now(self, span: ReadableSpan) -> None:
        """``span``, with any spans pending before it, as one export request now: not held until
        ``max_export_batch_size`` spans gather (a run's opening record, ahead of its first batch)."""
        self.on_end(span)
        with self._lock:
            chunk, self._pending = self._pending, []
        if chunk:
            self._submit(chunk)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        with self._lock:
            chunk, self._pending = self._pending, []
        if chunk:
            self._submit(chunk)
        if self._queue is not None:
            self._queue.join()
        self._raise_pending_error()
        flush = getattr(self.exporter, "force_flush", None)
        if flush is None:
            return True
        with self._exporting:
            return bool(flush(timeout_millis))

    def shutdown(self) -> None:
        if self._shutdown:
            return
        try:
            self.force_flush()
        finally:
            self._shutdown = True
            if self._queue is not None and self._worker is not None:
                self._queue.put(_STOP)
                self._worker.join()
            self.exporter.shutdown()

    def give_up_after(self, seconds: float) -> None:
        """Try no export once ``seconds`` have passed: what is still queued then counts as
        failed. For a recording that stopped (Ctrl-C, SIGTERM, an error): a slow collector
        held the stop for as long as the full queue took it to take, minutes, not one export."""
        self._give_up_at = time.monotonic() + seconds

    # -- columnar ------------------------------------------------------------------------------
    def on_batch(self, batch: SpanBatch) -> None:
        """Export a whole batch (blocks while the queue is full; never drops)."""
        if batch.num_spans == 0:
            return
        self.spans_received += batch.num_spans
        self._submit(batch)

    # -- internals -----------------------------------------------------------------------------
    def _submit(self, item: SpanBatch | list[ReadableSpan]) -> None:
        if self._shutdown:
            raise RuntimeError("BulkSpanProcessor: span submitted after shutdown")
        self._raise_pending_error()
        if self._queue is None:
            self._export(item)
        else:
            try:
                self._queue.put(item)  # blocks when full: back-pressure, not loss
            except BaseException:
                # a stop (Ctrl-C, SIGTERM) while the queue was full: the batch still goes, behind
                # the ones before it (it was lost, the store short of the hand-over it stopped)
                self._queue.put(item)
                raise

    def _raise_pending_error(self) -> None:
        err, self._error = self._error, None
        if err is not None:
            raise err

    def _run(self) -> None:
        assert self._queue is not None  # the worker runs only with a queue
        waiting = False  # rows (or a file) the exporter holds that idle_flush is to see to
        while True:
            try:
                item = self._queue.get(timeout=IDLE_FLUSH_S) if waiting else self._queue.get()
            except queue.Empty:
                waiting = self._idle()
                continue
            try:
                if item is _STOP:
                    return
                if self._error is None:
                    with self._exporting:
                        self._export(item)
                    waiting = self.idle_flush is not None
                else:  # exporter already broken: count, do not pretend
                    self.spans_failed += _count(item)
            except BaseException as err:  # handed to the producer thread
                self._error = err
            finally:
                self._queue.task_done()

    def _idle(self) -> bool:
        """No batch came for ``IDLE_FLUSH_S``: ``idle_flush``, on the worker thread; whether
        rows still wait (an error ends the waiting, handed to the producer as an export's)."""
        assert self.idle_flush is not None  # (waiting is set only with one)
        with self._exporting:
            if self._error is not None:
                return False
            try:
                return bool(self.idle_flush())
            except BaseException as err:
                self._error = err
                return False

    def _export(self, item: SpanBatch | list[ReadableSpan]) -> None:
        """Export one item; whatever is not exported (refused, skipped while resting, or cut
        short by an exception, which propagates) counts as failed."""
        left = _count(item)
        try:
            if isinstance(item, SpanBatch):
                if self.columnar is not None:
                    if not self._resting():
                        left -= self._account(self.columnar.export_batch(item), item.num_spans)
                    return
                table = item.table
                first, self._next_seq = self._next_seq, self._next_seq + table.num_rows
                offset = 0
                while offset < table.num_rows:
                    if self._resting():
                        return
                    chunk = _chunk(table, offset, self.max_export_batch_size, self.max_export_bytes)
                    spans = table_to_readable_spans(chunk, self.resource, self.run_id, self.time_offset_ns,
                                                    first + offset if self.number_spans else None)
                    left -= self._account(self.exporter.export(spans), len(spans))
                    offset += chunk.num_rows
            elif not self._resting():
                left -= self._account(self.exporter.export(item), len(item))
        finally:
            self.spans_failed += left  # not exported: failed, skipped while resting, or raised

    def _resting(self) -> bool:
        now = time.monotonic()
        if self._give_up_at is not None and now >= self._give_up_at:
            return True
        return bool(self._resting_until) and now < self._resting_until

    def _account(self, result: SpanExportResult, n: int) -> int:
        if result is SpanExportResult.SUCCESS:
            self.spans_exported += n
            self._resting_until = 0.0
        else:
            self.spans_failed += n
            self._resting_until = time.monotonic() + self.failure_backoff_s
            _log.warning("%s failed to export %d spans (%d failed so far); next try in %.0f s",
                         type(self.exporter).__name__, n, self.spans_failed, self.failure_backoff_s)
        return n


def _chunk(table, offset: int, rows: int, max_bytes: int):
    """The table's rows from ``offset``: at most ``rows``, halved until their Arrow data is
    at most ``max_bytes`` or one row is left (a slice's ``nbytes`` counts its own rows only)."""
    chunk = table.slice(offset, rows)
    while chunk.num_rows > 1 and chunk.nbytes > max_bytes:
        chunk = chunk.slice(0, chunk.num_rows // 2)
    return chunk


def _count(item) -> int:
    return 0 if item is _STOP else (item.num_spans if isinstance(item, SpanBatch) else len(item))
