"""OTLP out (SDK OTLP/HTTP exporter) into OTLP in (kvtrace's receiver), on loopback."""

from __future__ import annotations

import pytest

from kvtrace.instrument import KVCacheInstrumentor, build_tracer_provider
from kvtrace.instrument.otlp import OTLPCollector
from kvtrace.instrument.pipeline import traces_url
from kvtrace.store.writer import Store
from tests.instrument.helpers import count_spans, one_of_each_step, store_rows
from tests.support.synthetic_spans import synthetic_steps


@pytest.fixture()
def collector(tmp_path):
    c = OTLPCollector(tmp_path / "collected.duckdb", port=0).start()
    yield c
    c.stop()


def _replay(provider, run_id, steps):
    inst = KVCacheInstrumentor(provider, run_id=run_id, flush_spans=1000)
    for batch in steps:
        inst(batch)
    inst.force_flush()
    provider.shutdown()
    return inst


def test_spans_sent_over_otlp_land_as_the_direct_rows(tmp_path, collector):
    steps = [one_of_each_step(0), *synthetic_steps(60, seed=8)]
    # direct: the columnar fast path into a store
    with Store.open(tmp_path / "direct.duckdb") as store:
        store.create_run("direct", run_id="replay-1")
        direct = _replay(build_tracer_provider(store=store, run_id="replay-1", seed=3), "replay-1", steps)
        store.finish_run("replay-1")
    # the same replay over OTLP/HTTP (protobuf) through the real SDK exporter
    sent = _replay(build_tracer_provider(otlp_endpoint=collector.url, run_id="replay-1", seed=3), "replay-1", steps)
    assert sent.spans_emitted == direct.spans_emitted > 700
    assert collector.spans_received == sent.spans_emitted
    collector.stop()
    got = store_rows(tmp_path / "collected.duckdb", "replay-1")  # run id carried in the resource
    want = store_rows(tmp_path / "direct.duckdb", "replay-1")
    assert len(got) == len(want)
    # a kvtrace run's resource is stored as its direct write stores it: not the SDK's
    # per-process self-description (telemetry.sdk.*, a random service.instance.id); in its order
    assert all(r["resource_attributes"] is None for r in got)
    assert got == want


def test_standard_env_vars_choose_endpoint_and_gzip(tmp_path, collector, monkeypatch):
    host, port = collector.address
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://{host}:{port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "kvtrace-env")
    provider = build_tracer_provider(run_id="env-run", seed=1)  # no URL: the variables decide
    inst = _replay(provider, "env-run", [one_of_each_step(0)])
    collector.stop()
    rows = store_rows(tmp_path / "collected.duckdb", "env-run", "name, service_name")
    assert len(rows) == inst.spans_emitted == 10
    assert {r["service_name"] for r in rows} == {"kvtrace-env"}


def test_the_sdks_deflate_compression_is_received(tmp_path, collector, monkeypatch):
    """``deflate`` is one of the compressions ``--otlp-endpoint`` takes: the receiver reads it."""
    host, port = collector.address
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "deflate")
    provider = build_tracer_provider(otlp_endpoint=f"http://{host}:{port}", run_id="deflate-run", seed=1)
    inst = _replay(provider, "deflate-run", [one_of_each_step(0)])
    collector.stop()
    assert count_spans(tmp_path / "collected.duckdb", "deflate-run") == inst.spans_emitted == 10


def test_grpc_protocol_variable_sends_over_grpc(tmp_path, monkeypatch):
    collector = OTLPCollector(tmp_path / "collected.duckdb", port=0, grpc_port=0).start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    try:
        # the gRPC port speaks no HTTP: the spans arrive only if the variable switched exporters
        provider = build_tracer_provider(otlp_endpoint=f"http://{collector.grpc_target}", run_id="grpc-run", seed=1)
        inst = _replay(provider, "grpc-run", [one_of_each_step(0)])
    finally:
        collector.stop()
    assert count_spans(tmp_path / "collected.duckdb", "grpc-run") == inst.spans_emitted == 10


def test_unsupported_otlp_protocol_is_a_config_error(monkeypatch):
    from kvtrace.errors import ConfigError

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ConfigError, match=r"^OTEL_EXPORTER_OTLP_PROTOCOL: http/json: kvtrace sends OTLP as"):
        build_tracer_provider(otlp_endpoint="http://127.0.0.1:4318", run_id="x")


def test_traces_url():
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert traces_url("https://c/otlp/v1/traces") == "https://c/otlp/v1/traces"
    from kvtrace.errors import ConfigError
    with pytest.raises(ConfigError, match="--otlp-endpoint"):
        traces_url("collector:4318")
    assert traces_url("http://[::1]:4318") == "http://[::1]:4318/v1/traces"
    # urllib raises ValueError on these (an unclosed bracket, a port out of range or not a number)
    for bad in ("http://[::1", "http://h:99999", "http://h:abc", "http://:4318"):
        with pytest.raises(ConfigError, match="--otlp-endpoint"):
            traces_url(bad)


def test_collector_spans_without_run_id_go_to_one_collector_run(tmp_path, collector):
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": "vllm"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=collector.url)))
    tracer = provider.get_tracer("vllm")
    with tracer.start_as_current_span("llm_request", attributes={
            "gen_ai.usage.input_tokens": 12, "gen_ai.usage.output_tokens": 3, "gen_ai.request.model": "m",
            "gen_ai.latency.time_to_first_token": 0.25}):
        tracer.start_span("child").end()
    provider.shutdown()
    collector.stop()
    rows = store_rows(tmp_path / "collected.duckdb", "r1",
                      "name, span_id, parent_span_id, num_prompt_tokens, num_output_tokens, extra_attributes, source, "
                      "service_name")
    assert count_spans(tmp_path / "collected.duckdb", "r1") == 2
    req = next(r for r in rows if r["name"] == "llm_request")
    assert (req["num_prompt_tokens"], req["num_output_tokens"]) == (12, 3)
    assert req["extra_attributes"] == {"gen_ai.request.model": "m", "gen_ai.latency.time_to_first_token": "0.25"}
    assert (req["source"], req["service_name"]) == ("otlp", "vllm")
    child = next(r for r in rows if r["name"] == "child")
    assert req["parent_span_id"] is None and child["parent_span_id"] == req["span_id"]


def test_unreachable_collector_is_counted_not_hung_on(tmp_path):
    """Every span is accounted for: exported or failed. A failing exporter rests between tries."""
    import socket

    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    from kvtrace.instrument import BulkSpanProcessor

    class Refusing(SpanExporter):
        calls = 0

        def export(self, spans):
            Refusing.calls += 1
            return SpanExportResult.FAILURE

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1/traces"
    otlp = BulkSpanProcessor(OTLPSpanExporter(endpoint=dead, timeout=1), max_export_batch_size=100)
    refusing = BulkSpanProcessor(Refusing(), max_export_batch_size=100, failure_backoff_s=3600)
    inst = KVCacheInstrumentor(TracerProvider(), processors=[otlp, refusing], flush_spans=100)
    for batch in synthetic_steps(40, seed=2):
        inst(batch)
    inst.force_flush()
    for proc in (otlp, refusing):
        assert proc.spans_received == inst.spans_emitted > 400
        assert proc.spans_exported == 0 and proc.spans_failed == inst.spans_emitted
    assert Refusing.calls == 1


def test_a_kvtrace_export_without_its_run_record_is_left_incomplete(tmp_path, collector):
    # a replay killed mid-export never sends its kvtrace.run record: its run was marked
    # complete at the collector's stop, a part of the run read as all of it
    sent = _replay(build_tracer_provider(otlp_endpoint=collector.url, run_id="cut-1", seed=3), "cut-1",
                   synthetic_steps(20, seed=8))
    assert collector.spans_received == sent.spans_emitted > 0
    collector.stop()
    from kvtrace.store import read

    assert read.run(tmp_path / "collected.duckdb", "cut-1")["status"] == "incomplete"
