"""``KVCacheInstrumentor``: cache and engine events -> OpenTelemetry spans, in bulk.

Shaped like an OpenTelemetry-contrib instrumentor, but not one: it does not subclass
``opentelemetry.instrumentation.instrumentor.BaseInstrumentor`` and makes no span
through the tracer. ``BaseInstrumentor`` is a per-class singleton that monkeypatches a
library globally; kvtrace needs one instrumentor per run, attached to explicit targets.
What it keeps of the pattern:

- ``instrument(*targets)`` / ``uninstrument(*targets)``, idempotent and symmetric (an
  engine's ``run`` wrapper is removed, a manager subscription is undone); with no
  targets, ``instrument()`` only looks up the processors, for an instrumentor passed
  as a listener by hand;
- a ``tracer_provider`` argument (default: the global provider) whose resource describes
  every span (service name and run id in their columns, other attributes but the SDK's
  per-process self-description in ``resource_attributes``) and whose
  ``SeededIdGenerator``, if it has one, supplies the ids.

What it does instead of ``tracer.start_span`` (about 19 us a span through the SDK,
``bench/span_path.py`` prints the figure): events are collected per step and turned into
spans column by column (``SpanBatchBuilder``, an Arrow ``SpanBatch``), then handed to the
provider's span processors directly, read from the provider
(``provider_span_processors``) or given as ``processors=``:

- a ``BulkSpanProcessor`` receives the columnar ``SpanBatch`` (``on_batch``; its
  exporter decides whether to materialise ``ReadableSpan``s);
- any other processor (the SDK's ``SimpleSpanProcessor``, ``BatchSpanProcessor``, ...)
  receives one ``ReadableSpan`` per span through ``on_end`` (never ``on_start``: the
  spans are finished when they are made).

The instrumentor is itself the listener: ``instrument(engine)`` adds it to the listeners
of ``engine.run`` (or pass it yourself: ``Engine.run(workload, listeners=[instrumentor])``;
a ``StepBatch`` per step: the step, its cache events, its engine events), or
``instrument(manager)`` subscribes it to a ``KVCacheManager`` in cache-only mode
(``list[CacheEvent]`` per step; the step's virtual window is then
``[step * step_ns, (step + 1) * step_ns)``). Do not feed it both an engine and that
engine's own manager: the engine already forwards the cache events. ``uninstrument()``
(or ``flush()``) hands over what is still pending. Usage::

    provider = build_tracer_provider(store=store, run_id=run_id)
    inst = KVCacheInstrumentor(provider, run_id=run_id).instrument(engine)
    engine.run(workload)
    inst.uninstrument()          # detach and flush
    provider.force_flush()
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from opentelemetry import trace as trace_api
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from kvtrace import __version__
from kvtrace.engine.events import StepBatch
from kvtrace.errors import ConfigError, KVTraceError
from kvtrace.instrument.batch import SCOPE_NAME, Envelope, SpanBatch
from kvtrace.instrument.convert import (
    RUN_ID_RESOURCE_KEY,
    attribute_text,
    stored_resource_items,
    table_to_readable_spans,
)
from kvtrace.instrument.ids import SeededIdGenerator, check_id_seed
from kvtrace.instrument.processor import BulkSpanProcessor
from kvtrace.instrument.spans import SpanBatchBuilder
from kvtrace.metrics import CACHE_ONLY_STEP_NS
from kvtrace.names import shown_value
from kvtrace.store.schema import BACKEND_RESOURCE_KEY, OPENING_STATUS, RUN_RECORD_PREFIX, SPAN_RUN

OPENING_ORDINAL = 1 << 62  # the id ordinal an opening record's ids are taken at (a run's spans take 0 on)
DEFAULT_FLUSH_SPANS = 32_768
# Hand-over points are counted, never timed: a batch's ids and the store's seq order
# depend on where batches end, so a wall-clock trigger would make two runs of one trace
# store different rows. The counts keep a hand-over within about a second of work (an engine
# step is about 4 ms today, a cache-only step tens of us) while amortising a batch's fixed
# cost (64 steps halved the span path's rate on small steps; 256 costs ~6%); the store
# commits what it was handed once a second, so a kill -9 loses about that.
DEFAULT_FLUSH_STEPS = 256  # engine steps
DEFAULT_FLUSH_CACHE_STEPS = 2_048  # cache-only steps (one per request)
DEFAULT_STEP_NS = CACHE_ONLY_STEP_NS  # cache-only mode: one step = 1 ms of virtual time


def provider_span_processors(provider: Any) -> tuple[SpanProcessor, ...]:
    """The span processors registered on an SDK ``TracerProvider`` (none for the no-op one).

    The SDK keeps them on its multi-processor; there is no public getter, so this reads
    the attribute and fails loudly if a future SDK renames it.
    """
    if not isinstance(provider, TracerProvider):
        return ()
    multi = getattr(provider, "_active_span_processor", None)
    procs = getattr(multi, "_span_processors", None)
    if procs is None:
        raise KVTraceError(
            "opentelemetry-sdk: cannot list the tracer provider's span processors; "
            "pass processors= to KVCacheInstrumentor explicitly"
        )
    return tuple(procs)


class KVCacheInstrumentor:
    """Instruments a kvtrace engine or cache manager (see the module docstring).

    ``tracer_provider``: an SDK ``TracerProvider`` (default: the global one). Its resource
    is written on every span and its ``SeededIdGenerator`` (if it has one) supplies ids;
    otherwise ids come from ``SeededIdGenerator(seed)``.
    ``processors``: overrides the provider's processors as span destinations.
    ``flush_spans``: build and hand over a batch once this many spans are pending;
    ``flush_steps`` / ``flush_cache_steps``: once this many engine / cache-only steps are
    pending (see ``DEFAULT_FLUSH_STEPS``: counts, so where batches end is deterministic).
    """

    def __init__(
        self,
        tracer_provider: Any = None,
        *,
        run_id: str | None = None,
        seed: int = 0,
        processors: Sequence[SpanProcessor] | None = None,
        flush_spans: int = DEFAULT_FLUSH_SPANS,
        step_ns: int = DEFAULT_STEP_NS,
        flush_steps: int = DEFAULT_FLUSH_STEPS,
        flush_cache_steps: int = DEFAULT_FLUSH_CACHE_STEPS,
    ):
        if run_id is not None and not isinstance(run_id, str):  # (keyed the spans' resource as given)
            raise ConfigError("KVCacheInstrumentor", "run_id", f"expected a string, got {shown_value(run_id)}")
        check_id_seed(seed, "KVCacheInstrumentor")
        for name, every in (("flush_spans", flush_spans), ("step_ns", step_ns), ("flush_steps", flush_steps),
                            ("flush_cache_steps", flush_cache_steps)):
            if isinstance(every, bool) or not isinstance(every, int) or every < 1:
                raise ConfigError("KVCacheInstrumentor", name, f"expected an int >= 1, got {shown_value(every)}")
        self.tracer_provider = tracer_provider if tracer_provider is not None else trace_api.get_tracer_provider()
        self.run_id = run_id
        self.seed = seed
        self.flush_spans = flush_spans
        self.flush_steps = flush_steps
        self.flush_cache_steps = flush_cache_steps
        self.step_ns = step_ns
        self._pending_steps = 0
        if processors is not None and (isinstance(processors, (str, bytes)) or not isinstance(processors, Iterable)):
            raise ConfigError("KVCacheInstrumentor", "processors", f"expected a sequence of span processors, got "
                                                                   f"{shown_value(processors)}")
        self._explicit_processors = tuple(processors) if processors is not None else None
        odd = next((p for p in self._explicit_processors or () if not all(
            callable(getattr(p, m, None)) for m in ("on_end", "force_flush"))), None)
        if odd is not None:  # (an AttributeError at the first hand-over, inside the run)
            raise ConfigError("KVCacheInstrumentor", "processors", f"expected span processors, got {shown_value(odd)}")
        gen = getattr(self.tracer_provider, "id_generator", None)
        self.ids = gen if isinstance(gen, SeededIdGenerator) else SeededIdGenerator(seed)
        resource = getattr(self.tracer_provider, "resource", None) or Resource({"service.name": "kvtrace"})
        attrs = dict(resource.attributes)
        attrs.setdefault("service.name", "kvtrace")
        if run_id is not None:
            attrs[RUN_ID_RESOURCE_KEY] = run_id
        self.resource = Resource(attrs, resource.schema_url)
        stored = tuple(stored_resource_items(attrs))
        self.envelope = Envelope(
            service_name=attribute_text(attrs["service.name"]), scope_name=SCOPE_NAME,
            scope_version=__version__, resource_attributes=stored,
            backend=attribute_text(attrs[BACKEND_RESOURCE_KEY]) if BACKEND_RESOURCE_KEY in attrs else None,
        )
        self._builder = SpanBatchBuilder(self.ids, self.envelope)
        self._targets: list[Any] = []
        self._bulk: tuple[BulkSpanProcessor, ...] = ()
        self._other: tuple[SpanProcessor, ...] = ()
        self.spans_emitted = 0
        self.records_sent = 0  # run records handed to the OTLP exports (one kvtrace.run span each)
        self.batches_emitted = 0
        self._opening: dict[str, str] | None = None  # an opening record's attributes, sent with the first export

    # -- instrument / uninstrument ----------------------------------------------------------------
    @property
    def is_instrumented(self) -> bool:
        return bool(self._targets)

    def instrument(self, *targets: Any) -> KVCacheInstrumentor:
        """Attach to each target: a ``KVCacheManager`` (``subscribe``) or an engine whose
        ``run(workload, listeners)`` gets this instrumentor added to its listeners."""
        self._resolve_processors()
        for target in targets:
            if any(t is target for t in self._targets):
                continue  # idempotent
            if callable(getattr(target, "subscribe", None)):
                target.subscribe(self)
            elif callable(getattr(target, "run", None)):
                self._wrap_run(target)
            else:
                raise KVTraceError(
                    f"{type(target).__name__}: cannot instrument (no subscribe(listener) or run(workload, listeners)); "
                    "pass the instrumentor as a step listener instead: engine.run(workload, listeners=[instrumentor])"
                )
            self._targets.append(target)
        return self

    def uninstrument(self, *targets: Any) -> None:
        """Detach (all targets when none given) and flush every pending span."""
        chosen = list(targets) if targets else list(self._targets)
        for target in chosen:
            if any(t is target for t in self._targets):
                run = getattr(target, "__dict__", {}).get("run")  # (a compiled manager has no __dict__)
                if getattr(run, "_kvtrace_instrumentor", None) is self:
                    del target.run  # back to the class's run
                else:
                    target.unsubscribe(self)
                self._targets = [t for t in self._targets if t is not target]
        self.flush()

    def _wrap_run(self, engine: Any) -> None:
        original = engine.run

        def run(workload, listeners=(), *args, **kwargs):
            if isinstance(listeners, (str, bytes)) or not isinstance(listeners, Iterable):
                return original(workload, listeners, *args, **kwargs)  # (the engine's one-line refusal)
            return original(workload, (*listeners, self), *args, **kwargs)

        run._kvtrace_instrumentor = self  # type: ignore[attr-defined]  # how uninstrument finds its own wrapper
        run.__wrapped__ = original  # type: ignore[attr-defined]
        engine.run = run

    def _resolve_processors(self) -> None:
        procs = self._explicit_processors
        if procs is None:
            procs = provider_span_processors(self.tracer_provider)
        self._bulk = tuple(p for p in procs if isinstance(p, BulkSpanProcessor))
        self._other = tuple(p for p in procs if not isinstance(p, BulkSpanProcessor))

    # -- listeners -----------------------------------------------------------------------------
    def __call__(self, events: StepBatch | list) -> None:
        """The listener: a ``StepBatch`` from the engine or a cache event list from the manager."""
        if isinstance(events, StepBatch):
            self.on_step(events)
        else:
            self.on_cache_events(events)

    def on_step(self, batch: StepBatch) -> None:
        step = batch.step
        self._builder.add_step(step.step, step.start_ns, step.end_ns, batch.cache_events, batch.engine_events, step)
        self._pending_steps += 1
        if self._builder.pending_spans >= self.flush_spans or self._pending_steps >= self.flush_steps:
            self.flush()

    def on_cache_events(self, events: Sequence) -> None:
        if not events:
            return
        step = events[0].step
        start = step * self.step_ns
        self._builder.add_step(step, start, start + self.step_ns, events)
        self._pending_steps += 1
        if self._builder.pending_spans >= self.flush_spans or self._pending_steps >= self.flush_cache_steps:
            self.flush()

    # -- output --------------------------------------------------------------------------------
    def flush(self) -> int:
        """Build pending spans into one batch and hand it to every processor; returns its size."""
        self._pending_steps = 0
        batch = self._builder.build()
        if batch is None:
            return 0
        self.emit(batch)
        return batch.num_spans

    def emit(self, batch: SpanBatch) -> None:
        self._resolve_processors()  # processors added to the provider late still get spans
        self.spans_emitted += batch.num_spans
        self.batches_emitted += 1
        if self._opening is not None:
            self._send_opening()
        for bulk in self._bulk:
            bulk.on_batch(batch)
        if self._other:
            for span in table_to_readable_spans(batch.table, self.resource):
                for proc in self._other:
                    proc.on_end(span)

    def open_run(self, record: Mapping[str, Any]) -> None:
        """Send, as its own export request just ahead of the run's first batch of spans, an
        opening record: a ``kvtrace.run`` span of status ``running`` carrying what is known at
        the start (name, trace, trace digest, config, behaviours, created; never a digest or a
        summary), so a collected copy of a run killed before its end (kill -9: no record) keeps
        its settings. A collector sets them where no record set them and finishes nothing with
        it; ``record_run`` still finishes the run. Only to the OTLP exports, as ``record_run``."""
        fields = {k: v for k, v in record.items() if k not in ("status", "digest", "summary")}
        self._opening = {**self._record_attributes(fields), f"{RUN_RECORD_PREFIX}status": OPENING_STATUS}
        if self.batches_emitted:  # (opened late: it goes now)
            self._send_opening()

    def _send_opening(self) -> None:
        attrs, self._opening = self._opening, None
        exports = [p for p in self._resolved_bulk() if p.columnar is None]
        if attrs is None or not exports:
            return
        # ids of its own, far past the run's (the seeded counter the spans take theirs from is left
        # as it was: a store written directly, and the spans of the export, keep the ids they had)
        ids = SeededIdGenerator(self.ids.seed)
        ids.reserve(OPENING_ORDINAL)
        ctx = trace_api.SpanContext(trace_id=ids.generate_trace_id(), span_id=ids.generate_span_id(),
                                    is_remote=False, trace_flags=trace_api.TraceFlags(trace_api.TraceFlags.SAMPLED))
        self.records_sent += 1
        for proc in exports:
            proc.send_now(ReadableSpan(  # (its own request, ahead of the batch: not held for 2,048 spans)
                name=SPAN_RUN, context=ctx, resource=proc.resource or self.resource, attributes=attrs,
                start_time=proc.time_offset_ns, end_time=proc.time_offset_ns,
                instrumentation_scope=InstrumentationScope(SCOPE_NAME, __version__),
            ))

    @staticmethod
    def _record_attributes(record: Mapping[str, Any]) -> dict[str, str]:
        return {f"{RUN_RECORD_PREFIX}{k}": v if isinstance(v, str) else json.dumps(v, sort_keys=True)
                for k, v in record.items() if v is not None}

    def record_run(self, record: Mapping[str, Any], end_ns: int = 0) -> None:
        """Send the run record (``runs`` columns: name, config, digest, status, summary...)
        as one ``kvtrace.run`` span to the OTLP exports, where no runs table exists (a
        collector's ``otel_traces``): attributes ``kvtrace.run.<column>``, JSON fields as
        text. Spans from 0 to ``end_ns`` of virtual time, shifted like the run's spans.
        A store keeps its own runs table and never receives it."""
        exports = [p for p in self._resolved_bulk() if p.columnar is None]
        if not exports:
            return
        self.flush()
        self._opening = None  # (no span went before it: the record carries all an opening one would)
        attrs = self._record_attributes(record)
        trace_id, span_id = self.ids.generate_trace_id(), self.ids.generate_span_id()
        ctx = trace_api.SpanContext(trace_id=trace_id, span_id=span_id, is_remote=False,
                                    trace_flags=trace_api.TraceFlags(trace_api.TraceFlags.SAMPLED))
        self.records_sent += 1
        for proc in exports:
            proc.on_end(ReadableSpan(
                name=SPAN_RUN, context=ctx, resource=proc.resource or self.resource, attributes=attrs,
                start_time=proc.time_offset_ns, end_time=proc.time_offset_ns + max(0, int(end_ns)),
                instrumentation_scope=InstrumentationScope(SCOPE_NAME, __version__),
            ))

    def flush_stores(self) -> None:
        """Flush pending spans and the processors that write a store (columnar ones): the
        run's spans are committed when it returns, whatever an OTLP export still holds."""
        self.flush()
        for proc in self._resolved_bulk():
            if proc.columnar is not None:
                proc.force_flush()

    def _resolved_bulk(self) -> tuple[BulkSpanProcessor, ...]:
        self._resolve_processors()
        return self._bulk

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Flush pending spans and every processor (spans are in the store when it returns)."""
        self.flush()
        self._resolve_processors()
        ok = True
        procs: tuple[SpanProcessor, ...] = self._bulk + self._other
        for proc in procs:
            ok = proc.force_flush(timeout_millis) and ok
        return ok
