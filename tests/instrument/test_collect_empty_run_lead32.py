"""A request whose commit fails after collect made a run for it: the run stayed, finished
``complete`` with no span when the collector stopped, and `kvtrace runs` listed it (found by
the rec32 probe). collect now takes back the runs a refused request made that hold no span;
a run holding spans is never taken back."""

from __future__ import annotations

import duckdb
import pytest

from kvtrace.instrument.otlp import OTLPCollector
from kvtrace.store import Store, read
from tests.instrument.helpers import post_otlp_json
from tests.instrument.test_otlp_fix27 import _attrs


def _resource(run_id: str, seq: int, first: int) -> dict:
    span = {"traceId": f"{first:032x}", "spanId": f"{first:016x}", "name": "kvtrace.request",
            "startTimeUnixNano": str(1000 + first), "endTimeUnixNano": str(2000 + first),
            "attributes": _attrs([("kvtrace.request.id", f"q{seq}"), ("gen_ai.usage.input_tokens", 30),
                                  ("kvtrace.seq", seq)])}
    return {"resource": {"attributes": _attrs([("service.name", "kvtrace"), ("kvtrace.run.id", run_id)])},
            "scopeSpans": [{"spans": [span]}]}


def test_a_refused_request_leaves_no_run_it_made(tmp_path):
    db = str(tmp_path / "c.duckdb")
    collector = OTLPCollector(db, port=0).start()
    try:
        assert post_otlp_json(collector.url, {"resourceSpans": [_resource("A", 0, 1)]})[0] == 200
        collector.store.release()
        with duckdb.connect(db) as con:  # run A taken over by another writer: its next commit is refused
            con.execute("UPDATE runs SET writer_start = 'other' WHERE run_id = 'A'")
        status, _ = post_otlp_json(collector.url, {"resourceSpans": [_resource("B", 0, 11), _resource("A", 1, 21)]})
        assert status >= 500
    finally:
        collector.stop()
    runs = read.runs(db)
    assert runs["run_id"].to_list() == ["A"]  # B, made for the refused request, is gone
    assert read.run(db, "A")["num_spans"] == 1


def test_a_run_that_holds_spans_is_not_taken_back(tmp_path):
    from tests.support.synthetic_spans import simulate, write_steps

    db = str(tmp_path / "s.duckdb")
    with Store.open(db) as store:
        full = store.create_run("full")
        write_steps(store, full, simulate(False, 4, 32, 1)[0], 1)
        store.flush()
        empty = store.create_run("empty")
        assert not store.drop_empty_run(full)
        assert store.drop_empty_run(empty)
        assert not store.drop_empty_run(empty)  # (gone: nothing to take back)
        store.finish_run(full)
    assert read.runs(db)["run_id"].to_list() == [full]


@pytest.mark.parametrize("finished", [True, False])
def test_only_a_run_this_store_made_and_has_not_finished_is_taken_back(tmp_path, finished):
    db = str(tmp_path / "s.duckdb")
    with Store.open(db) as store:
        run = store.create_run("r")
        if finished:
            store.finish_run(run)
    with Store.open(db) as store:  # another writer's (or a finished one): never this store's to take back
        assert not store.drop_empty_run(run)
    assert read.runs(db)["run_id"].to_list() == [run]


def test_a_chdb_store_takes_back_an_empty_run_too(tmp_path):
    db = f"chdb:{tmp_path / 'ch'}"
    with Store.open(db) as store:
        kept = store.create_run("kept")
        empty = store.create_run("empty")
        assert store.drop_empty_run(empty)
        store.finish_run(kept)
    assert read.runs(db)["run_id"].to_list() == [kept]
