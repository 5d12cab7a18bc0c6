"""A run whose every span `kvtrace collect` refuses (400: it stores no run) is not listed on the
ClickHouse collector path either, whichever rule refused the spans: the one across the span's
fields (``span_rules``: hits beyond the prompt, times out of order) as well as the envelope's
(ids, offsets, a run id that names no run). The collected-runs view left out the second kind
alone, so ``runs`` listed a run of no span, 'running' for ever, where collect made none."""

from __future__ import annotations

import pytest

from kvtrace.store import read
from tests.clickhouse.test_ch_probe28 import _BROKEN, REQUEST, _ch, _collected, _doc, _exported
from tests.instrument.test_otlp_fix27 import _av

pytest.importorskip("chdb")


def _named(run_id: str, spans: list[tuple[str, dict]], first: int) -> dict:
    doc = _doc(spans, first=first)["resourceSpans"][0]
    doc["resource"]["attributes"].append({"key": "kvtrace.run.id", "value": _av(run_id)})
    return doc


def test_a_run_of_spans_refused_by_a_rule_across_their_fields_is_not_listed(tmp_path, chdb_store):
    cases = sorted(_BROKEN)
    for case in cases[:2]:  # (collect refuses each: nothing stored, no run)
        db, status = _collected(tmp_path, {"resourceSpans": [_named("bad", [_BROKEN[case]], 1)]}, case[:4])
        assert status == 400
    good = (REQUEST, {"kvtrace.request.id": "ok", "gen_ai.usage.input_tokens": 30})
    doc = {"resourceSpans": [_named(f"bad{i}", [_BROKEN[c]], 10 * i + 1) for i, c in enumerate(cases)]
           + [_named("kept", [good, _BROKEN[cases[0]]], 1000)]}
    ch = _exported(chdb_store, doc)
    assert _ch(ch, "SELECT run_id FROM runs") == [("kept",)]
    assert read.runs(ch)["run_id"].to_list() == ["kept"]
    refused = {r for (r,) in _ch(ch, "SELECT DISTINCT run_id FROM otel_refused_spans")}
    assert refused == {f"bad{i}" for i in range(len(cases))} | {"kept"}  # (their reasons kept)
    assert _ch(ch, "SELECT DISTINCT run_id FROM spans") == [("kept",)]
