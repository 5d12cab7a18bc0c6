"""A named run's span's ``kvtrace.seq`` (its place in its run), one rule on both collector paths:
a whole number from 0 to 2^62 - 1 read as the exporter's text of it (the README's rule for a
count: a whole number, "7" or 7.0), one value. `kvtrace collect` refused "5" and 5.0 (a 400) that
the ClickHouse path stored at seq 5; the ClickHouse path stored -5 and 2^62 at that seq, 'x' and
1.5 at the span's start time, and of two values the first, where collect refused each (a 400).
Now collect takes "5" and 5.0, and the ClickHouse path leaves the others out, collect's reason in
``otel_refused_spans``."""

from __future__ import annotations

import pytest

from kvtrace.instrument.otlp import OTLPCollector
from kvtrace.store import Store
from kvtrace.store.backend import clickhouse_target
from kvtrace.store.clickhouse import client
from tests.clickhouse.test_run_records_rec32 import _named
from tests.instrument.helpers import post_otlp_json
from tests.instrument.test_otlp_fix27 import _protobuf
from tests.support.collector_rows import collector_rows

pytest.importorskip("chdb")

_CASES = {  # run id -> (kvtrace.seq as sent, the seq both store, else None: both refuse it)
    "int": (7, 7),
    "text": ("5", 5),
    "double": (5.0, 5),
    "largest": ((1 << 62) - 1, (1 << 62) - 1),
    "negative": (-5, None),
    "past": (1 << 62, None),
    "fraction": (1.5, None),
    "word": ("x", None),
    "bool": (True, None),
}
_SAID = "kvtrace.seq: expected an integer from 0 to 2^62 - 1 (the span's place in its run)"


def _doc(run_id: str, seq, i: int) -> dict:
    return _named(run_id, [("kvtrace.request", {"kvtrace.request.id": "q", "gen_ai.usage.input_tokens": 3,
                                                "kvtrace.seq": seq})], 10 * i + 1)


@pytest.fixture(scope="module")
def both(tmp_path_factory, _held_chdb) -> tuple[dict, dict, dict]:
    """(collect's answers, its stored seq by run, the ClickHouse path's stored seq by run and its reasons)."""
    from tests.clickhouse.conftest import empty_chdb_store

    db = _held_chdb[0]
    empty_chdb_store(*_held_chdb)
    duck = tmp_path_factory.mktemp("seq") / "c.duckdb"
    answers = {}
    collector = OTLPCollector(duck, port=0).start()
    try:
        for i, (run_id, (seq, _)) in enumerate(_CASES.items()):
            answers[run_id] = post_otlp_json(collector.url, {"resourceSpans": [_doc(run_id, seq, i)]})
    finally:
        collector.stop()
    import duckdb

    with duckdb.connect(str(duck), read_only=True) as con:
        collected = dict(con.execute("SELECT run_id, seq FROM spans").fetchall())
    Store.open(db).close()
    rows = collector_rows([_protobuf({"resourceSpans": [_doc(r, s, i)]})
                           for i, (r, (s, _)) in enumerate(_CASES.items())])
    with client.connect(clickhouse_target(db)) as con:
        con.insert_arrow("otel_traces", rows)
    Store.open(db).close()
    with client.connect(clickhouse_target(db)) as con:
        exported = dict(con.ch_frame("SELECT run_id, seq FROM spans").rows())
        reasons = dict(con.ch_frame("SELECT run_id, reason FROM otel_refused_spans").rows())
    return answers, collected, {"seq": exported, "reasons": reasons}


@pytest.mark.parametrize("run_id", list(_CASES))
def test_a_named_runs_seq_is_read_alike_on_both_paths(both, run_id):
    answers, collected, exported = both
    _, want = _CASES[run_id]
    assert collected.get(run_id) == exported["seq"].get(run_id) == want
    status, message = answers[run_id]
    if want is None:
        assert status == 400 and _SAID in message
        assert exported["reasons"][run_id] == _SAID
    else:
        assert status == 200 and run_id not in exported["reasons"]


def test_a_seq_given_twice_with_two_values_is_refused_on_both_paths(tmp_path, chdb_store):
    doc = _doc("twice", 1, 0)
    doc["scopeSpans"][0]["spans"][0]["attributes"].append({"key": "kvtrace.seq", "value": {"intValue": "2"}})
    collector = OTLPCollector(tmp_path / "c.duckdb", port=0).start()
    try:
        status, message = post_otlp_json(collector.url, {"resourceSpans": [doc]})
    finally:
        collector.stop()
    assert status == 400 and "attribute 'kvtrace.seq' given twice" in message
    rows = collector_rows([_protobuf({"resourceSpans": [_doc("twice", 1, 0)]})])
    i = rows.column_names.index("SpanAttributes")
    import pyarrow as pa

    pairs = rows.column(i).to_pylist()
    rows = rows.set_column(i, "SpanAttributes", pa.array([[*p, ("kvtrace.seq", "2")] for p in pairs],
                                                          pa.map_(pa.string(), pa.string())))
    with client.connect(clickhouse_target(chdb_store)) as con:
        con.insert_arrow("otel_traces", rows)
    Store.open(chdb_store).close()
    with client.connect(clickhouse_target(chdb_store)) as con:
        assert con.ch_frame("SELECT count() AS n FROM spans")["n"][0] == 0
        (reason,) = con.ch_frame("SELECT reason FROM otel_refused_spans")["reason"].to_list()
    assert reason == "attribute 'kvtrace.seq' given twice with two values (an attribute key is unique)"
