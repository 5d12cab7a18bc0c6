"""nums33: a run none of whose requests finished still has the blocks, steps and spans its
spans count, in every view that reads its summary (``read.summary_with_spans``)."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from kvtrace.errors import KVTraceError
from kvtrace.replay.run import RunSpec, run_replay
from kvtrace.store import export_parquet, read


def _failed_before_any_request_finished(tmp_path) -> tuple[str, str]:
    """A real engine replay that fails when its second request arrives (longer than the
    model's max_model_len), while its first is still decoding: its spans hold that request's
    lookup, publishes, a state block's eviction and the steps so far, and no request span."""
    trace = tmp_path / "t.jsonl"
    long = 1_200_000  # (past kimi-hybrid's max_model_len of 1,048,576)
    lines = [{"timestamp": 0, "input_length": 600, "output_length": 3000, "hash_ids": [1, 2]},
             {"timestamp": 50, "input_length": long, "output_length": 1,
              "hash_ids": list(range(100, 100 + -(-long // 512)))}]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    db = str(tmp_path / "failed.duckdb")
    with pytest.raises(KVTraceError, match="max_model_len"):
        run_replay(RunSpec(str(trace), name="failed"), db=db)
    (run_id,) = read.runs(db)["run_id"].to_list()
    assert read.run(db, run_id)["status"] == "failed"
    return db, run_id


def test_a_run_failed_before_any_request_finished_counts_the_blocks_its_spans_hold(tmp_path):
    """Its summary was its error alone: `kvtrace diff`, `runs` and the dashboard's Overview
    said evictions "–" beside the eviction its Evictions page and diff's evictions-by-reason
    table showed, publishes and steps "–" beside its spans, and diff its capacity "–"."""
    db, run_id = _failed_before_any_request_finished(tmp_path)
    counts = {r["name"]: r for r in read.span_counts(db, run_id).iter_rows(named=True)}
    assert "kvtrace.request" not in counts and read.hit_counters(db, run_id)["requests"] == 0
    by_reason = {r["reason"]: r["blocks"] for r in read.evictions_by_reason(db, run_id).iter_rows(named=True)}
    summary = read.run_summary(db, run_id)
    assert summary["error"].startswith("KVTraceError: ") and "max_model_len" in summary["error"]
    assert summary["evictions"] == counts["kvtrace.cache.evict"]["blocks"] == sum(by_reason.values()) > 0
    assert summary["evictions_by_reason"] == by_reason
    assert summary["publishes"] == counts["kvtrace.cache.publish"]["blocks"] > 0
    assert summary["steps"] == counts["kvtrace.engine.step"]["spans"] > 0
    assert summary["spans"] == sum(r["spans"] for r in counts.values())
    # the cache's size, from its config, as a finished run of the preset states it (diff said its
    # capacity "–" beside its block size)
    assert (summary["block_size"], summary["capacity_blocks"]) == (512, 10_239)
    # no request counted: no counter, rate or latency (none is 0: not measured, as Overview says)
    assert not {"requests", "prefix_cache_queries", "prefix_cache_hit_rate", "median_ttft_ms"} & summary.keys()
    # the export's run record holds the same summary
    (exported,) = pq.read_table(export_parquet(db, run_id, tmp_path / "out")["runs"]).column("summary").to_pylist()
    assert json.loads(exported) == summary


def test_a_stopped_cache_only_run_states_its_prompt_tokens_and_capacity_as_its_finished_summary(tmp_path):
    """A cache-only replay SIGTERM'd after its second commit: diff said prompt_tokens "–" beside
    the finished run's (and beside the queries it counted, which are its prompt tokens), and its
    capacity was "–" in diff and runs where its config names it."""
    import subprocess
    import sys

    from tests.conftest import TRACES

    trace = str(TRACES / "mooncake_synthetic_trace.jsonl")
    db, marker = tmp_path / "term.duckdb", tmp_path / "committed"
    settings = ["--mode", "cache-only", "--capacity-blocks", "2000"]
    proc = subprocess.run([sys.executable, "-m", "tests.replay.sigterm_driver", str(marker), "2", "--",
                           "replay", trace, *settings, "--db", str(db)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 143 and marker.exists(), proc.stderr
    assert read.run(db, "r1")["status"] == "failed"
    stopped = read.run_summary(db, "r1")
    finished = run_replay(RunSpec(trace, mode="cache-only", capacity_blocks=2000)).summary
    assert 0 < stopped["prompt_tokens"] == stopped["prefix_cache_queries"] <= finished["prompt_tokens"]
    assert stopped["capacity_blocks"] == finished["capacity_blocks"] == 2000
    # (the trace's own block size is recorded nowhere a stopped run keeps: unknown, not guessed)
    assert stopped.get("block_size") is None and finished["block_size"] == 512


def test_a_vllm_servers_collected_requests_claim_no_cache_counts(tmp_path):
    """A run a collector made of a vLLM server's llm_request spans (no cache span: its sender
    measured no block): its summary from spans says no publishes or evictions, not 0."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from kvtrace.instrument.otlp import OTLPCollector

    db = tmp_path / "collected.duckdb"
    collector = OTLPCollector(db, port=0).start()
    try:
        provider = TracerProvider(resource=Resource.create({"service.name": "vllm"}))
        provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=collector.url)))
        with provider.get_tracer("vllm").start_as_current_span("llm_request", attributes={
                "gen_ai.usage.input_tokens": 12, "gen_ai.usage.output_tokens": 3}):
            pass
        provider.shutdown()
    finally:
        collector.stop()
    (run_id,) = read.runs(db)["run_id"].to_list()
    assert read.span_counts(db, run_id)["name"].to_list() == ["llm_request"]
    summary = read.run_summary(db, run_id)
    assert not {"publishes", "evictions", "evictions_by_reason", "requests"} & summary.keys(), summary
