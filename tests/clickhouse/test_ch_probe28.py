"""The twenty-eighth session's probe of the ClickHouse collector path: a span that breaks a rule
across its fields is left out there as `kvtrace collect` refuses it (one home for the rules,
``store/clickhouse/span_rules.py``), and a value whose type the exporter's text loses reads the
same number on both paths."""

from __future__ import annotations

import itertools

import pyarrow as pa
import pytest

from kvtrace.instrument.otlp import OTLPCollector
from kvtrace.store import Store, read
from kvtrace.store.backend import clickhouse_target
from kvtrace.store.clickhouse import client
from tests.instrument.helpers import post_otlp_json
from tests.instrument.test_otlp_fix27 import _attrs, _protobuf
from tests.support.collector_rows import as_string, collector_rows

pytest.importorskip("chdb")

REQUEST, LOOKUP = "kvtrace.request", "kvtrace.cache.lookup"
PROMPT, HITS, EXT = "gen_ai.usage.input_tokens", "kvtrace.hit_tokens", "kvtrace.external_hit_tokens"


def _doc(spans: list[tuple[str, dict]], first: int = 1) -> dict:
    out = [{"traceId": f"{i:032x}", "spanId": f"{i:016x}", "name": name, "startTimeUnixNano": str(1000 + i),
            "endTimeUnixNano": str(2000 + i), "attributes": _attrs(list(attrs.items()))}
           for i, (name, attrs) in enumerate(spans, first)]
    return {"resourceSpans": [{"resource": {"attributes": _attrs([("service.name", "vllm")])},
                               "scopeSpans": [{"spans": out}]}]}


def _collected(tmp_path, doc: dict, name: str = "c") -> tuple[str, int]:
    """(the DuckDB store `kvtrace collect` wrote, its answer's status)."""
    db = tmp_path / f"{name}.duckdb"
    collector = OTLPCollector(db, port=0).start()
    try:
        status, _ = post_otlp_json(collector.url, doc)
    finally:
        collector.stop()
    return str(db), status


def _exported(db: str, doc: dict) -> str:
    """The chdb store ``db`` (empty) fed by the ClickHouse exporter's rows of these spans (Go's spelling)."""
    Store.open(db).close()
    with client.connect(clickhouse_target(db)) as con:
        con.insert_arrow("otel_traces", collector_rows([_protobuf(doc)]))
    Store.open(db).close()
    return db


def _ch(db: str, sql: str) -> list[tuple]:
    with client.connect(clickhouse_target(db)) as con:
        return con.ch_frame(sql).rows()


_BROKEN = {  # each breaks one rule `kvtrace collect` refuses a span by
    "hits beyond the prompt": (REQUEST, {PROMPT: 10, HITS: 8, EXT: 4}),
    "hits without a prompt": (REQUEST, {HITS: 20}),
    "external hits beyond their query": (REQUEST, {PROMPT: 100, EXT: 20, "kvtrace.request.external_query_tokens": 5}),
    "re-lookup hits beyond it": (REQUEST, {PROMPT: 100, "kvtrace.request.preempted_hit_tokens": 20,
                                           "kvtrace.request.preempted_query_tokens": 5}),
    "first token before first scheduled": (REQUEST, {"kvtrace.request.first_scheduled_ns": 1700,
                                                     "kvtrace.request.first_token_ns": 1500}),
    "arrival after the end": (REQUEST, {"kvtrace.request.arrival_ns": 5000}),
    "a ttft its times do not give": (REQUEST, {"kvtrace.request.arrival_ns": 1000,
                                               "kvtrace.request.first_token_ns": 1500, "kvtrace.request.ttft_ns": 7}),
    "gaps beyond the first token and the end": (REQUEST, {"kvtrace.request.first_token_ns": 1500,
                                                          "kvtrace.request.itl_ns": [400, 400]}),
    "gaps of 2^62 beyond its start and end": (REQUEST, {"kvtrace.request.itl_ns": [1 << 62, 1 << 62]}),
    "a lookup hitting more than it asked": (LOOKUP, {"kvtrace.lookup.query_tokens": 10, HITS: 20}),
    "a lookup's hits without its query": (LOOKUP, {HITS: 20}),
    # (probe 35: a group's hit rate read 24,900%; a waterfall drew a chunk of negative length)
    "a group's hits beyond the query": (LOOKUP, {"kvtrace.lookup.query_tokens": 10,
                                                 "kvtrace.lookup.hit_tokens_per_group": [5, 15]}),
    "a prefill chunk ending before its start": (REQUEST, {"kvtrace.request.prefill_chunks": [1500, 1200, 4]}),
}


_GOOD = (REQUEST, {"kvtrace.request.id": "ok", PROMPT: 30, HITS: 20})


@pytest.fixture(scope="module")
def _good_collected(tmp_path_factory) -> tuple[str, int]:
    """The DuckDB store `kvtrace collect` wrote of the good request alone, and its answer's
    status: the same for every broken case, so collected once (only read)."""
    return _collected(tmp_path_factory.mktemp("good"), _doc([_GOOD]))


@pytest.mark.parametrize("case", sorted(_BROKEN))
def test_a_span_collect_refuses_by_a_rule_is_left_out_of_the_clickhouse_tables(tmp_path, chdb_store, case,
                                                                               _good_collected):
    """Hits beyond the prompt, times out of order, gaps beyond the request: `kvtrace collect`
    refuses the span (400), while the ClickHouse path stored it, and every read of the run then
    said "damaged kvtrace store ... local_compute -10", or gave an external hit rate of 4."""
    good = _GOOD
    name, attrs = _BROKEN[case]
    doc = _doc([good, (name, {"kvtrace.request.id": "bad", **attrs})])
    assert _collected(tmp_path, _doc([_BROKEN[case]]), "refused")[1] == 400
    duck, status = _good_collected
    assert status == 200
    ch = _exported(chdb_store, doc)
    assert _ch(ch, "SELECT count() FROM spans_request") == [(1,)]
    assert _ch(ch, "SELECT count() FROM spans_lookup") == _ch(ch, "SELECT count() FROM spans_other") == [(0,)]
    assert _ch(ch, "SELECT name, span_id, reason != '' FROM otel_refused_spans") == [(name, f"{2:016x}", True)]
    (run_id,) = read.runs(duck)["run_id"].to_list()
    assert read.hit_counters(ch, "otlp:vllm") == read.hit_counters(duck, run_id)
    assert read.requests(ch, "otlp:vllm")["request_id"].to_list() == ["ok"]


_GRID_COLUMNS = ("start_ns", "end_ns", "arrival_ns", "first_scheduled_ns", "first_token_ns", "ttft_ns",
                 "num_prompt_tokens", "num_hit_tokens", "num_external_hit_tokens", "num_external_query_tokens",
                 "num_query_tokens", "num_preempted_query_tokens", "num_preempted_hit_tokens")


def _grid() -> list[dict]:
    """Requests and lookups whose values sit on either side of every rule (None: not given)."""
    small = (None, 0, 5, 10)
    out = []
    for arr, first, ttft, end in itertools.product((None, 3), (None, 2, 8), (None, 5, 6), (9, 7)):
        out.append({"start_ns": 1, "end_ns": end, "arrival_ns": arr, "first_token_ns": first, "ttft_ns": ttft,
                    "first_scheduled_ns": 4, "itl_ns": [1, 1] if first == 2 else [], "name": REQUEST})
    for prompt, hit, ext, extq in itertools.product(small, small, small, (None, 4)):
        out.append({"start_ns": 1, "end_ns": 2, "num_prompt_tokens": prompt, "num_hit_tokens": hit,
                    "num_external_hit_tokens": ext, "num_external_query_tokens": extq, "name": REQUEST})
        out.append({"start_ns": 1, "end_ns": 2, "num_prompt_tokens": 20, "num_preempted_query_tokens": extq,
                    "num_preempted_hit_tokens": hit, "name": REQUEST})
        out.append({"start_ns": 1, "end_ns": 2, "num_query_tokens": prompt, "num_hit_tokens": hit,
                    "num_external_hit_tokens": ext, "name": LOOKUP})
        out.append({"start_ns": 1, "end_ns": 2, "num_query_tokens": prompt, "name": LOOKUP,
                    "hit_tokens_per_group": [x for x in (hit, ext) if x is not None]})
    for start, end in itertools.product((None, 3), (None, 2, 3, 4)):
        out.append({"start_ns": 1, "end_ns": 9, "name": REQUEST,
                    "prefill_chunks": [{"start_ns": 1, "end_ns": 2, "num_tokens": 1},
                                       {"start_ns": start, "end_ns": end, "num_tokens": 1}]})
    return out


def test_the_rules_in_python_and_in_sql_agree_on_every_span(chdb_store):
    """One home, two spellings: `kvtrace collect` refuses exactly the spans the ClickHouse
    views leave out (``span_problem`` and ``span_problem_sql``)."""
    import json

    from kvtrace.store.clickhouse.span_rules import span_problem, span_problem_sql

    spans = _grid()
    lists = ("itl_ns", "hit_tokens_per_group", "prefill_chunks")
    rows = "\n".join(json.dumps({"i": i, **{c: s.get(c) for c in _GRID_COLUMNS}, **{c: s.get(c) or [] for c in lists}})
                     for i, s in enumerate(spans))
    chunk = "Tuple(start_ns Nullable(Int64), end_ns Nullable(Int64), num_tokens Nullable(Int64))"
    structure = ", ".join(["i Int64", *(f"{c} Nullable(Int64)" for c in _GRID_COLUMNS), "itl_ns Array(Int64)",
                           "hit_tokens_per_group Array(Int64)", f"prefill_chunks Array({chunk})"])
    request, lookup = (span_problem_sql(n, lambda c: c) for n in (REQUEST, LOOKUP))
    names = "[" + ", ".join(f"'{s['name']}'" for s in spans) + "]"
    db = chdb_store  # (a store's server: this process's chdb is the stores')
    whys = [why for _, why in _ch(db, f"SELECT i, if({names}[i + 1] = '{REQUEST}', {request}, {lookup}) AS why "
                                      f"FROM format(JSONEachRow, '{structure}', $${rows}$$) ORDER BY i")]
    python = [span_problem(s["name"], lambda c, s=s: s.get(c) or None if c in lists else s.get(c)) for s in spans]
    assert [w == "" for w in whys] == [p is None for p in python]
    assert 0 < sum(p is None for p in python) < len(python)  # (both sides of the rules)


# A value whose type the exporter's text loses: `kvtrace collect` stored it another way (as an
# extra attribute, the count NULL) than the ClickHouse path (the number its text spells).
_LOST_TYPES = {
    "an integral double of a count": (REQUEST, {"gen_ai.usage.output_tokens": 7.0}),
    "a count given as a string": (REQUEST, {"gen_ai.usage.output_tokens": "7"}),
    "a double given as a string": (REQUEST, {"kvtrace.request.itl_mean_ns": "7.5"}),
    "a request id given as an int": (REQUEST, {"kvtrace.request.id": 7}),
    "integral doubles of gaps": (REQUEST, {"kvtrace.request.itl_ns": [1.0, 2.0]}),
    "a block size as a double": ("kvtrace.block.publish", {"kvtrace.vllm.block_size": 16.0}),
    "cache-read tokens as a double": (REQUEST, {PROMPT: 9, HITS: 4, "gen_ai.usage.cache_read.input_tokens": 4.0}),
    "a huge integral double": (REQUEST, {"gen_ai.usage.output_tokens": 1e21}),
    "a fractional double": (REQUEST, {"gen_ai.usage.output_tokens": 7.5}),
    "a negative integral double": (REQUEST, {"gen_ai.usage.output_tokens": -5.0}),
}
_READ = ("request_id, num_output_tokens, itl_ns, itl_mean_ns, block_size, num_prompt_tokens, num_hit_tokens, "
         "extra_attributes")


@pytest.mark.parametrize("case", sorted(_LOST_TYPES))
def test_a_value_whose_type_the_exporter_loses_reads_the_same_on_both_paths(tmp_path, chdb_store, case):
    import duckdb

    doc = _doc([_LOST_TYPES[case]])
    duck, status = _collected(tmp_path, doc)
    assert status == 200
    with duckdb.connect(duck, read_only=True) as con:
        a = con.execute(f"SELECT {_READ} FROM spans").fetchall()
    b = _ch(_exported(chdb_store, doc), f"SELECT {_READ} FROM spans")
    norm = lambda rows: [(*r[:2], r[2] or None, *r[3:7], dict(r[7].items() if isinstance(r[7], dict) else r[7] or ()))
                         for r in rows]
    assert norm(a) == norm(b)


@pytest.mark.parametrize(("value", "text"), [
    (7.0, "7"), (0.1, "0.1"), (1e21, "1e+21"), (1e-7, "1e-7"), (1.5e-6, "0.0000015"), (1e16, "10000000000000000"),
    (2.0 ** 60, "1152921504606847000"), (-2.5e22, "-2.5e+22"), ([1.0, "a<b"], '[1,"a\\u003cb"]'),
    ({"z": 1, "a": 2.5}, '{"a":2.5,"z":1}'), (float("nan"), "json: unsupported value: NaN"), (b"ab", "YWI="),
])
def test_the_stand_in_spells_each_value_as_the_go_exporter_does(value, text):
    """pdata's AsString: the Go exporter wrote "7" where the stand-in wrote Python's "7.0"."""
    assert as_string(value) == text


_ENVELOPES = {  # an exporter row `kvtrace collect` refuses whatever its attributes, and why
    "a trace id of zeros": ({"TraceId": "0" * 32}, "TraceId"),
    "a trace id that is no hex": ({"TraceId": "zz" * 16}, "TraceId"),
    "an empty span id": ({"SpanId": ""}, "SpanId"),
    "a parent id that is no hex": ({"ParentSpanId": "xyz"}, "ParentSpanId"),
    "an end before its start (a wrapped Duration)": ({"Duration": (1 << 64) - 500}, "ends before it starts"),
    "an offset that is no integer": ({"offset": " 1_000 "}, "kvtrace.run.time_offset_ns"),
    "a negative offset": ({"offset": "-5"}, "kvtrace.run.time_offset_ns"),
    "an offset after the span's start": ({"offset": str(1_796_000_000_000_000_001)}, "starts before"),
}


@pytest.mark.parametrize("case", sorted(_ENVELOPES))
def test_an_exporter_row_collect_refuses_whatever_its_attributes_is_left_out(chdb_store, case):
    """Zero or non-hex ids were stored as span 0 (and counted as a request), a wrapped Duration
    as an end before the start, an offset of " 1_000 " read as 0 and one after the span's start
    as negative times, where `kvtrace collect` refuses each span."""
    row, named = _ENVELOPES[case]
    m = pa.map_(pa.string(), pa.string())
    table = {"Timestamp": pa.array([1_796_000_000_000_000_000] * 2, pa.timestamp("ns")),
             "SpanName": [REQUEST] * 2, "ServiceName": ["vllm"] * 2,
             "TraceId": [row.get("TraceId", "ab" * 16), "ab" * 16],
             "SpanId": [row.get("SpanId", "cd" * 8), "ef" * 8], "ParentSpanId": [row.get("ParentSpanId", ""), ""],
             "Duration": pa.array([row.get("Duration", 1000), 1000], pa.uint64()),
             "ResourceAttributes": pa.array([[("kvtrace.run.time_offset_ns", row["offset"])] if "offset" in row
                                             else [], []], m),
             "SpanAttributes": pa.array([[("kvtrace.request.id", "bad"), (PROMPT, "4")],
                                         [("kvtrace.request.id", "ok"), (PROMPT, "4")]], m)}
    db = chdb_store
    with client.connect(clickhouse_target(db)) as con:
        con.insert_arrow("otel_traces", pa.table(table))
    Store.open(db).close()
    assert _ch(db, "SELECT request_id FROM spans_request") == [("ok",)]
    ((reason,),) = _ch(db, "SELECT reason FROM otel_refused_spans")
    assert named in reason
