"""A run id (the resource's ``kvtrace.run.id``) that cannot name a run is refused by `kvtrace
collect` (``store.schema.run_id_problem``) and left out on the ClickHouse collector path too,
its reason in ``otel_refused_spans``: it was stored there, and ``runs`` listed a run named by a
line break, a blank or 10,000 characters, which no listing could show nor ``diff`` be given."""

from __future__ import annotations

import pytest

from kvtrace.store.schema import MAX_RUN_ID_CHARS, run_id_problem
from tests.clickhouse.test_ch_probe28 import REQUEST, _ch, _collected, _doc, _exported
from tests.instrument.test_otlp_fix27 import _av

pytest.importorskip("chdb")

RUN_KEY = "kvtrace.run.id"

_IDS = {
    "a plain id": "r-7",
    "the longest": "x" * MAX_RUN_ID_CHARS,
    "the longest in two-byte characters": "é" * MAX_RUN_ID_CHARS,
    "one past the longest": "x" * (MAX_RUN_ID_CHARS + 1),
    "one past the longest in two-byte characters": "é" * (MAX_RUN_ID_CHARS + 1),
    "empty": "",
    "a space": "a b",
    "a line break": "a\nb",
    "a tab": "a\tb",
    "a no-break space": "a\u00a0b",
    "a zero-width space (a format character)": "a\u200bb",
    "an escape": "a\x1b[31mb",
    "a line separator": "a\u2028b",
    "a private-use character": "a\ue000b",
}


def _named(run_ids: list[str]) -> dict:
    """One resource a run id, each with a request span of its own."""
    resources = []
    for i, run_id in enumerate(run_ids):
        doc = _doc([(REQUEST, {"kvtrace.request.id": f"q{i}"})], first=i + 1)["resourceSpans"][0]
        doc["resource"]["attributes"].append({"key": RUN_KEY, "value": _av(run_id)})
        resources.append(doc)
    return {"resourceSpans": resources}


def test_a_run_id_is_refused_or_kept_alike_on_both_paths(tmp_path, chdb_store):
    ids = list(_IDS.values())
    refused = {r for r in ids if run_id_problem(r) is not None}
    assert 0 < len(refused) < len(ids)
    statuses = {r: _collected(tmp_path, _named([r]), f"c{i}")[1] for i, r in enumerate(ids)}
    assert statuses == {r: 400 if r in refused else 200 for r in ids}
    db = _exported(chdb_store, _named(ids))
    stored = {r for (r,) in _ch(db, "SELECT DISTINCT run_id FROM spans")}
    listed = {r for (r,) in _ch(db, "SELECT run_id FROM runs")}
    assert stored == listed == set(ids) - refused  # (no run made of refused spans alone)
    reasons = _ch(db, "SELECT run_id, reason FROM otel_refused_spans")
    # (kept under the run the span would have gone to: an empty id's is the service's, otlp:vllm)
    assert {r for r, _ in reasons} == {r or "otlp:vllm" for r in refused} and len(reasons) == len(refused)
    assert all(why.startswith(f"resource {RUN_KEY}: ") for _, why in reasons), reasons


def test_the_sql_rule_refuses_the_characters_python_refuses(tmp_path, chdb_store):
    """``run_id_refused_sql`` against ``run_id_problem`` over every code point Python's Unicode
    tables assign (but the private-use planes 15 and 16: 131,068 more of one category), each as
    the run id of one character: the one rule, in two languages."""
    import json
    import unicodedata

    from kvtrace.store.clickhouse.collector import run_id_refused_sql

    chars = [chr(c) for c in range(0xF0000) if unicodedata.category(chr(c)) not in ("Cn", "Cs")]
    rows = tmp_path / "chars.jsonl"
    rows.write_text("\n".join(json.dumps({"i": i, "t": c}) for i, c in enumerate(chars)))
    refused = {i for (i,) in _ch(chdb_store, f"SELECT i FROM file('{rows}', JSONEachRow, 'i Int64, t String') "
                                             f"WHERE {run_id_refused_sql('t')}")}
    python = {i for i, c in enumerate(chars) if run_id_problem(c) is not None}
    assert refused == python, sorted(f"U+{ord(chars[i]):04X}" for i in refused ^ python)[:20]
    assert 100 < len(python) < len(chars)  # (both sides of the rule)


_TYPED = {  # a run id of another type than string, as OTLP/JSON AnyValues
    "an int": {"intValue": "7"},
    "a bool": {"boolValue": True},
    "a double": {"doubleValue": 7.5},
    "an integral double": {"doubleValue": 70.0},
    "bytes": {"bytesValue": "AAE="},
    "an array": {"arrayValue": {"values": [{"stringValue": "a"}]}},
    "a map": {"kvlistValue": {"values": [{"key": "k", "value": {"stringValue": "v"}}]}},
    "an empty AnyValue": {},
}


def test_a_run_id_of_another_type_names_the_same_run_on_both_paths(tmp_path, chdb_store):
    """collect refused an int, bool, double, bytes, array or map run id ("expected a string"),
    which the exporter stores as its text and the ClickHouse path listed as a run ("7",
    "true", "AAE="); an empty AnyValue went to collect's own run, where the exporter's ""
    is refused. Both read the exporter's text now: the same run, or refused alike."""
    from kvtrace.store import read

    def doc(i: int, value: dict) -> dict:
        d = _doc([(REQUEST, {"kvtrace.request.id": f"q{i}"})], first=i + 1)
        d["resourceSpans"][0]["resource"]["attributes"].append({"key": RUN_KEY, "value": value})
        return d

    collected = {}
    for i, (case, value) in enumerate(_TYPED.items()):
        db, status = _collected(tmp_path, doc(i, value), f"t{i}")
        collected[case] = read.runs(db)["run_id"].to_list() if status == 200 else None
    resources = [doc(i, v)["resourceSpans"][0] for i, v in enumerate(_TYPED.values())]
    ch = _exported(chdb_store, {"resourceSpans": resources})
    listed = {r for (r,) in _ch(ch, "SELECT run_id FROM runs")}
    refused = {r for (r,) in _ch(ch, "SELECT run_id FROM otel_refused_spans")}
    assert {r for runs in collected.values() if runs for r in runs} == listed
    assert collected["an int"] == ["7"] and collected["an integral double"] == ["70"]
    assert collected["bytes"] == ["AAE="] and collected["an empty AnyValue"] is None
    assert len(refused) == sum(runs is None for runs in collected.values()) == 1
