"""What each event kind becomes: names, attributes, parent/child, links, virtual time."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode, format_span_id, format_trace_id

from kvtrace.cache.events import (
    COPY_EXTERNAL,
    EVICT_RESET,
    BlockCopied,
    BlockEvicted,
    BlockPublished,
    PrefixLookup,
)
from kvtrace.engine.events import StepBatch, StepExecuted
from kvtrace.instrument import KVCacheInstrumentor, SeededIdGenerator
from tests.instrument.helpers import h, one_of_each_step


@pytest.fixture()
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource({"service.name": "kvtrace-test"}), id_generator=SeededIdGenerator(5))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    inst = KVCacheInstrumentor(provider, run_id="run-a")
    inst(one_of_each_step())
    inst.force_flush()
    return {s.name: s for s in exporter.get_finished_spans()}, exporter.get_finished_spans()


def test_one_span_per_event_and_step(spans):
    by_name, all_spans = spans
    assert len(all_spans) == 1 + 6 + 3
    assert set(by_name) == {
        "kvtrace.engine.step", "kvtrace.cache.lookup", "kvtrace.cache.evict", "kvtrace.cache.publish",
        "kvtrace.cache.cow", "kvtrace.cache.free", "kvtrace.cache.stale_left", "kvtrace.verify.stale_hash",
        "kvtrace.verify.divergent_output", "kvtrace.request",
    }


def test_cache_and_verify_spans_are_children_of_their_step(spans):
    by_name, all_spans = spans
    step = by_name["kvtrace.engine.step"]
    assert step.parent is None
    children = [s for s in all_spans if s.name.startswith(("kvtrace.cache.", "kvtrace.verify."))]
    assert len(children) == 8
    for s in children:
        assert s.parent.span_id == step.context.span_id
        assert s.context.trace_id == step.context.trace_id
    ids = {s.context.span_id for s in all_spans}
    assert len(ids) == len(all_spans)


def test_virtual_timestamps_from_the_step_window(spans):
    by_name, _ = spans
    step = by_name["kvtrace.engine.step"]
    assert (step.start_time, step.end_time) == (1_000, 2_200)
    # six cache events spread over [1000, 2200) in event order, zero length
    order = ["lookup", "evict", "publish", "cow", "free", "stale_left"]
    for i, kind in enumerate(order):
        s = by_name[f"kvtrace.cache.{kind}"]
        assert s.start_time == s.end_time == 1_000 + i * 200
    assert by_name["kvtrace.verify.stale_hash"].start_time == 1_800
    assert by_name["kvtrace.verify.divergent_output"].start_time == 1_900
    req = by_name["kvtrace.request"]
    assert (req.start_time, req.end_time) == (100, 3_000)


def test_publish_and_evict_attributes(spans):
    by_name, _ = spans
    pub = by_name["kvtrace.cache.publish"].attributes
    assert pub["kvtrace.step"] == 3
    assert pub["kvtrace.request.id"] == "r1"
    assert pub["kvtrace.group"] == 0
    assert pub["kvtrace.publish.kind"] == "full"
    assert tuple(pub["kvtrace.block.ids"]) == (1, 2, 3)
    assert tuple(pub["kvtrace.block.hashes"]) == (h(1).hex(), h(2).hex(), h(3).hex())
    assert pub["kvtrace.num_tokens"] == 48
    ev = by_name["kvtrace.cache.evict"].attributes
    assert ev["kvtrace.evict.reason"] == "lru"
    assert tuple(ev["kvtrace.block.ids"]) == (5, 6)
    assert tuple(ev["kvtrace.block.hashes"]) == (h(50).hex(), h(60).hex())
    assert tuple(ev["kvtrace.evict.ages"]) == (10, 11)
    assert tuple(ev["kvtrace.evict.idle"]) == (2, 3)


def test_lookup_cow_free_stale_attributes(spans):
    by_name, _ = spans
    lk = by_name["kvtrace.cache.lookup"].attributes
    assert lk["kvtrace.lookup.query_tokens"] == 100
    assert lk["kvtrace.hit_tokens"] == 64
    assert tuple(lk["kvtrace.lookup.hit_tokens_per_group"]) == (64, 48)
    assert lk["kvtrace.shared_prefix_boundary"] == 48
    assert lk["kvtrace.external_hit_tokens"] == 16
    assert lk["kvtrace.lookup.root_hash"] == h(1).hex()
    assert lk["kvtrace.lookup.first_miss_hash"] == h(5).hex()
    assert lk["kvtrace.lookup.first_miss_index"] == 4
    cow = by_name["kvtrace.cache.cow"].attributes
    assert (cow["kvtrace.cow.src"], cow["kvtrace.cow.dst"], cow["kvtrace.cow.why"]) == (4, 9, "partial_hit")
    assert cow["kvtrace.group"] == 1
    free = by_name["kvtrace.cache.free"].attributes
    assert (free["kvtrace.request.id"], tuple(free["kvtrace.block.ids"])) == ("r0", (7, 8))
    stale = by_name["kvtrace.cache.stale_left"].attributes
    assert tuple(stale["kvtrace.block.ids"]) == (9,)
    assert tuple(stale["kvtrace.block.hashes"]) == (h(9).hex(),)
    assert stale["kvtrace.num_tokens"] == 32


def test_lookup_cow_and_divergent_link_to_the_request_span(spans):
    by_name, _ = spans
    req = by_name["kvtrace.request"].context
    for name in ("kvtrace.cache.lookup", "kvtrace.cache.cow", "kvtrace.verify.divergent_output"):
        links = by_name[name].links
        assert len(links) == 1
        assert (links[0].context.trace_id, links[0].context.span_id) == (req.trace_id, req.span_id)
    assert by_name["kvtrace.cache.publish"].links == ()


def test_request_span_latency_and_genai_usage(spans):
    by_name, _ = spans
    req = by_name["kvtrace.request"]
    a = req.attributes
    assert a["gen_ai.usage.input_tokens"] == 100
    assert a["gen_ai.usage.output_tokens"] == 3
    assert a["gen_ai.usage.cache_read.input_tokens"] == 64 + 16  # local + external
    assert a["kvtrace.hit_tokens"] == 64
    assert a["kvtrace.external_hit_tokens"] == 16
    assert a["kvtrace.request.computed_prompt_tokens"] == 20
    assert a["kvtrace.request.ttft_ns"] == 1_500 - 100
    assert a["kvtrace.request.first_scheduled_ns"] == 900
    assert tuple(a["kvtrace.request.itl_ns"]) == (700, 800)
    assert a["kvtrace.request.itl_mean_ns"] == 750.0
    assert a["kvtrace.request.itl_p50_ns"] == 750.0
    assert a["kvtrace.request.itl_max_ns"] == 800
    assert tuple(a["kvtrace.request.prefill_chunks"]) == (1_000, 1_500, 20)
    assert a["kvtrace.request.session_id"] == "sess"
    assert a["kvtrace.request.preemptions"] == 1
    # a divergent token marks the request failed
    assert req.status.status_code is StatusCode.ERROR
    assert req.parent is None


def test_verification_spans_are_errors_with_their_evidence(spans):
    by_name, _ = spans
    stale = by_name["kvtrace.verify.stale_hash"]
    assert stale.status.status_code is StatusCode.ERROR
    assert by_name["kvtrace.cache.publish"].status.status_code is StatusCode.UNSET  # stored as NULL
    a = stale.attributes
    assert a["kvtrace.verify.expected_fingerprint"] == 123
    assert a["kvtrace.verify.actual_fingerprint"] == -5  # uint64 2**64-5, same bits as int64
    assert tuple(a["kvtrace.block.hashes"]) == (h(9).hex(),)
    div = by_name["kvtrace.verify.divergent_output"]
    assert div.status.status_code is StatusCode.ERROR
    assert (div.attributes["kvtrace.verify.position"], div.attributes["kvtrace.verify.expected_token"],
            div.attributes["kvtrace.verify.actual_token"]) == (1, 42, 43)


def test_step_span_attributes_and_resource(spans):
    by_name, _ = spans
    step = by_name["kvtrace.engine.step"]
    a = step.attributes
    assert a["kvtrace.step"] == 3
    assert a["kvtrace.step.prefill_tokens"] == 20
    assert tuple(a["kvtrace.step.usage"]) == (0.5, 0.25)
    assert step.resource.attributes["service.name"] == "kvtrace-test"
    assert step.resource.attributes["kvtrace.run.id"] == "run-a"
    assert step.instrumentation_scope.name == "kvtrace.instrument"
    assert len(format_trace_id(step.context.trace_id)) == 32
    assert len(format_span_id(step.context.span_id)) == 16


def test_cache_only_mode_places_steps_on_a_virtual_clock():
    exporter = InMemorySpanExporter()
    provider = TracerProvider(id_generator=SeededIdGenerator(1))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    inst = KVCacheInstrumentor(provider, step_ns=1_000)
    inst([BlockPublished(7, "r", 0, "full", (1,), (h(1),), 16), BlockPublished(7, "r", 0, "full", (2,), (h(2),), 32)])
    inst.force_flush()
    got = sorted((s.name, s.start_time, s.end_time) for s in exporter.get_finished_spans())
    assert got == [("kvtrace.cache.publish", 7_000, 7_000), ("kvtrace.cache.publish", 7_500, 7_500),
                   ("kvtrace.engine.step", 7_000, 8_000)]


def _spans_of(batch, resource: dict) -> list:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource(resource), id_generator=SeededIdGenerator(5))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    inst = KVCacheInstrumentor(provider, run_id="run-i")
    inst(batch)
    inst.force_flush()
    return list(exporter.get_finished_spans())


def test_values_the_vllm_backend_infers_are_marked(spans):
    """A vllm-backend run's spans name the attributes the adapter inferred in
    kvtrace.inferred (span_kinds' Inferred entries); the kvtrace backend's carry none."""
    _, kvtrace_spans = spans
    assert not [s.name for s in kvtrace_spans if "kvtrace.inferred" in s.attributes]
    marks = {s.name: s.attributes.get("kvtrace.inferred")
             for s in _spans_of(one_of_each_step(), {"service.name": "t", "kvtrace.backend": "vllm"})}
    assert marks == {
        "kvtrace.cache.lookup": None,  # (each group's own hit, from vLLM's per-group lookup)
        "kvtrace.cache.evict": '["kvtrace.evict.reason"]',
        "kvtrace.cache.publish": '["kvtrace.publish.kind"]',
        "kvtrace.cache.cow": '["kvtrace.cow.why"]',
        "kvtrace.engine.step": '["kvtrace.step.usage"]',  # two groups: vLLM's usage split
        "kvtrace.cache.free": None, "kvtrace.cache.stale_left": None, "kvtrace.verify.stale_hash": None,
        "kvtrace.verify.divergent_output": None, "kvtrace.request": None,
    }


def test_what_the_vllm_backend_observes_is_not_marked():
    """vLLM's AllBlocksCleared names its reason (reset), the adapter's own connector load
    its copies (external), one group's hit and usage are vLLM's own: no mark; in one step
    beside marked spans of the same kinds."""
    base = one_of_each_step()
    reset = BlockEvicted(3, 0, EVICT_RESET, (5,), (h(50),), (1,), (-1,), None)
    external = BlockCopied(3, "r1", 1, -1, 9, COPY_EXTERNAL)
    one_group = PrefixLookup(3, "r2", 100, 64, (64,), 0, 0, h(1), None, -1)
    step = StepExecuted(3, 1_000, 2_200, 20, 1, 1, 0, 1, 0, (0.5,))
    batch = StepBatch(step, [*base.cache_events, reset, external, one_group], [])
    got = [(s.name, s.attributes.get("kvtrace.evict.reason") or s.attributes.get("kvtrace.cow.why")
            or s.attributes.get("kvtrace.request.id"), s.attributes.get("kvtrace.inferred"))
           for s in _spans_of(batch, {"service.name": "t", "kvtrace.backend": "vllm"})
           if s.name in ("kvtrace.cache.evict", "kvtrace.cache.cow", "kvtrace.cache.lookup", "kvtrace.engine.step")]
    assert sorted(got, key=str) == sorted([
        ("kvtrace.cache.evict", "lru", '["kvtrace.evict.reason"]'), ("kvtrace.cache.evict", "reset", None),
        ("kvtrace.cache.cow", "partial_hit", '["kvtrace.cow.why"]'), ("kvtrace.cache.cow", "external", None),
        ("kvtrace.cache.lookup", "r1", None),
        ("kvtrace.cache.lookup", "r2", None), ("kvtrace.engine.step", None, None),
    ], key=str)
