"""A request span no kvtrace run holds is refused by the collector (400 naming the field),
not stored: an arrival after the first token and the end, or more hit tokens than the
prompt, was taken with a 200, and every reader then called the run damaged (negative
TTFT, negative computed tokens)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from kvtrace.instrument.otlp.collector import OTLPCollector
from kvtrace.store import read


def _request_span(span_id: int, **attributes: int) -> dict:
    attrs = [{"key": "kvtrace.request.id", "value": {"stringValue": f"q{span_id}"}}]
    attrs += [{"key": k, "value": {"intValue": str(v)}} for k, v in attributes.items()]
    return {"traceId": f"{span_id:032x}", "spanId": f"{span_id:016x}", "name": "kvtrace.request",
            "startTimeUnixNano": "1000", "endTimeUnixNano": "5000", "attributes": attrs}


def _post(url: str, spans: list[dict], run: str) -> tuple[int, str]:
    body = {"resourceSpans": [{"resource": {"attributes": [{"key": "kvtrace.run.id", "value": {"stringValue": run}}]},
                               "scopeSpans": [{"spans": spans}]}]}
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@pytest.mark.parametrize(("attributes", "said"), [
    ({"kvtrace.request.arrival_ns": 9000, "kvtrace.request.first_token_ns": 3000},
     "kvtrace.request.first_token_ns 3000 is before kvtrace.request.arrival_ns 9000"),
    ({"kvtrace.request.arrival_ns": 1000, "kvtrace.request.first_token_ns": 7000},
     "the span's end 5000 is before kvtrace.request.first_token_ns 7000"),
    ({"kvtrace.request.first_scheduled_ns": 3000, "kvtrace.request.first_token_ns": 2000},
     "kvtrace.request.first_token_ns 2000 is before kvtrace.request.first_scheduled_ns 3000"),
    ({"gen_ai.usage.input_tokens": 10, "kvtrace.hit_tokens": 8, "kvtrace.external_hit_tokens": 4},
     "kvtrace.hit_tokens + kvtrace.external_hit_tokens 12 exceeds gen_ai.usage.input_tokens 10"),
    # the reE re-probe: each stored with a 200 and then read as damaged
    ({"kvtrace.request.first_token_ns": 500},  # (no arrival: the readers take the span's start, 1000)
     "kvtrace.request.first_token_ns 500 is before kvtrace.request.arrival_ns 1000"),
    ({"kvtrace.hit_tokens": 11}, "kvtrace.hit_tokens + kvtrace.external_hit_tokens 11 given without "
                                 "gen_ai.usage.input_tokens"),
    ({"kvtrace.request.preempted_query_tokens": 4, "kvtrace.request.preempted_hit_tokens": 9},
     "kvtrace.request.preempted_hit_tokens 9 exceeds kvtrace.request.preempted_query_tokens 4"),
    ({"kvtrace.request.external_query_tokens": 2, "kvtrace.external_hit_tokens": 10, "gen_ai.usage.input_tokens": 20},
     "kvtrace.external_hit_tokens 10 exceeds kvtrace.request.external_query_tokens 2"),
    ({"kvtrace.request.arrival_ns": 1000, "kvtrace.request.first_token_ns": 2000, "kvtrace.request.ttft_ns": 99999},
     "kvtrace.request.ttft_ns 99999 is not kvtrace.request.first_token_ns - kvtrace.request.arrival_ns = 1000"),
])
def test_a_request_span_no_run_holds_is_a_400_naming_the_field_and_nothing_is_stored(tmp_path, attributes, said):
    db = tmp_path / "c.duckdb"
    collector = OTLPCollector(db, port=0, grpc_port=None).start()
    try:
        ordered = _request_span(1, **{"kvtrace.request.arrival_ns": 1000, "kvtrace.request.first_scheduled_ns": 1000,
                                      "kvtrace.request.first_token_ns": 3000, "gen_ai.usage.input_tokens": 10,
                                      "kvtrace.hit_tokens": 6, "kvtrace.external_hit_tokens": 4})
        assert _post(collector.url, [ordered], "good")[0] == 200
        code, text = _post(collector.url, [_request_span(2, **attributes)], "bad")
    finally:
        collector.stop()
    assert code == 400 and said in text, text
    runs = read.runs(db)
    assert runs.filter(runs["run_id"] == "bad").is_empty() or read.span_counts(db, "bad").is_empty()
    assert read.span_counts(db, "good")["spans"].sum() == 1
