"""nums33: TPOT is (E2EL - TTFT) / (output tokens - 1) of the very TTFT and E2EL samples the
store reads, for every request span a collector takes."""

from __future__ import annotations

from kvtrace import metrics
from kvtrace.instrument.otlp import OTLPCollector
from kvtrace.store import read
from tests.instrument.helpers import post_otlp_json


def _attr(key: str, value: int | str) -> dict:
    return {"key": key, "value": {"intValue": str(value)} if isinstance(value, int) else {"stringValue": value}}


def _request(i: int, times: dict[str, int], outputs: int) -> dict:
    attrs = [_attr("kvtrace.request.id", f"q{i}"), _attr("gen_ai.usage.input_tokens", 10),
             _attr("gen_ai.usage.output_tokens", outputs), _attr("kvtrace.request.arrival_ns", 1_000),
             *(_attr(f"kvtrace.request.{k}", v) for k, v in times.items())]
    if outputs > 1:  # its gaps, from the first token (at 5 µs) to the last (at 11 µs, the span's end)
        attrs.append({"key": "kvtrace.request.itl_ns",
                      "value": {"arrayValue": {"values": [{"intValue": "3000"}] * (outputs - 1)}}})
    return {"traceId": "0" * 31 + "1", "spanId": f"{i:016x}", "name": "kvtrace.request", "kind": 1,
            "startTimeUnixNano": "1000", "endTimeUnixNano": "11000", "attributes": attrs}


def test_a_request_span_with_its_ttft_and_no_first_token_time_has_its_tpot(tmp_path):
    """A sender's span that states its TTFT (kvtrace.request.ttft_ns) and not its first token's
    time had a TTFT and an E2EL sample and no TPOT: vllm bench serve computes TPOT from those
    two ((latency - ttft) / (output_len - 1)), and so does the metric's own definition."""
    db = tmp_path / "collected.duckdb"
    spans = [_request(1, {"ttft_ns": 4_000}, 3),  # TTFT 4 µs, E2EL 10 µs: TPOT 3 µs
             _request(2, {"first_token_ns": 5_000}, 3),  # TTFT 4 µs by its times: the same
             _request(3, {"ttft_ns": 4_000}, 1)]  # one output token: no TPOT, as vLLM
    doc = {"resourceSpans": [{"resource": {"attributes": [_attr("service.name", "sender")]},
                              "scopeSpans": [{"spans": spans}]}]}
    collector = OTLPCollector(db, port=0).start()
    try:
        assert post_otlp_json(collector.url, doc)[0] == 200
    finally:
        collector.stop()
    (run_id,) = read.runs(db)["run_id"].to_list()
    ttft = read.latency_samples(db, run_id, "ttft").tolist()
    e2el = read.latency_samples(db, run_id, "e2el").tolist()
    assert ttft == [4_000.0] * 3 and e2el == [10_000.0] * 3
    assert read.latency_samples(db, run_id, "tpot").tolist() == [3_000.0, 3_000.0]
    stats = read.latency_stats(db, run_id, "tpot")
    assert stats["mean_tpot_ms"] == stats["p99_tpot_ms"] == 3_000 / metrics.NS_PER_MS


def test_a_request_span_with_its_ttft_and_no_first_token_time_has_its_gaps_over_time(tmp_path):
    """The same span's inter-token gaps were in the ITL statistics and not in ITL over time, nor
    at a time in itl_gaps, nor was its first token in ``requests``: the first token is its
    arrival plus its TTFT, as the collector holds them equal where both are given."""
    db = tmp_path / "collected.duckdb"
    spans = [_request(1, {"ttft_ns": 4_000}, 3), _request(2, {"first_token_ns": 5_000}, 3)]
    doc = {"resourceSpans": [{"resource": {"attributes": [_attr("service.name", "sender")]},
                              "scopeSpans": [{"spans": spans}]}]}
    collector = OTLPCollector(db, port=0).start()
    try:
        assert post_otlp_json(collector.url, doc)[0] == 200
    finally:
        collector.stop()
    (run_id,) = read.runs(db)["run_id"].to_list()
    assert read.latency_samples(db, run_id, "itl").tolist() == [3_000.0] * 4
    assert read.requests(db, run_id)["first_token_ns"].to_list() == [5_000, 5_000]
    gaps = read.itl_gaps(db, run_id)
    assert gaps["token_ns"].to_list() == [8_000, 11_000, 8_000, 11_000]
    assert read.itl_over_time(db, run_id)["gaps"].sum() == 4
    # and its waterfall's decode segment, from that first token to its end
    decode = read.request_waterfall(db, run_id, "q1").filter(segment="decode")
    assert decode.select("start_ns", "end_ns").rows() == [(5_000, 11_000)]
