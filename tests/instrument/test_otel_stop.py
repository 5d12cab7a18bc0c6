"""A recording stopped (Ctrl-C, SIGTERM, an error) with a slow collector behind it: the
OTLP export gets one export's time to deliver what is queued, then the rest counts as not
delivered. It drained the whole queue first: a collector taking 4 s a request held a
SIGTERM'd replay for 32 s (minutes with a fuller queue), its run left `running`."""

from __future__ import annotations

import types

import pytest
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

import kvtrace.instrument.pipeline as pipeline
import kvtrace.instrument.processor as processor
from kvtrace.instrument import BulkSpanProcessor, recording
from kvtrace.instrument.pipeline import EXPORT_TIMEOUT_S
from tests.support.synthetic_spans import synthetic_steps


class SlowCollector(SpanExporter):
    """Takes every request, each costing 2 export timeouts of the (fake) clock."""

    def __init__(self, clock: list[float]):
        self.clock, self.spans = clock, 0

    def export(self, spans):
        self.clock[0] += 2 * EXPORT_TIMEOUT_S
        self.spans += len(spans)
        return SpanExportResult.SUCCESS


@pytest.fixture()
def slow(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(processor, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    collector = SlowCollector(clock)
    monkeypatch.setattr(pipeline, "otlp_span_exporter", lambda endpoint: collector)
    return collector


def _record(steps, stop: bool, procs: list[BulkSpanProcessor]) -> None:
    """The steps through ``recording`` to the collector, its OTLP processor put in ``procs``;
    ``stop``: the body then raises KeyboardInterrupt (what Ctrl-C and SIGTERM raise)."""
    with recording(otlp_endpoint="http://127.0.0.1:4318") as inst:
        for batch in steps:
            inst(batch)
        procs.extend(inst._resolved_bulk())
        if stop:
            raise KeyboardInterrupt


def test_a_stopped_recording_gives_a_slow_collector_one_exports_time(slow):
    procs: list[BulkSpanProcessor] = []
    with pytest.raises(KeyboardInterrupt):  # fewer steps than a hand-over: all sent after the stop
        _record(synthetic_steps(200, seed=3), True, procs)
    (proc,) = procs
    # one chunk went (within the grace); every other one counted as not delivered, never tried
    assert slow.spans == proc.spans_exported == 512
    assert proc.spans_failed == proc.spans_received - 512 > 3 * 512


def test_a_recording_that_ends_delivers_everything_however_slow(slow):
    procs: list[BulkSpanProcessor] = []
    _record(synthetic_steps(200, seed=3), False, procs)  # (never-dropping: it waits for the collector)
    (proc,) = procs
    assert slow.spans == proc.spans_received == proc.spans_exported > 4 * 512
    assert proc.spans_failed == 0


def test_a_batch_whose_hand_over_a_stop_interrupts_is_still_exported():
    """Ctrl-C or SIGTERM while the producer waits for room in a full queue: the batch was
    never queued, so the store lacked the hand-over the stop interrupted."""
    import os
    import signal
    import threading

    from opentelemetry.sdk.trace import TracerProvider

    from kvtrace.instrument import KVCacheInstrumentor
    from kvtrace.instrument.batch import SpanBatch

    release = threading.Event()

    class Held:
        """A columnar exporter (as the store's) that holds its first batch until released."""

        def __init__(self) -> None:
            self.spans = 0

        def export_batch(self, batch: SpanBatch):
            release.wait(60)
            self.spans += batch.num_spans
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            pass

    out = Held()
    proc = BulkSpanProcessor(out, background=True, max_queued_batches=1)  # type: ignore[arg-type]
    inst = KVCacheInstrumentor(TracerProvider(), processors=[proc], flush_spans=1)
    steps = iter(synthetic_steps(3, seed=1))
    inst(next(steps))  # the worker takes it and is held
    inst(next(steps))  # queued: the queue is full

    def interrupt() -> None:  # once the producer waits for room (a Condition's waiter)
        while not proc._queue.not_full._waiters:  # type: ignore[union-attr]
            threading.Event().wait(0.01)
        os.kill(os.getpid(), signal.SIGUSR1)
        release.set()

    def stop(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGUSR1, stop)
    try:
        threading.Thread(target=interrupt, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            inst(next(steps))  # waits for room, and is stopped there
    finally:
        signal.signal(signal.SIGUSR1, previous)
        release.set()
    proc.force_flush()
    assert out.spans == proc.spans_received == inst.spans_emitted > 0


class TakesAll(SpanExporter):
    """A collector that takes every request."""

    def export(self, spans):
        return SpanExportResult.SUCCESS


def test_a_stop_while_a_collector_drains_leaves_the_stored_run_complete(tmp_path, monkeypatch):
    """Every span was in the store, yet the run was marked failed, its digest and summary
    replaced by the error, where the collector's copy said complete. The stop comes as the
    exit waits for the collector's queue (raised there: a real signal's handling in an
    xdist worker is its own, and one that came late killed the worker)."""
    from kvtrace.replay.run import RunSpec, run_replay
    from kvtrace.store import read

    monkeypatch.setattr(pipeline, "otlp_span_exporter", lambda endpoint: TakesAll())
    flush, stopped = BulkSpanProcessor.force_flush, []

    def interrupted(self, *args, **kwargs):
        if self.columnar is None and not stopped:  # (the OTLP export's, once: the store's flush as it is)
            stopped.append(self)
            raise KeyboardInterrupt
        return flush(self, *args, **kwargs)

    monkeypatch.setattr(BulkSpanProcessor, "force_flush", interrupted)
    spec = RunSpec("gen:chat", limit=6, mode="cache-only", capacity_blocks=30)
    db = str(tmp_path / "runs.duckdb")
    with pytest.raises(KeyboardInterrupt):
        run_replay(spec, db=db, otlp_endpoint="http://127.0.0.1:4318")
    monkeypatch.setattr(BulkSpanProcessor, "force_flush", flush)
    run = read.run(db, "r1")
    whole = run_replay(spec, db=str(tmp_path / "plain.duckdb"))
    assert stopped and run["status"] == "complete" and run["digest"] == whole.summary["digest"], run
    assert run["summary"]["requests"] == 6 and run["summary"]["otlp_export"] == "stopped"
    assert read.span_counts(db, "r1")["spans"].sum() == whole.summary["spans"]


class AnswersOnceStopped(SlowCollector):
    """The slow collector, whose first request is answered once the stop has been taken
    (``proc``'s give-up set): a slow collector's request outlasts the stop's handling."""

    proc: BulkSpanProcessor | None = None

    def export(self, spans):
        import time

        deadline = time.monotonic() + 10  # (the real clock: the processor's is the fake one)
        while self.proc is not None and self.proc._give_up_at is None and time.monotonic() < deadline:
            time.sleep(0.01)
        self.proc = None  # (the first request only)
        return super().export(spans)


def test_a_stop_while_the_queue_drains_gives_the_collector_one_exports_time(monkeypatch):
    """The body ended, the exit drained the queue, and a Ctrl-C then waited for all of it
    again in the shutdown (24 s to a collector taking 4 s a request)."""
    clock = [0.0]
    monkeypatch.setattr(processor, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    collector = AnswersOnceStopped(clock)
    monkeypatch.setattr(pipeline, "otlp_span_exporter", lambda endpoint: collector)
    procs: list[BulkSpanProcessor] = []
    with pytest.raises(KeyboardInterrupt), recording(otlp_endpoint="http://127.0.0.1:4318") as inst:
        for batch in synthetic_steps(200, seed=3):
            inst(batch)
        procs.extend(inst._resolved_bulk())
        (proc,) = procs
        collector.proc, flush = proc, proc.force_flush

        def interrupted(*args, **kwargs):  # Ctrl-C while the exit waits for the queue (no real
            proc.force_flush = flush  # signal: an xdist worker's handling of one is its own)
            raise KeyboardInterrupt

        proc.force_flush = interrupted  # type: ignore[method-assign]
    assert proc.spans_received > 4 * 512
    assert collector.spans == proc.spans_exported <= 2 * 512  # (the one in flight, then one within the grace)
    assert proc.spans_failed == proc.spans_received - proc.spans_exported
