"""An opening ``kvtrace.run`` record (status ``running``, no digest, no summary), which a kvtrace
export sends with its first export, on both collector paths: a run's name, trace, config,
behaviours and created time travelled only in the record its sender sends at its end, so a
replay killed with -9 left a collected copy of spans with no settings (its views took the
defaults: percentiles 50/90/99 where the replay asked 25/99.9). The opening record sets those
fields where no record set them, finishes nothing, marks nothing in recorded_runs and counts as
no span; the finishing record's fields win; one after it, or a second one, changes nothing. A
record ``running`` of another shape (a digest, a summary) is refused, as any ``running`` was."""

from __future__ import annotations

import json

import duckdb
import pytest

from kvtrace.instrument.otlp import OTLPCollector
from kvtrace.store import Store, read
from kvtrace.store.backend import clickhouse_target
from kvtrace.store.clickhouse import client
from tests.clickhouse.test_run_records_rec32 import _named
from tests.instrument.helpers import post_otlp_json
from tests.instrument.test_otlp_fix27 import _protobuf
from tests.support.collector_rows import collector_rows

pytest.importorskip("chdb")

FIELDS = ["status", "digest", "summary", "name", "config", "behaviours", "created", "trace_source"]
CONFIG = {"block_size": 16, "percentiles": [25.0, 99.9]}
OPENING = {"status": "running", "name": "r-open", "config": json.dumps(CONFIG), "behaviours": '["b"]',
           "trace_source": "t.jsonl", "trace_digest": "td0", "created": "2026-01-02T03:04:05+00:00"}
FINAL = {"status": "complete", "name": "r-final", "config": json.dumps({**CONFIG, "block_size": 32}),
         "digest": "d1", "summary": json.dumps({"requests": 1}), "created": "2026-01-02T03:04:06+00:00"}


def _span(seq: int) -> tuple[str, dict]:
    return "kvtrace.request", {"kvtrace.request.id": f"q{seq}", "gen_ai.usage.input_tokens": 3, "kvtrace.seq": seq}


def _rec(fields: dict) -> tuple[str, dict]:
    return "kvtrace.run", {f"kvtrace.run.{k}": v for k, v in fields.items()}


def _req(spans: list[tuple[str, dict]], first: int, run_id: str = "r") -> dict:
    return {"resourceSpans": [_named(run_id, spans, first)]}


def _rows(db: str) -> dict[str, dict]:
    return {r.pop("run_id"): r for r in read.runs(db).select(["run_id", *FIELDS]).to_dicts()}


def _collect(db, requests: list[dict], restart_before: int | None = None) -> list[int]:
    """Each request to `kvtrace collect` on ``db`` in turn (a fresh collector from ``restart_before``)."""
    answers = []
    collector = OTLPCollector(db, port=0).start()
    try:
        for i, doc in enumerate(requests):
            if i == restart_before:
                collector.stop()
                collector = OTLPCollector(db, port=0).start()
            answers.append(post_otlp_json(collector.url, doc)[0])
    finally:
        collector.stop()
    return answers


def _export(db: str, requests: list[dict], open_between: bool = True) -> str:
    """The ClickHouse path: the exporter's rows of each request, the store opened after each."""
    Store.open(db).close()
    for doc in requests:
        with client.connect(clickhouse_target(db)) as con:
            con.insert_arrow("otel_traces", collector_rows([_protobuf(doc)]))
        if open_between:
            Store.open(db).close()
    Store.open(db).close()
    return db


def _marked(db: str) -> set[str]:
    if db.startswith("chdb:"):
        with client.connect(clickhouse_target(db)) as con:
            return set(con.ch_frame("SELECT run_id FROM recorded_runs")["run_id"].to_list())
    with duckdb.connect(db, read_only=True) as con:
        return {r[0] for r in con.execute("SELECT run_id FROM recorded_runs").fetchall()}


def _span_count(db: str) -> int:
    return int(read.runs(db).filter(read.runs(db)["run_id"] == "r")["num_spans"][0] or 0)


@pytest.fixture
def stores(tmp_path, _held_chdb):
    from tests.clickhouse.conftest import empty_chdb_store

    empty_chdb_store(*_held_chdb)
    return str(tmp_path / "c.duckdb"), _held_chdb[0]


def test_opening_then_spans_keeps_the_settings_of_a_run_never_finished(stores):
    duck, ch = stores
    reqs = [_req([_rec(OPENING)], 1), _req([_span(0), _span(1)], 11)]
    assert _collect(duck, reqs) == [200, 200]
    _export(ch, reqs)
    got = {db: _rows(db)["r"] for db in (duck, ch)}
    for db, row in got.items():
        assert (row["name"], json.loads(row["config"]), row["behaviours"], row["trace_source"]) == \
            ("r-open", CONFIG, '["b"]', "t.jsonl"), db
        assert row["created"].startswith("2026-01-02T03:04:05"), db
        assert (row["digest"], row["summary"]) == (None, None), db
        assert _span_count(db) == 2, db  # (the record is no span)
        assert _marked(db) == set(), db
    assert got[duck]["status"] == "incomplete"  # (the collector stopped without its record)
    assert got[ch]["status"] == "running"


def test_an_opening_record_alone_leaves_its_run_running_then_incomplete(stores):
    duck, ch = stores
    collector = OTLPCollector(duck, port=0).start()
    try:
        assert post_otlp_json(collector.url, _req([_rec(OPENING)], 1))[0] == 200
        assert collector.spans_received == 0 and collector.runs_recorded == 0
        assert _rows(duck)["r"]["status"] == "running"
    finally:
        collector.stop()
    assert _rows(duck)["r"]["status"] == "incomplete"
    _export(ch, [_req([_rec(OPENING)], 1)])
    assert (_rows(ch)["r"]["status"], _rows(ch)["r"]["name"]) == ("running", "r-open")


@pytest.mark.parametrize("restart", [False, True])
def test_the_finishing_record_finishes_and_its_fields_win(stores, restart):
    duck, ch = stores
    reqs = [_req([_rec(OPENING)], 1), _req([_span(0)], 11), _req([_rec(FINAL)], 21)]
    assert _collect(duck, reqs, restart_before=2 if restart else None) == [200, 200, 200]
    _export(ch, reqs)
    for db in (duck, ch):
        row = _rows(db)["r"]
        assert (row["status"], row["digest"], row["name"]) == ("complete", "d1", "r-final"), db
        assert json.loads(row["config"])["block_size"] == 32, db
        assert row["behaviours"] == '["b"]', db  # (the opening's, where the final sent none)
        assert row["created"].startswith("2026-01-02T03:04:06"), db
        assert _marked(db) == ({"r"} if db == duck else set()), db  # (the exporter's path marks none)
        assert _span_count(db) == 1, db


@pytest.mark.parametrize("order", ["final first", "one request", "opening twice"])
def test_an_opening_record_after_the_final_or_twice_changes_nothing(stores, order):
    duck, ch = stores
    later = _rec({**OPENING, "name": "r-late", "config": '{"block_size": 64}'})
    if order == "final first":
        reqs = [_req([_span(0)], 1), _req([_rec(FINAL)], 11), _req([later], 21)]
        want = ("complete", "r-final", 32)
    elif order == "one request":  # (the opening later in time than the final: the ClickHouse path's order)
        doc = _req([_span(0), _rec(FINAL), later], 1)
        for span in doc["resourceSpans"][0]["scopeSpans"][0]["spans"][2:]:
            span["startTimeUnixNano"], span["endTimeUnixNano"] = "9000", "9000"
        reqs, want = [doc], ("complete", "r-final", 32)
    else:
        reqs = [_req([_rec(OPENING)], 1), _req([_span(0)], 11), _req([later], 21)]
        want = ("incomplete", "r-open", 16)
    assert set(_collect(duck, reqs)) == {200}
    _export(ch, reqs)
    for db in (duck, ch):
        row = _rows(db)["r"]
        status = "running" if db == ch and want[0] == "incomplete" else want[0]
        assert (row["status"], row["name"], json.loads(row["config"])["block_size"]) == (status, *want[1:]), db


_HOSTILE = {
    "a digest": ({"digest": "d"}, "kvtrace.run.status: running is an opening record's, which carries no digest"),
    "a summary": ({"summary": '{"requests": 1}'}, "carries no summary"),
    "a config of no JSON": ({"config": "{"}, "kvtrace.run.config: expected a JSON object"),
    "a config past 1 MiB": ({"config": json.dumps({"x": "a" * (1 << 20)})}, "kvtrace.run.config: expected a string"),
    "behaviours of no list": ({"behaviours": '{"a": 1}'}, "kvtrace.run.behaviours: expected a JSON list"),
    "a created time without offset": ({"created": "2026-01-02T03:04:05"}, "kvtrace.run.created: expected"),
    "a trace digest of two words": ({"trace_digest": "a b"}, "kvtrace.run.trace_digest: expected"),
}


@pytest.mark.parametrize("case", list(_HOSTILE))
def test_a_hostile_opening_record_is_refused_on_both_paths(stores, case):
    duck, ch = stores
    fields, said = _HOSTILE[case]
    doc = _req([_rec({**OPENING, **fields})], 1)
    collector = OTLPCollector(duck, port=0).start()
    try:
        status, message = post_otlp_json(collector.url, doc)
    finally:
        collector.stop()
    assert status == 400 and said in message
    assert _rows(duck) == {}
    _export(ch, [doc])
    assert _rows(ch) == {}
    with client.connect(clickhouse_target(ch)) as con:
        reasons = con.ch_frame("SELECT reason FROM otel_refused_spans")["reason"].to_list()
    assert len(reasons) == 1 and said in reasons[0]
