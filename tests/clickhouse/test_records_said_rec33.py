"""A ``kvtrace.run`` record the ClickHouse path leaves out says why in ``otel_refused_spans``, as
the README says of it and as a span's reason is there: one holding bytes that are no UTF-8
(cd43990 left it out unsaid: its reason was noted of spans alone), and one whose ids collect
refuses (left out unsaid too)."""

from __future__ import annotations

import pytest

from kvtrace.store import Store
from kvtrace.store.backend import clickhouse_target
from kvtrace.store.clickhouse import client
from tests.clickhouse.test_run_records_rec32 import _rows

pytest.importorskip("chdb")

_CASES = {  # (trace id, run id, record attributes, the reason)
    "a name of bytes that are no UTF-8": (
        "'1' * 32", "'r'", "map('kvtrace.run.status', 'complete', 'kvtrace.run.name', concat('a', unhex('ff')))",
        "a string that is no UTF-8 text: not an ExportTraceServiceRequest"),
    "a run id of bytes that are no UTF-8": (
        "'1' * 32", "concat('r', unhex('fe'))", "map('kvtrace.run.status', 'complete')",
        "a string that is no UTF-8 text: not an ExportTraceServiceRequest"),
    "a trace id of no hex": (
        "'z' * 32", "'r'", "map('kvtrace.run.status', 'complete')",
        "TraceId: not a trace id (32 hex digits, not all zeros)"),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_a_record_left_out_says_why(chdb_store, case):
    trace, run_id, attrs, why = _CASES[case]
    trace_sql = "'" + eval(trace) + "'"  # (a literal of 32 characters)
    Store.open(chdb_store).close()
    with client.connect(clickhouse_target(chdb_store)) as con:
        con.command("INSERT INTO otel_traces (Timestamp, TraceId, SpanId, SpanName, ServiceName, ResourceAttributes, "
                    f"SpanAttributes, Duration) VALUES (toDateTime64('2026-01-01 00:00:00', 9), {trace_sql}, "
                    f"'{'2' * 16}', 'kvtrace.run', 'svc', map('kvtrace.run.id', {run_id}), {attrs}, 10)")
    Store.open(chdb_store).close()
    Store.open(chdb_store).close()  # (said once, at every open after too)
    assert _rows(chdb_store) == {}
    with client.connect(clickhouse_target(chdb_store)) as con:
        said = con.ch_frame("SELECT name, run_id, reason FROM otel_refused_spans").rows()
    assert [(name, reason) for name, _, reason in said] == [("kvtrace.run", why)]
    assert said[0][1].startswith("r")
