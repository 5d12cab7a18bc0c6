"""A collected kvtrace run that misses some of the spans its sender numbered reads
``incomplete``, not ``complete`` with its sender's summary, until the rest come."""

from __future__ import annotations

import duckdb
import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExportResult

from kvtrace.instrument import KVCacheInstrumentor
from kvtrace.instrument.ids import SeededIdGenerator
from kvtrace.instrument.otlp import OTLPCollector
from kvtrace.instrument.pipeline import make_resource
from kvtrace.instrument.processor import BulkSpanProcessor
from tests.instrument.helpers import one_of_each_step
from tests.instrument.test_otlp_fix25 import _Held
from tests.support.synthetic_spans import synthetic_steps

RUN = "lead26"


def _requests(status: str = "complete", summary: dict | None = None, steps: int = 30) -> tuple[list[list], list]:
    """The export requests of a replay's spans (100 a request) and its run record's, whose
    summary gives the spans numbered (or ``summary``; ``steps`` 0: the record alone)."""
    held = _Held()
    resource = make_resource(RUN, time_offset_ns=7_000_000_000)
    provider = TracerProvider(resource=resource, id_generator=SeededIdGenerator(3))
    provider.add_span_processor(BulkSpanProcessor(held, max_export_batch_size=100, resource=resource, run_id=RUN,
                                                  time_offset_ns=7_000_000_000, number_spans=True))
    inst = KVCacheInstrumentor(provider, run_id=RUN, flush_spans=1000)
    for batch in [one_of_each_step(0), *synthetic_steps(steps, seed=5)] if steps else []:
        inst(batch)
    inst.flush()
    inst.record_run({"name": "lead26", "status": status, "digest": "d1",
                     "summary": summary or {"spans": inst.spans_emitted, "requests": 1}})
    inst.force_flush()
    provider.shutdown()
    *spans, record = held.requests
    return spans, record


def _collect(path, requests: list) -> None:
    """Send ``requests`` to a collector on ``path``, each answered 200, then stop it."""
    collector = OTLPCollector(path, port=0).start()
    try:
        exporter = OTLPSpanExporter(endpoint=collector.url)
        for request in requests:
            assert exporter.export(request) is SpanExportResult.SUCCESS
    finally:
        collector.stop()


def _send_to_a_restarted_collector(path, request: list) -> None:
    """Send ``request`` to a new collector on ``path``, wait for its late rebuilds, stop it."""
    collector = OTLPCollector(path, port=0, late_refresh_s=0.0).start()
    try:
        assert OTLPSpanExporter(endpoint=collector.url).export(request) is SpanExportResult.SUCCESS
        assert collector.wait_late_refreshed(timeout=60)
    finally:
        collector.stop()


def _status(path) -> str:
    con = duckdb.connect(str(path), read_only=True)
    try:
        return con.execute("SELECT status FROM runs WHERE run_id = ?", [RUN]).fetchone()[0]
    finally:
        con.close()


@pytest.mark.parametrize("lost", [0, 2, -1])
def test_a_run_missing_an_export_request_reads_incomplete_until_it_comes(tmp_path, lost):
    spans, record = _requests()
    assert len(spans) > 3
    path = tmp_path / "c.duckdb"
    collector = OTLPCollector(path, port=0, late_refresh_s=0.0).start()
    try:
        exporter = OTLPSpanExporter(endpoint=collector.url)
        for i, request in enumerate(spans):
            if i != lost % len(spans):
                assert exporter.export(request) is SpanExportResult.SUCCESS
        assert exporter.export(record) is SpanExportResult.SUCCESS
        assert _status(path) == "incomplete"  # (it read complete, its summary counting spans the store lacks)
        assert exporter.export(spans[lost]) is SpanExportResult.SUCCESS
        assert collector.wait_late_refreshed(timeout=30)
        assert _status(path) == "complete"
    finally:
        collector.stop()
    assert _status(path) == "complete"


def test_a_run_whose_spans_all_came_reads_complete_at_its_record(tmp_path):
    spans, record = _requests()
    path = tmp_path / "c.duckdb"
    collector = OTLPCollector(path, port=0).start()
    try:
        exporter = OTLPSpanExporter(endpoint=collector.url)
        for request in [*spans, record]:
            assert exporter.export(request) is SpanExportResult.SUCCESS
        assert _status(path) == "complete"
    finally:
        collector.stop()


@pytest.mark.parametrize("store", ["c.duckdb", "chdb:c"])
def test_a_short_run_is_completed_by_the_rest_sent_to_a_restarted_collector(tmp_path, store):
    """The list of short runs lived in the collector's memory: the rest of a run's spans, sent
    again to the collector started after it, left it incomplete for good (re-probe D)."""
    from kvtrace.store.read._sql import connect, query

    spans, record = _requests()
    path = str(tmp_path / store) if not store.startswith("chdb:") else f"chdb:{tmp_path / 'c'}"

    def status() -> str:
        with connect(path) as con:
            return query(con, "SELECT status FROM runs WHERE run_id = $r", {"r": RUN}).item()

    _collect(path, [*spans[1:], record])
    assert status() == "incomplete"
    second = OTLPCollector(path, port=0, late_refresh_s=0.0).start()
    try:
        assert OTLPSpanExporter(endpoint=second.url).export(spans[0]) is SpanExportResult.SUCCESS
        assert second.wait_late_refreshed(timeout=60)
        assert status() == "complete"
    finally:
        second.stop()
    assert status() == "complete"


def _summary(path) -> dict:
    import json

    con = duckdb.connect(str(path), read_only=True)
    try:
        return json.loads(con.execute("SELECT summary FROM runs WHERE run_id = ?", [RUN]).fetchone()[0])
    finally:
        con.close()


def test_a_short_run_says_how_many_spans_it_lacks_and_ends_with_its_senders_summary(tmp_path):
    spans, record = _requests()
    path = tmp_path / "c.duckdb"
    _collect(path, [*spans[1:], record])
    summary = _summary(path)  # (still short at the close: incomplete, saying by how much)
    assert _status(path) == "incomplete"
    assert summary["otlp_spans_missing"] == len(spans[0]) and summary["spans"] > len(spans[0])
    _send_to_a_restarted_collector(path, spans[0])
    assert _status(path) == "complete" and "otlp_spans_missing" not in _summary(path)


def test_a_run_its_sender_called_incomplete_stays_so_when_the_rest_comes_after_a_restart(tmp_path):
    """A restarted collector took every stored incomplete run short of its spans for one it had
    finished short itself: a sender's own `incomplete` read `complete` once the rest came (re-probe G)."""
    spans, record = _requests("incomplete")
    path = tmp_path / "c.duckdb"
    _collect(path, [*spans[1:], record])
    assert _status(path) == "incomplete" and "otlp_spans_missing" not in _summary(path)
    _send_to_a_restarted_collector(path, spans[0])
    assert _status(path) == "incomplete"


def test_a_short_runs_missing_count_follows_the_spans_that_come(tmp_path):
    """otlp_spans_missing said 200 after half of them came (re-probe H)."""
    spans, record = _requests()
    path = tmp_path / "c.duckdb"
    _collect(path, [*spans[2:], record])
    assert _summary(path)["otlp_spans_missing"] == len(spans[0]) + len(spans[1])
    _send_to_a_restarted_collector(path, spans[1])
    assert _status(path) == "incomplete" and _summary(path)["otlp_spans_missing"] == len(spans[0])


def test_a_sender_may_not_send_the_collectors_own_key(tmp_path):
    """A sender's summary holding otlp_spans_missing was stored as it came: an `incomplete` of its
    own then read `complete` after a restart (re-probe H). It is a 400 naming the key."""
    from opentelemetry.sdk.trace.export import SpanExportResult as R

    no_spans, record = _requests("incomplete", summary={"spans": 5, "otlp_spans_missing": 1}, steps=0)
    assert no_spans == []
    collector = OTLPCollector(tmp_path / "c.duckdb", port=0).start()
    try:
        assert OTLPSpanExporter(endpoint=collector.url).export(record) is R.FAILURE
        assert collector.requests_rejected == 1
    finally:
        collector.stop()
