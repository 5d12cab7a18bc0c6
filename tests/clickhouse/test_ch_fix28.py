"""The twenty-eighth session's fixes of what a re-probe found between `kvtrace collect` and the
ClickHouse collector path: the same spans must be refused or kept alike, and read the same
values, whichever path stored them (the exporter keeps every value as pdata's AsString text)."""

from __future__ import annotations

import math
import urllib.error
import urllib.request

import duckdb
import pytest

from kvtrace.instrument.otlp import OTLPCollector
from kvtrace.store import Store
from kvtrace.store.backend import clickhouse_target
from kvtrace.store.clickhouse import client
from tests.clickhouse.test_ch_probe28 import EXT, HITS, LOOKUP, PROMPT, REQUEST, _ch, _doc
from tests.instrument.test_otlp_fix27 import _av, _protobuf
from tests.support.collector_rows import collector_rows

pytest.importorskip("chdb")

OFFSET_KEY = "kvtrace.run.time_offset_ns"
_READ = "request_id, start_ns, end_ns, num_output_tokens, itl_mean_ns, num_hit_tokens, extra_attributes"


def _json_safe(doc: dict) -> dict:
    """proto3 JSON spells a NaN or infinity double as a string ("NaN", "Infinity")."""
    def fix(node):
        if isinstance(node, dict):
            v = node.get("doubleValue")
            if isinstance(v, float) and not math.isfinite(v):
                node["doubleValue"] = "NaN" if v != v else ("Infinity" if v > 0 else "-Infinity")
            for x in node.values():
                fix(x)
        elif isinstance(node, list):
            for x in node:
                fix(x)
    fix(doc)
    return doc


def _body(spans: list[tuple[str, dict]], offset=None) -> bytes:
    doc = _doc(spans)
    if offset is not None:
        doc["resourceSpans"][0]["resource"]["attributes"].append({"key": OFFSET_KEY, "value": _av(offset)})
    return _protobuf(_json_safe(doc))


def _both(tmp_path, ch: str, body: bytes) -> tuple[int, str, list | None, list, list]:
    """(collect's status, its message, its rows (None when refused), the ClickHouse path's rows
    in the empty chdb store ``ch``, its otel_refused_spans reasons) of one protobuf request."""
    db = tmp_path / "c.duckdb"
    collector = OTLPCollector(db, port=0).start()
    req = urllib.request.Request(collector.url, data=body, method="POST",
                                 headers={"Content-Type": "application/x-protobuf"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            status, message = resp.status, ""
    except urllib.error.HTTPError as err:
        status, message = err.code, err.read().decode("utf-8", "replace")
    finally:
        collector.stop()
    norm = lambda rows: [(*r[:-1], dict(r[-1].items() if isinstance(r[-1], dict) else r[-1] or ())) for r in rows]
    duck = None
    if status == 200:
        with duckdb.connect(str(db), read_only=True) as con:
            duck = norm(con.execute(f"SELECT {_READ} FROM spans").fetchall())
    with client.connect(clickhouse_target(ch)) as con:
        con.insert_arrow("otel_traces", collector_rows([body]))
    Store.open(ch).close()
    reasons = [r for (r,) in _ch(ch, "SELECT reason FROM otel_refused_spans")]
    return status, message, duck, norm(_ch(ch, f"SELECT {_READ} FROM spans")), reasons


def _alike(tmp_path, ch: str, body: bytes) -> tuple[int, str, list]:
    status, message, duck, ch_rows, reasons = _both(tmp_path, ch, body)
    assert status in (200, 400), message
    if status == 200:
        assert duck == ch_rows and reasons == []
    else:
        assert ch_rows == [] and len(reasons) == 1, (message, ch_rows)
    return status, message, reasons


@pytest.mark.parametrize(("offset", "taken"), [
    (500, True), ("500", True), (500.0, True), ("0500", True), (500.5, False), (" 500", False),
])
def test_a_time_offset_is_read_as_the_exporter_spells_it_on_both_paths(tmp_path, chdb_store, offset, taken):
    """A resource offset of "500" or 500.0 (the exporter's "500", as the int 500's) was refused by
    collect (400, "expected an integer of ns") while the ClickHouse path stored the span shifted
    by 500: both take what spells an integer of ns, and refuse the rest."""
    status, message, reasons = _alike(tmp_path, chdb_store, _body([(REQUEST, {"kvtrace.request.id": "r"})], offset))
    assert (status == 200) is taken
    if taken:
        assert "expected an integer" not in message
    else:
        assert OFFSET_KEY in message and OFFSET_KEY in reasons[0]


def test_a_time_offset_of_an_integral_double_is_taken_off_the_times():
    from kvtrace.instrument.convert import UnstorableValue, time_offset

    assert [time_offset({OFFSET_KEY: v}) for v in (500, "500", 500.0, "0500")] == [500] * 4
    for bad in ("1_000", 500.5, "5e2", math.inf, math.nan, -1.0, -0.0, 2.0**63, False, True, b"500"):
        with pytest.raises(UnstorableValue, match=r"kvtrace\.run\.time_offset_ns: expected an integer of ns"):
            time_offset({OFFSET_KEY: bad})


_NONFINITE = {
    "NaN of a number column": (REQUEST, {"kvtrace.request.itl_mean_ns": math.nan}),
    "+Inf of a number column": (REQUEST, {"kvtrace.request.itl_p99_ns": math.inf}),
    "a NaN's exporter text in a number column": (REQUEST, {"kvtrace.request.itl_p50_ns":
                                                           "json: unsupported value: NaN"}),
    "NaN of a count": (REQUEST, {"gen_ai.usage.output_tokens": math.nan}),
    "-Inf of a lookup's hits": (LOOKUP, {"kvtrace.lookup.query_tokens": 7, HITS: -math.inf}),
    "NaN as the request id": (REQUEST, {"kvtrace.request.id": math.nan}),
    "NaN of an extra": (REQUEST, {"x.custom": math.nan}),
}


@pytest.mark.parametrize("case", sorted(_NONFINITE))
def test_a_nan_or_infinity_is_refused_or_kept_alike_on_both_paths(tmp_path, chdb_store, case):
    """A NaN in a number column was a 400 from collect but kept as an extra on the ClickHouse
    path; one in a count or an extra was "nan" there but "json: unsupported value: NaN" (the
    exporter's text) here; one as a request id no id there, the id "json: unsupported value:
    NaN" here. Now each is refused on both, or kept with the exporter's text on both."""
    name, attrs = _NONFINITE[case]
    status, message, reasons = _alike(tmp_path, chdb_store, _body([(name, {"kvtrace.request.id": "r", **attrs})]))
    number = any(k.startswith("kvtrace.request.itl_") for k in attrs)
    assert (status == 400) is number
    if number:
        assert "cannot be stored as numbers" in message and "cannot be stored as numbers" in reasons[0]


@pytest.mark.parametrize("prompt", [1e21, "-5", 2**31])
def test_hits_beside_a_prompt_no_count_holds_name_the_prompt(tmp_path, chdb_store, prompt):
    """Prompt 1e21 with 5 hits was refused as "given without gen_ai.usage.input_tokens" though
    it was given: both paths name the prompt as a value no token count holds."""
    body = _body([(REQUEST, {"kvtrace.request.id": "r", PROMPT: prompt, HITS: 5, EXT: 0})])
    status, message, reasons = _alike(tmp_path, chdb_store, body)
    assert status == 400
    for said in (message, reasons[0]):
        assert "given without" not in said and PROMPT in said
    assert "is no token count" in reasons[0]
    if not isinstance(prompt, int):  # (an int beyond a count is refused at its column, by collect)
        assert f"{PROMPT} '{'1e+21' if isinstance(prompt, float) else prompt}' is no token count" in message


@pytest.mark.parametrize("value", [[1.0, 2.5], [7.0], ["a<b & c>d", 1.0], {"z": 1, "a": 2.5}, [1, math.nan],
                                   ["é\n\t"], {"k": [True, None, -0.0]}])
def test_an_array_or_map_extra_is_kept_as_the_exporter_spells_it(tmp_path, chdb_store, value):
    """An array or map extra was Python's JSON in collect ('[1.0,2.5]', keys as sent, '<' as
    is, NaN) and Go's on the ClickHouse path ('[1,2.5]', keys sorted, '\\u003c', "" where
    Marshal fails): both keep Go's now."""
    body = _body([(REQUEST, {"kvtrace.request.id": "r", "x.custom": value})])
    status, message, _ = _alike(tmp_path, chdb_store, body)
    assert status == 200, message
