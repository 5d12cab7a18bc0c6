"""The twenty-seventh session's fixes to the OTLP receivers: the OTel Collector's ClickHouse path
stores what `kvtrace collect` stores (and keeps, not stores as counts, what collect refuses), a
request's cache-read tokens are dropped only as the alias of the hit tokens kept, and the
duplicate-key check compares values, not their reprs, and names where it found one."""

from __future__ import annotations

import base64
import copy
import json
import re

import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from kvtrace.instrument.otlp import PayloadError, decode_json, decode_protobuf

CACHE_READ = "gen_ai.usage.cache_read.input_tokens"


def _av(v) -> dict:
    if v is None:
        return {}
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    if isinstance(v, str):
        return {"stringValue": v}
    if isinstance(v, list):
        return {"arrayValue": {"values": [_av(x) for x in v]}}
    return {"kvlistValue": {"values": [{"key": k, "value": _av(x)} for k, x in v.items()]}}


def _attrs(pairs) -> list[dict]:
    return [{"key": k, "value": _av(v)} for k, v in pairs]


def _doc(spans: list[dict]) -> dict:
    return {"resourceSpans": [{"resource": {"attributes": _attrs([("service.name", "vllm")])},
                               "scopeSpans": [{"spans": spans}]}]}


def _span(i: int, name: str, pairs, **more) -> dict:
    return {"traceId": f"{i:032x}", "spanId": f"{i:016x}", "name": name, "startTimeUnixNano": str(1000 + i),
            "endTimeUnixNano": str(2000 + i), "attributes": _attrs(pairs), **more}


def _protobuf(doc: dict) -> bytes:
    """The protobuf of an OTLP/JSON document (its hex ids as proto3 JSON's base64)."""
    from google.protobuf import json_format

    doc = copy.deepcopy(doc)
    b64 = lambda h: base64.b64encode(bytes.fromhex(h)).decode()
    spans = [s for rs in doc["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]]
    for span in spans:
        for item in (span, *span.get("links", ())):
            for key in ("traceId", "spanId"):
                item[key] = b64(item[key])
    return json_format.ParseDict(doc, trace_service_pb2.ExportTraceServiceRequest()).SerializeToString()


# (span name, attributes): collect takes each (a value of another type is kept as an extra)
_KEPT = [
    ("llm_request", [("kvtrace.block.ids", "zzz")]),
    ("llm_request", [("kvtrace.block.ids", [1.5, 2.5])]),
    ("llm_request", [("kvtrace.block.ids", [True])]),
    ("llm_request", [("kvtrace.block.ids", None)]),
    ("llm_request", [("kvtrace.block.ids", [3, -1])]),
    ("llm_request", [("kvtrace.block.hashes", "notjson")]),
    ("llm_request", [("kvtrace.block.hashes", ["a", 1])]),
    ("llm_request", [("kvtrace.block.hashes", ["a", "b"])]),
    ("llm_request", [("kvtrace.request.prefill_chunks", "x")]),
    ("llm_request", [("kvtrace.request.prefill_chunks", [1, 2])]),
    ("llm_request", [("kvtrace.request.prefill_chunks", [1, 2, 3])]),
    ("llm_request", [("kvtrace.step.usage", "x")]),
    ("llm_request", [("kvtrace.step.usage", [True, False])]),
    ("llm_request", [("kvtrace.step.usage", [0.5, 1])]),
    ("llm_request", [("gen_ai.usage.input_tokens", 12.0)]),
    ("llm_request", [("gen_ai.usage.input_tokens", 7)]),
    ("kvtrace.request", [(CACHE_READ, 7), ("kvtrace.request.id", "a")]),
    ("kvtrace.request", [(CACHE_READ, 7), ("gen_ai.usage.input_tokens", 10), ("kvtrace.hit_tokens", 5),
                         ("kvtrace.external_hit_tokens", 2)]),
    ("kvtrace.request", [(CACHE_READ, 6), ("gen_ai.usage.input_tokens", 10), ("kvtrace.hit_tokens", 5)]),
    ("kvtrace.lookup", [(CACHE_READ, 5), ("kvtrace.lookup.query_tokens", 10), ("kvtrace.hit_tokens", 5)]),
    ("llm_request", [(CACHE_READ, 7), ("kvtrace.hit_tokens", 5)]),
]
# collect refuses each (400): the exporter took it, so the ClickHouse path keeps it as the sender's text
_REFUSED = [
    ("gen_ai.usage.input_tokens", -5),
    ("gen_ai.usage.input_tokens", 3_000_000_000),
    ("kvtrace.block.ids", [3, -2]),
]
_COLUMNS = "block_ids, block_hashes, prefill_chunks, usage, num_prompt_tokens, num_hit_tokens"


def _rows(frame_rows) -> dict[str, tuple]:
    """span id -> (its typed values, empty lists as None; its extra attributes as a dict)."""
    out = {}
    for span_id, *values, extra in frame_rows:
        items = extra.items() if isinstance(extra, dict) else (extra or ())
        out[span_id] = (*(None if v == [] else v for v in values), dict(items))
    return out


def test_the_clickhouse_path_stores_what_kvtrace_collect_stores(tmp_path):
    """A list attribute collect kept as an extra ("zzz", [1.5, 2.5], [true] of block ids) was
    lost there, or stored as another value ([1, 2], [1]); a token count collect refuses (-5,
    3e9) was stored as one; a request's cache-read tokens were dropped on every request span
    and kept on a lookup (collect: the opposite)."""
    import duckdb
    import pyarrow as pa

    from kvtrace.instrument.otlp import OTLPCollector
    from kvtrace.store import Store
    from kvtrace.store.backend import clickhouse_target
    from kvtrace.store.clickhouse import client
    from tests.instrument.helpers import post_otlp_json
    from tests.support.collector_rows import collector_rows

    pytest.importorskip("chdb")
    spans = [_span(i, name, pairs) for i, (name, pairs) in enumerate(_KEPT, 1)]
    refused = [_span(100 + i, "llm_request", [pair]) for i, pair in enumerate(_REFUSED)]
    db = tmp_path / "d.duckdb"
    collector = OTLPCollector(db, port=0).start()
    try:
        assert post_otlp_json(collector.url, _doc(spans))[0] == 200
        assert [post_otlp_json(collector.url, _doc([s]))[0] for s in refused] == [400] * len(refused)
    finally:
        collector.stop()
    query = f"SELECT span_id, {_COLUMNS}, extra_attributes FROM spans ORDER BY span_id"
    with duckdb.connect(str(db), read_only=True) as con:
        duck = _rows(con.execute(query).fetchall())
    ch = f"chdb:{tmp_path / 'ch'}"
    Store.open(ch).close()
    with client.connect(clickhouse_target(ch)) as con:
        con.insert_arrow("otel_traces", collector_rows([_protobuf(_doc(spans + refused))]))
        # a key given twice with two values (collect: a 400), as an exporter's map may hold it
        con.insert_arrow("otel_traces", pa.table({
            "Timestamp": pa.array([1_000], pa.timestamp("ns")), "SpanName": ["llm_request"], "ServiceName": ["vllm"],
            "TraceId": [f"{200:032x}"], "SpanId": [f"{200:016x}"],
            "SpanAttributes": pa.array([[("gen_ai.usage.input_tokens", "5"), ("gen_ai.usage.input_tokens", "7")]],
                                       pa.map_(pa.string(), pa.string()))}))
    Store.open(ch).close()
    with client.connect(clickhouse_target(ch)) as con:
        chdb_rows = _rows(con.ch_frame(query).rows())
        twice = con.ch_frame(f"SELECT num_prompt_tokens, mapValues(extra_attributes) FROM spans "
                             f"WHERE span_id = '{200:016x}'").rows()
    assert len(duck) == len(_KEPT)
    assert {k: chdb_rows[k] for k in duck} == duck
    expected = {f"{100 + i:016x}": {key: json.dumps(value, separators=(",", ":"))}
                for i, (key, value) in enumerate(_REFUSED)}
    assert {k: (set(v[:-1]), v[-1]) for k, v in chdb_rows.items() if k in expected} == {
        k: ({None}, e) for k, e in expected.items()}
    assert twice == [(None, ["5", "7"])]
    # the alias is dropped only where it is one: a request's hit + external hit tokens
    cache_read = {int(k, 16): v[-1].get(CACHE_READ) for k, v in duck.items() if _KEPT[int(k, 16) - 1][1][0][0]
                  == CACHE_READ}
    assert cache_read == {17: "7", 18: None, 19: "6", 20: "5", 21: "7"}


@pytest.mark.parametrize("pair", [
    ({"x": 1, "y": [True, None]}, {"y": [True, None], "x": 1}),  # one map, its keys in another order
    (0.0, -0.0),
    ([1.5, "a"], [1.5, "a"]),
])
def test_one_value_given_twice_in_another_spelling_is_one(pair):
    doc = _doc([_span(1, "op", [("a", pair[0]), ("a", pair[1])])])
    for decode, body in ((decode_json, json.dumps(doc).encode()), (decode_protobuf, _protobuf(doc))):
        [(_, span, _)] = decode(body)
        assert span["attributes"]["a"] == pair[1]


_LINKS = [{"traceId": "cd" * 16, "spanId": f"{j + 1:016x}"} for j in range(2)]
_TWICE = [
    (_span(1, "op", [("m", {"k": {"x": 1, "y": 2}})]), "spans[0].m"),  # a kvlist's: see below
    (_span(1, "op", [("a", [1])], links=[_LINKS[0], {**_LINKS[1], "attributes": _attrs([("l", 1), ("l", 2)])}]),
     "spans[0].links[1]: attribute 'l' given twice, as 1 and 2"),
    (_span(1, "op", [("a", True), ("a", None)]), "attribute 'a' given twice, as true and empty"),
    (_span(1, "op", [("a", [True]), ("a", [False])]), "attribute 'a' given twice, as [true] and [false]"),
    (_span(1, "op", [("a", 1), ("a", 1.0)]), "attribute 'a' given twice, as 1 and 1.0"),  # two types
]


@pytest.mark.parametrize(("span", "said"), _TWICE)
def test_a_key_given_twice_is_named_where_it_is_in_otlps_spellings(span, said):
    """A duplicate inside a kvlist named only its span over protobuf (JSON: ``spans[0].m``), a
    link's had no index, and the values were quoted as Python's True and None."""
    if said == "spans[0].m":  # a kvlist holding a key twice
        values = span["attributes"][0]["value"]["kvlistValue"]["values"]
        values.append({"key": "k", "value": {"intValue": "3"}})
        said = "spans[0].m: attribute 'k' given twice, as {'x': 1, 'y': 2} and 3"
    doc = _doc([span])
    for decode, body in ((decode_json, json.dumps(doc).encode()), (decode_protobuf, _protobuf(doc))):
        with pytest.raises(PayloadError, match=re.escape(said)):
            decode(body)
