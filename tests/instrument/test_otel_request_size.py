"""OTLP requests sized for the collector: spans of long prompts carry thousands of block ids
and hashes each, and 512 of them made one request no collector takes (600 prompts of 128k
tokens at 16-token blocks: 142 MB, which the SDK's HTTP exporter drops unsent, over its
64 MiB; the OTel Collector's gRPC receiver takes 4 MiB by default, kvtrace collect 16 MiB).
Every span was reported not delivered."""

from __future__ import annotations

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from kvtrace.cache.events import PUBLISH_FULL, BlockPublished
from kvtrace.instrument import BulkSpanProcessor, KVCacheInstrumentor
from tests.instrument.helpers import h

COLLECTOR_GRPC_DEFAULT = 4 * 1024 * 1024  # the OTel Collector's max_recv_msg_size_mib


class Requests(SpanExporter):
    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.seqs: list[int] = []

    def export(self, spans):
        self.sizes.append(encode_spans(spans).ByteSize())
        self.seqs += [s.attributes["kvtrace.seq"] for s in spans]
        return SpanExportResult.SUCCESS


def test_long_prompts_spans_go_in_requests_a_collector_takes():
    blocks = 20_000  # a 320k-token prompt at 16-token blocks
    hashes = tuple(h(i) for i in range(blocks))
    out = Requests()
    proc = BulkSpanProcessor(out, max_export_batch_size=512, number_spans=True)
    inst = KVCacheInstrumentor(TracerProvider(), processors=[proc])
    for step in range(10):
        inst.on_cache_events([BlockPublished(step, f"r{step}", 0, PUBLISH_FULL, tuple(range(step, step + blocks)),
                                             hashes, blocks * 16)])
    inst.flush()
    proc.force_flush()
    assert proc.spans_exported == proc.spans_received == inst.spans_emitted == 20 and proc.spans_failed == 0
    assert out.seqs == list(range(20))  # every span once, numbered in order across the requests
    assert len(out.sizes) > 1 and max(out.sizes) <= COLLECTOR_GRPC_DEFAULT, out.sizes
    assert sum(out.sizes) > 3 * COLLECTOR_GRPC_DEFAULT  # (what went in one request)


def test_a_span_larger_than_a_request_goes_alone():
    blocks = 100_000
    out = Requests()
    proc = BulkSpanProcessor(out, max_export_batch_size=512, number_spans=True)
    inst = KVCacheInstrumentor(TracerProvider(), processors=[proc])
    hashes = tuple(h(i) for i in range(blocks))
    inst.on_cache_events([BlockPublished(0, "r", 0, PUBLISH_FULL, tuple(range(blocks)), hashes, blocks * 16)])
    inst.on_cache_events([BlockPublished(1, "s", 0, PUBLISH_FULL, (1,), (h(1),), 16)])
    inst.flush()
    proc.force_flush()
    assert proc.spans_exported == 4 and out.seqs == [0, 1, 2, 3]  # two steps, two publishes, none lost
    assert max(out.sizes) > COLLECTOR_GRPC_DEFAULT and len(out.sizes) >= 2
