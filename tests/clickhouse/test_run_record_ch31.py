"""One rule for a ``kvtrace.run`` record on both collector paths (``store/clickhouse/run_rules.py``):
a record `kvtrace collect` refuses (a 400) names no run and finishes none on the ClickHouse path
too, where a lone record with status ``bogus``, a summary that is no JSON or a rate of 2.0 was
listed as a run, and a refused record beside the run's spans finished it (``incomplete``, its
fields dropped one by one); and a ``complete`` record of a run that lacks spans its summary
counts (``spans``) reads ``incomplete`` with ``otlp_spans_missing`` on both, ``complete`` once
they come (the ClickHouse path called it complete at once)."""

from __future__ import annotations

import json

import pytest

from kvtrace.instrument.otlp import OTLPCollector
from kvtrace.store import Store, read
from kvtrace.store.backend import clickhouse_target
from kvtrace.store.clickhouse import client
from tests.clickhouse.test_ch_probe28 import REQUEST, _doc, _exported, _protobuf
from tests.clickhouse.test_ch_record_run_reprobe30 import _named
from tests.instrument.helpers import post_otlp_json
from tests.support.collector_rows import collector_rows

pytest.importorskip("chdb")

RECORD = "kvtrace.run"


def _span(seq: int) -> tuple[str, dict]:
    return REQUEST, {"kvtrace.request.id": f"q{seq}", "gen_ai.usage.input_tokens": 30, "kvtrace.seq": seq}


def _record(**fields) -> tuple[str, dict]:
    return RECORD, {f"kvtrace.run.{k}": v for k, v in fields.items()}


def _collect(db, requests: list[list[tuple[str, dict]]], first: int = 1) -> list[int]:
    """The answers of `kvtrace collect` (on the DuckDB store ``db``) to one request each (span
    ids from ``first``, 10 a request)."""
    collector = OTLPCollector(db, port=0).start()
    try:
        return [post_otlp_json(collector.url, {"resourceSpans": [_named("r", spans, first + 10 * i)]})[0]
                for i, spans in enumerate(requests)]
    finally:
        collector.stop()


def _listed(db: str) -> dict[str, tuple[str, str | None, str | None]]:
    return {r["run_id"]: (r["status"], r["digest"], r["summary"])
            for r in read.runs(db).select(["run_id", "status", "digest", "summary"]).to_dicts()}


_REFUSED = {
    "a status no run finishes as": _record(status="bogus"),
    "a summary that is no JSON": _record(summary="{not json"),
    "a rate of 2.0": _record(summary=json.dumps({"prefix_cache_hit_rate": 2.0})),
    "hits beyond their queries": _record(summary=json.dumps({"prefix_cache_hits": 9, "prefix_cache_queries": 5})),
    "a collector's own key": _record(summary=json.dumps({"spans": 1, "otlp_spans_missing": 0})),
    "a digest of two words": _record(digest="two words"),
    "a created time without its offset": _record(created="2026-12-07T00:00:00"),
    "a config that is no object": _record(config="[1]"),
}


@pytest.mark.parametrize("case", list(_REFUSED))
def test_a_record_collect_refuses_names_no_run_on_either_path(tmp_path, chdb_store, case):
    record = _REFUSED[case]
    assert _collect(tmp_path / "c.duckdb", [[record]]) == [400]
    assert _listed(str(tmp_path / "c.duckdb")) == {}
    assert _listed(_exported(chdb_store, {"resourceSpans": [_named("r", [record], 1)]})) == {}


def test_a_refused_record_says_why_as_collect_does(tmp_path, chdb_store):
    """collect's 400 names the attribute and the rule; the ClickHouse path kept the reason of
    a refused span in otel_refused_spans and of a refused record nowhere. Noted once, however
    often the store is opened."""
    record = _REFUSED["a rate of 2.0"]
    collector = OTLPCollector(tmp_path / "c.duckdb", port=0).start()
    try:
        status, message = post_otlp_json(collector.url, {"resourceSpans": [_named("r", [record], 1)]})
    finally:
        collector.stop()
    assert status == 400
    _exported(chdb_store, {"resourceSpans": [_named("r", [record], 1)]})
    Store.open(chdb_store).close()
    with client.connect(clickhouse_target(chdb_store)) as con:
        rows = con.ch_frame("SELECT run_id, name, reason FROM otel_refused_spans").rows()
    assert rows == [("r", RECORD, message.split(": ", 1)[1])]
    assert "kvtrace.run.summary: " in rows[0][2]


@pytest.mark.parametrize("case", ["a status no run finishes as", "a rate of 2.0", "a digest of two words"])
def test_a_record_collect_refuses_finishes_no_run_of_spans(chdb_store, case):
    """Beside the run's spans, the refused record finishes nothing: the run reads as it reads
    without a record (``running`` on the ClickHouse path, whose sender may still send one; a
    later record collect takes finishes it), no field of the refused one kept."""
    named = (RECORD, {**_REFUSED[case][1], "kvtrace.run.name": "n"})
    docs = [_named("r", [_span(0)], 1), _named("r", [named], 11)]
    _exported(chdb_store, {"resourceSpans": docs})
    assert _listed(chdb_store) == {"r": ("running", None, None)}
    assert read.runs(chdb_store)["name"].to_list() != ["n"]
    with client.connect(clickhouse_target(chdb_store)) as con:
        con.insert_arrow("otel_traces", collector_rows([_protobuf({"resourceSpans": [
            _named("r", [_record(status="failed", digest="d1")], 21)]})]))
    Store.open(chdb_store).close()
    assert _listed(chdb_store) == {"r": ("failed", "d1", None)}


def test_a_record_whose_resource_names_no_run_finishes_none(chdb_store):
    """collect refuses it (a 400: it finishes no run); the ClickHouse path finished the
    exporter's ``otlp:<service>`` run of the spans beside it with it."""
    docs = [_doc([_span(0), _record(status="failed", digest="d1")])["resourceSpans"][0]]
    _exported(chdb_store, {"resourceSpans": docs})
    assert _listed(chdb_store) == {"otlp:vllm": ("running", None, None)}


def test_a_complete_record_of_a_run_short_of_its_spans_reads_incomplete_until_they_come(tmp_path, chdb_store):
    summary = json.dumps({"spans": 3})
    record = _record(status="complete", summary=summary, digest="d1")
    duck = tmp_path / "c.duckdb"
    # collect: the record first, then one span, then the rest
    assert _collect(duck, [[record]]) == [200]
    first = _listed(str(duck))["r"]
    assert first[0] == "incomplete" and json.loads(first[2]) == {"spans": 3, "otlp_spans_missing": 3}
    assert _collect(duck, [[_span(0)]], 11) == [200]
    second = _listed(str(duck))["r"]
    assert second[0] == "incomplete" and json.loads(second[2]) == {"spans": 3, "otlp_spans_missing": 2}
    assert _collect(duck, [[_span(1), _span(2)]], 21) == [200]
    assert _listed(str(duck))["r"][0] == "complete" and json.loads(_listed(str(duck))["r"][2]) == {"spans": 3}

    # the ClickHouse path, the same requests in the same order, each read at the next open
    def add(spans, first_id):
        with client.connect(clickhouse_target(chdb_store)) as con:
            con.insert_arrow("otel_traces", collector_rows([_protobuf({"resourceSpans": [
                _named("r", spans, first_id)]})]))
        Store.open(chdb_store).close()
        status, digest, text = _listed(chdb_store)["r"]
        return status, digest, json.loads(text)

    Store.open(chdb_store).close()
    assert add([record], 1) == ("incomplete", "d1", {"spans": 3, "otlp_spans_missing": 3})
    assert add([_span(0)], 11) == ("incomplete", "d1", {"spans": 3, "otlp_spans_missing": 2})
    assert add([_span(1), _span(2)], 21) == ("complete", "d1", {"spans": 3})
    assert read.runs(chdb_store)["num_spans"].to_list() == [3] == read.runs(str(duck))["num_spans"].to_list()
