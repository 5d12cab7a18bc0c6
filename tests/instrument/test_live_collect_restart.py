"""``kvtrace collect`` killed or stopped and started again on the same store, and exports
sent again: what was acknowledged is kept once, and a run's record still finishes it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from kvtrace.instrument.otlp import OTLPCollector
from kvtrace.store.read import run, runs
from kvtrace.store.writer import Store
from tests.instrument.helpers import count_spans
from tests.support.processes import reaped

RUN = "replay-0123456789ab"


def _export(first: int, n: int, run_id: str | None = RUN, record: dict | None = None) -> bytes:
    """Spans ``first`` .. ``first + n - 1`` (a trace each), then a ``kvtrace.run`` record
    with ``record``'s attributes when given."""
    req = trace_service_pb2.ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    if run_id is not None:
        attr = rs.resource.attributes.add()
        attr.key, attr.value.string_value = "kvtrace.run.id", run_id
    spans = rs.scope_spans.add().spans
    for i in range(first, first + n):
        span = spans.add()
        span.name, span.span_id = "kvtrace.engine.step", (1).to_bytes(8, "big")
        span.trace_id = (i + 1).to_bytes(16, "big")
        span.start_time_unix_nano, span.end_time_unix_nano = 1_000 * i, 1_000 * i + 500
        step = span.attributes.add()
        step.key, step.value.int_value = "kvtrace.step", i
    if record is not None:
        span = spans.add()
        span.name, span.trace_id, span.span_id = "kvtrace.run", b"\xee" * 16, b"\xee" * 8
        for key, value in record.items():
            attr = span.attributes.add()
            attr.key, attr.value.string_value = f"kvtrace.run.{key}", value
    return req.SerializeToString()


def _post(url: str, body: bytes) -> int:
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/x-protobuf"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def _collect(db) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "kvtrace.cli", "collect", "--db", str(db), "--port", "0",
                             "--no-grpc"], stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    ready = proc.stderr.readline()
    m = re.search(r"OTLP/HTTP on (http://\S+/v1/traces)", ready)
    if m is None:
        proc.kill()
        raise AssertionError(ready + proc.communicate()[1])
    return proc, m.group(1)


RECORD = {"status": "complete", "digest": "ab" * 32, "summary": json.dumps({"requests": 7})}


def test_a_retried_export_is_stored_once(tmp_path):
    """An exporter that got no answer sends the same request again: every span was stored
    twice, and every count the run's derived tables hold (evictions, requests, spans) doubled."""
    db = tmp_path / "retry.duckdb"
    collector = OTLPCollector(db, port=0).start()
    try:
        assert _post(collector.url, _export(0, 5)) == 200
        assert _post(collector.url, _export(0, 5)) == 200  # the retry: answered, nothing stored again
        assert _post(collector.url, _export(3, 4)) == 200  # two spans it holds, two new ones
        assert _post(collector.url, _export(0, 2, run_id=None)) == 200  # the same ids in another run: new there
    finally:
        collector.stop()
    assert count_spans(db, RUN) == 7 and count_spans(db, "r1") == 2
    assert runs(db).filter(runs(db)["run_id"] == RUN)["num_spans"][0] == 7
    assert (collector.spans_received, collector.duplicate_spans) == (9, 7)


def test_the_same_span_twice_in_one_request_is_stored_once(tmp_path):
    db = tmp_path / "twice.duckdb"
    req = trace_service_pb2.ExportTraceServiceRequest.FromString(_export(0, 2))
    spans = req.resource_spans[0].scope_spans[0].spans
    spans.add().CopyFrom(spans[0])
    collector = OTLPCollector(db, port=0).start()
    try:
        assert _post(collector.url, req.SerializeToString()) == 200
    finally:
        collector.stop()
    assert count_spans(db, RUN) == 2 and collector.duplicate_spans == 1


def test_a_collector_killed_then_restarted_keeps_what_it_acknowledged_once_and_finishes_the_run(tmp_path):
    """kill -9 after a commit, before the exporter read its 200: the exporter sends the
    request again to the restarted collector, which stored it a second time; the run's
    record, answered 200, was dropped (its status, digest and summary never stored: the run
    stayed ``incomplete``, for a run its producer finished)."""
    db = tmp_path / "killed.duckdb"
    proc, url = _collect(db)
    with reaped(proc):
        assert _post(url, _export(0, 6)) == 200
        assert _post(url, _export(6, 4)) == 200
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert count_spans(db, RUN) == 10  # every acknowledged span survives the kill
    assert run(db, RUN)["status"] == "incomplete"  # its writer died

    proc, url = _collect(db)
    with reaped(proc):
        assert _post(url, _export(6, 4)) == 200  # the retry of the request whose answer the kill cut
        assert _post(url, _export(10, 3, record=RECORD)) == 200
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in err
    # (the record is no span: 3 spans stored, and the run it finished said apart)
    assert "3 spans stored, 4 spans sent again not stored twice, 1 run finished by its record, 0 requests rejected" \
        in err
    assert count_spans(db, RUN) == 13
    got = run(db, RUN)
    assert (got["status"], got["digest"], got["summary"]["requests"]) == ("complete", "ab" * 32, 7)
    assert got["num_spans"] == 13


def test_a_record_after_the_collector_was_stopped_and_started_again_finishes_its_run(tmp_path):
    """A collector stopped normally marks its runs complete, without a digest or summary;
    the producer's record, sent to the next collector on the store, was answered 200 and
    dropped."""
    db = tmp_path / "stopped.duckdb"
    first = OTLPCollector(db, port=0).start()
    try:
        assert _post(first.url, _export(0, 3)) == 200
    finally:
        first.stop()
    assert run(db, RUN)["summary"] is None
    failed = dict(RECORD, status="failed")
    second = OTLPCollector(db, port=0).start()
    try:
        assert _post(second.url, _export(3, 1, record=failed)) == 200
        assert _post(second.url, _export(4, 1, record=RECORD)) == 200  # a second record: the first one stands
    finally:
        second.stop()
    got = run(db, RUN)
    assert (got["status"], got["digest"], got["summary"]["requests"], got["num_spans"]) == ("failed", "ab" * 32, 7, 5)


@pytest.mark.parametrize("record", [True, False])
def test_spans_or_a_record_naming_a_run_no_collector_made_are_refused(tmp_path, record):
    """A run of the store's own (a replay's, say) keeps its status and spans whatever a sender
    naming it says: its spans were added to the replay's with a 200 (its counts no longer the
    replay's); now the request is a 400 and nothing of it is stored."""
    db = tmp_path / "own.duckdb"
    with Store.open(db) as store:
        store.create_run("a replay", run_id=RUN, mode="engine")
        store.finish_run(RUN, status="complete")
    collector = OTLPCollector(db, port=0).start()
    try:
        sent = _export(0, 1, record=dict(RECORD, status="failed")) if record else _export(0, 2)
        assert _post(collector.url, sent) == 400
    finally:
        collector.stop()
    got = run(db, RUN)
    assert (got["status"], got["digest"], got["summary"], got["num_spans"]) == ("complete", None, None, 0)
