"""The twenty-third session's probe of ``kvtrace collect``: what a collected run's readers are told."""

from __future__ import annotations

import json
import urllib.request

import pytest

from kvtrace.instrument.otlp import OTLPCollector
from kvtrace.store.read import run, runs
from tests.instrument.helpers import count_spans

TRACE = "6c9a0b1d2e3f405162738495a6b7c8d9"


def _body(spans: list[dict], run_id: str = "late-run") -> bytes:
    resource = [{"key": "service.name", "value": {"stringValue": "probe"}},
                {"key": "kvtrace.run.id", "value": {"stringValue": run_id}}]
    return json.dumps({"resourceSpans": [{"resource": {"attributes": resource},
                                          "scopeSpans": [{"spans": spans}]}]}).encode()


def _span(i: int, attributes: list[dict] | None = None) -> dict:
    return {"traceId": TRACE, "spanId": f"{i:016x}", "name": "kvtrace.cache.free",
            "startTimeUnixNano": str(1000 + i), "endTimeUnixNano": str(1000 + i),
            "attributes": attributes or [{"key": "kvtrace.step", "value": {"intValue": str(i)}}]}


def _record(i: int) -> dict:
    attrs = [{"key": "kvtrace.run.status", "value": {"stringValue": "complete"}},
             {"key": "kvtrace.run.summary", "value": {"stringValue": '{"requests": 1}'}}]
    return {"traceId": TRACE, "spanId": f"{i:016x}", "name": "kvtrace.run",
            "startTimeUnixNano": "0", "endTimeUnixNano": "10", "attributes": attrs}


def _post(url: str, body: bytes) -> tuple[int, str]:
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _listed_spans(db, run_id: str) -> int:
    """The span count ``kvtrace runs`` shows for the run (its derived tables once finished)."""
    listed = runs(db)
    return int(listed.filter(listed["run_id"] == run_id)["num_spans"][0])


def test_spans_after_a_runs_record_are_counted_while_the_collector_serves(tmp_path):
    """Spans that came after their run's record (a forwarding collector's parallel senders
    reorder requests) were stored with a 200, but the run's derived tables stayed as the
    record's moment built them until the collector stopped: a dashboard or ``runs`` reading
    the live store saw 0 spans (and 0 evictions) for a complete run holding 3."""
    db = tmp_path / "late.duckdb"
    collector = OTLPCollector(db, port=0, late_refresh_s=0.05).start()
    try:
        assert _post(collector.url, _body([_record(99)]))[0] == 200  # the record first: finished, empty
        assert _listed_spans(db, "late-run") == 0
        assert _post(collector.url, _body([_span(i) for i in (1, 2, 3)]))[0] == 200  # then its spans
        assert collector.wait_late_refreshed(timeout=30)
        assert _listed_spans(db, "late-run") == count_spans(db, "late-run") == 3  # read while it serves
        assert run(db, "late-run")["status"] == "complete"
    finally:
        collector.stop()
    assert _listed_spans(db, "late-run") == 3 and run(db, "late-run")["summary"] == {"requests": 1}


def test_the_count_of_spans_stored_leaves_out_run_records(tmp_path):
    """A ``kvtrace.run`` record was counted as a stored span: a replay of 2,431 spans was
    "2,432 spans stored" by collect beside 2,431 in ``runs``, and a retried record one more."""
    db = tmp_path / "count.duckdb"
    collector = OTLPCollector(db, port=0).start()
    body = _body([_span(1), _span(2), _span(3), _record(99)])
    try:
        assert _post(collector.url, body)[0] == 200
        assert _post(collector.url, body)[0] == 200  # retried whole: nothing stored again
    finally:
        collector.stop()
    assert collector.spans_received == count_spans(db, "late-run") == _listed_spans(db, "late-run") == 3
    assert collector.duplicate_spans == 3 and collector.runs_recorded == 1


@pytest.mark.parametrize("text", ["1.5", "-2e3", "1E+2", "0", "-0.5e-3"])
def test_a_double_written_as_a_string_is_read_as_its_number(tmp_path, text):
    """proto3 JSON lets a double be a string ("1.5"), as the OTel Collector reads it: it was a
    400, and the exporter's whole request was lost."""
    db = tmp_path / "double.duckdb"
    collector = OTLPCollector(db, port=0).start()
    try:
        as_text = [{"key": "x.ratio", "value": {"doubleValue": text}}]
        as_number = [{"key": "x.ratio", "value": {"doubleValue": float(text)}}]
        assert _post(collector.url, _body([_span(1, as_text)], "as-text")) == (200, "{}")
        assert _post(collector.url, _body([_span(1, as_number)], "as-number")) == (200, "{}")
    finally:
        collector.stop()
    from tests.instrument.helpers import store_rows

    got, want = store_rows(db, "as-text"), store_rows(db, "as-number")
    # (as the OTel Collector's ClickHouse exporter writes a double: Go's shortest text, "-2000" for -2e3)
    from kvtrace.instrument.convert import exporter_text

    assert got[0]["extra_attributes"] == want[0]["extra_attributes"] == {"x.ratio": exporter_text(float(text))}


@pytest.mark.parametrize("text", ["1_0", " 1.5", "inf", "nan", "0x10", "", "01", ".5"])
def test_a_string_that_is_no_json_number_is_still_refused_as_a_double(tmp_path, text):
    db = tmp_path / "bad-double.duckdb"
    collector = OTLPCollector(db, port=0).start()
    try:
        status, reply = _post(collector.url, _body([_span(1, [{"key": "x", "value": {"doubleValue": text}}])]))
    finally:
        collector.stop()
    assert status == 400 and "x.doubleValue: expected a number" in json.loads(reply)["message"]
    assert count_spans(db, "late-run") == 0


def test_a_collected_run_is_paired_with_the_stored_replay_of_its_trace(tmp_path, replayed_store):
    """The record's trace digest was dropped: ``diff`` of a replay and its collected twin (the
    same replay sent over OTLP) said they "replay different traces ('gen:…' vs None)" and
    needed --force, where the ClickHouse collector path keeps it."""
    import shutil

    from kvtrace.compare.source import diff_runs

    db = tmp_path / "pair.duckdb"
    shutil.copy(replayed_store.path, db)
    stored = run(db, replayed_store.run_on)
    attrs = [{"key": f"kvtrace.run.{k}", "value": {"stringValue": v}}
             for k, v in (("status", "complete"), ("trace_digest", stored["trace_digest"]),
                          ("summary", json.dumps(stored["summary"])))]
    collector = OTLPCollector(db, port=0).start()
    try:
        record = _record(99) | {"attributes": attrs}
        assert _post(collector.url, _body([_span(1), record], "twin-1"))[0] == 200
    finally:
        collector.stop()
    assert run(db, "twin-1")["trace_digest"] == stored["trace_digest"]
    got = diff_runs(str(db), replayed_store.run_on, "twin-1", resamples=100)  # no --force needed
    assert got.same_trace and not got.forced


@pytest.mark.parametrize("value", [{"stringValue": ""}, {"stringValue": "a b"},
                                   {"stringValue": "x" * 129}])
def test_a_trace_digest_no_run_could_hold_refuses_the_record_whole(tmp_path, value):
    db = tmp_path / "bad-digest.duckdb"
    collector = OTLPCollector(db, port=0).start()
    try:
        record = _record(99) | {"attributes": [{"key": "kvtrace.run.trace_digest", "value": value}]}
        status, reply = _post(collector.url, _body([_span(1), record], "bad-digest"))
    finally:
        collector.stop()
    assert status == 400 and "kvtrace.run.trace_digest: expected 1 to 128 printable" in json.loads(reply)["message"]
    assert count_spans(db, "bad-digest") == 0


def test_the_largest_body_limit_the_help_gives_serves_grpc_too(tmp_path):
    """``--max-body-bytes 2147483648`` (the help's "1 to 2,147,483,648") was a traceback at
    start: gRPC's receive limit is a C int (2^31 - 1 at most)."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    from kvtrace.instrument.otlp.grpc import EXPORT_METHOD
    from kvtrace.instrument.otlp.limits import MAX_BODY_BYTES

    db = tmp_path / "largest.duckdb"
    collector = OTLPCollector(db, port=0, grpc_port=0, max_body_bytes=MAX_BODY_BYTES).start()
    try:
        req = trace_service_pb2.ExportTraceServiceRequest()
        span = req.resource_spans.add().scope_spans.add().spans.add()
        span.name, span.trace_id, span.span_id, span.end_time_unix_nano = "x", b"\x01" * 16, b"\x02" * 8, 5
        with grpc.insecure_channel(collector.grpc_target) as channel:
            channel.unary_unary(EXPORT_METHOD)(req.SerializeToString(), timeout=30)
    finally:
        collector.stop()
    assert collector.spans_received == 1


def test_late_runs_are_rebuilt_one_a_turn_so_no_export_waits_behind_them_all(tmp_path):
    """The late rebuild rebuilt every late run at once under the lock each request takes
    (0.15 s a run): 120 runs held every export 16 s, past an SDK's 10 s timeout. One run a
    turn, in the order they became late; a failed rebuild waits for the close."""
    db = tmp_path / "turns.duckdb"
    collector = OTLPCollector(db, port=0, late_refresh_s=1.0)
    turns: list[list[str]] = []
    real_turn, real_refresh = collector._refresh_late, collector._refresh

    def turn() -> None:
        turns.append([])
        real_turn()

    def refresh(run_id: str) -> bool:
        turns[-1].append(run_id) if turns else None
        return run_id != "run-b" and real_refresh(run_id)  # (run-b's rebuild fails)

    collector._refresh_late, collector._refresh = turn, refresh
    collector.start()
    names = ["run-c", "run-a", "run-b"]
    try:
        for name in names:
            assert _post(collector.url, _body([_record(99)], name))[0] == 200
        for name in names:  # (all three late before the first turn, a second away)
            assert _post(collector.url, _body([_span(1)], name))[0] == 200
        assert collector.wait_late_refreshed(timeout=30)
        done = [t for t in turns if t]
        assert all(len(t) == 1 for t in done) and [t[0] for t in done][:3] == names  # (one a turn, in order)
        assert _listed_spans(db, "run-a") == _listed_spans(db, "run-c") == 1  # (rebuilt while it serves)
        assert _listed_spans(db, "run-b") == 0  # (its rebuild failed: tried again at the close)
        collector._refresh = real_refresh
    finally:
        collector.stop()
    assert [_listed_spans(db, name) for name in names] == [1, 1, 1]


def test_an_opening_collector_rebuilds_a_finished_run_an_earlier_one_left_short(tmp_path):
    """A collector killed after storing a finished run's late spans but before rebuilding
    its derived tables left the run's counts short for good: ``runs`` said 0 spans of a
    complete run holding 3, whatever collector opened the store next."""
    db = tmp_path / "killed.duckdb"
    first = OTLPCollector(db, port=0, late_refresh_s=3600).start()
    assert _post(first.url, _body([_record(99)]))[0] == 200
    assert _post(first.url, _body([_span(i) for i in (1, 2, 3)]))[0] == 200
    first._close_servers()  # (a kill -9 now: the spans committed, the rebuild an hour away, never run)
    first.store.close()
    first.guard.close()
    assert _listed_spans(db, "late-run") == 0 and count_spans(db, "late-run") == 3
    second = OTLPCollector(db, port=0, late_refresh_s=0.05).start()
    try:
        assert second.wait_late_refreshed(timeout=30)
        assert _listed_spans(db, "late-run") == 3
    finally:
        second.stop()
    assert run(db, "late-run")["status"] == "complete" and run(db, "late-run")["summary"] == {"requests": 1}


def test_a_collected_replay_keeps_its_records_name_trace_config_and_behaviours(tmp_path):
    """kvtrace collect kept a record's status, digest, summary and trace digest alone: a
    collected replay read "trace None" in runs (diff of two refused as "None, read
    differently"), its Times as "as received" where a cost model made them, and no config,
    where the ClickHouse collector's run carries the whole record. Its mode stays otlp."""
    from kvtrace.metrics import times_source
    from kvtrace.replay.run import RunSpec, run_replay

    spec = RunSpec("gen:chat", limit=12, capacity_blocks=80, content=False, without=("shared-prefix-pinning",))
    direct = run_replay(spec, db=str(tmp_path / "direct.duckdb"))
    db = tmp_path / "collected.duckdb"
    collector = OTLPCollector(db, port=0).start()
    try:
        sent = run_replay(spec, otlp_endpoint=collector.url)
    finally:
        collector.stop()
    (collected,) = runs(db)["run_id"].to_list()
    assert sent.summary["requests"] == 12
    ours, theirs = run(db, collected), run(tmp_path / "direct.duckdb", direct.run_id)
    for key in ("name", "trace_source", "trace_digest", "config", "behaviours", "digest"):
        assert ours[key] == theirs[key] and theirs[key], key
    assert ours["mode"] == "otlp" and ours["status"] == "complete"
    assert times_source(ours["mode"], ours["config"]["cost_model"]["name"]).startswith("modelled by cost model")
    assert ours["trace_source"] == "gen:chat"


@pytest.mark.parametrize(("key", "value", "said"), [
    ("config", "[1, 2]", "a JSON object"), ("behaviours", '{"a": 1}', "a JSON list of names"),
    ("behaviours", "[1]", "a JSON list of names"), ("name", "x" * (1 << 20 + 1), "at most"),
    ("created", "not a time", "an ISO 8601 time"), ("created", "2026-12-06T07:00:00", "UTC offset"),
    ("config", '{"backend": 7}', "backend: expected a string"),
])
def test_a_records_bad_descriptive_field_refuses_the_request_naming_it(tmp_path, key, value, said):
    db = tmp_path / "bad.duckdb"
    collector = OTLPCollector(db, port=0).start()
    try:
        record = _record(99)
        record["attributes"].append({"key": f"kvtrace.run.{key}", "value": {"stringValue": value}})
        code, body = _post(collector.url, _body([record]))
    finally:
        collector.stop()
    assert code == 400 and f"kvtrace.run.{key}: " in body and said in body
    assert not runs(db).height


def test_a_records_created_is_kept_in_utc(tmp_path):
    """created times sort as text in every listing: 2026-12-06T23:00:00-12:00 sorted before
    times hours earlier. They are kept in UTC, as kvtrace writes its own."""
    db = tmp_path / "created.duckdb"
    collector = OTLPCollector(db, port=0).start()
    try:
        record = _record(99)
        created = {"stringValue": "2026-12-06T23:00:00-12:00"}
        record["attributes"].append({"key": "kvtrace.run.created", "value": created})
        assert _post(collector.url, _body([record]))[0] == 200
    finally:
        collector.stop()
    assert run(db, "late-run")["created"] == "2026-12-07T11:00:00+00:00"
