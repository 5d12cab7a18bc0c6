"""The instrumentation API refuses what it cannot use when it is given, in one KVTraceError
line naming the argument: a path where a store goes (the plausible mistake) was taken, and
the first hand-over raised AttributeError inside the engine's run, then again in the SDK's
exit hook; a seed or run id of another type failed later, or never (ids keyed on a str)."""

from __future__ import annotations

import numpy as np
import pytest

from kvtrace.engine.engine import Engine
from kvtrace.errors import KVTraceError
from kvtrace.instrument import (
    BulkSpanProcessor,
    DuckDBSpanExporter,
    KVCacheInstrumentor,
    SeededIdGenerator,
    SpanBatchBuilder,
    build_tracer_provider,
    readable_spans_to_table,
    table_to_readable_spans,
)
from kvtrace.replay.sweep import _CollectedSpans  # (a sweep worker's span sink: no Store)


class ReprRaises:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


HOSTILE = {"a path": "x.duckdb", "None": None, "an int": 7, "a float": 1.5, "a bool": True, "10**5000": 10**5000,
           "repr raises": ReprRaises()}

ENTRIES = {
    "DuckDBSpanExporter store": (lambda v: DuckDBSpanExporter(v, "r"), {"None", "a path", "an int", "a float",
                                                                         "a bool", "10**5000", "repr raises"}),
    "DuckDBSpanExporter run_id": (lambda v: DuckDBSpanExporter(_CollectedSpans(), v),
                                  {"None", "an int", "a float", "a bool", "10**5000", "repr raises"}),
    "build_tracer_provider store": (lambda v: build_tracer_provider(store=v, run_id="r"),
                                    {"a path", "an int", "a float", "a bool", "10**5000", "repr raises"}),
    "build_tracer_provider run_id": (lambda v: build_tracer_provider(store=_CollectedSpans(), run_id=v),
                                     {"None", "an int", "a float", "a bool", "10**5000", "repr raises"}),
    "build_tracer_provider seed": (lambda v: build_tracer_provider(seed=v),
                                   {"None", "a path", "a float", "a bool", "10**5000", "repr raises"}),
    "SeededIdGenerator seed": (SeededIdGenerator, {"None", "a path", "a float", "a bool", "10**5000", "repr raises"}),
    "KVCacheInstrumentor run_id": (lambda v: KVCacheInstrumentor(None, run_id=v, processors=[]),
                                   {"an int", "a float", "a bool", "10**5000", "repr raises"}),
    "KVCacheInstrumentor seed": (lambda v: KVCacheInstrumentor(None, seed=v, processors=[]),
                                 {"None", "a path", "a float", "a bool", "10**5000", "repr raises"}),
    "KVCacheInstrumentor flush_spans": (lambda v: KVCacheInstrumentor(None, flush_spans=v, processors=[]),
                                        {"None", "a path", "a float", "a bool", "repr raises"}),
    "BulkSpanProcessor exporter": (BulkSpanProcessor, {"None", "a path", "an int", "a float", "a bool", "10**5000",
                                                       "repr raises"}),
    "SpanBatchBuilder ids": (SpanBatchBuilder, {"None", "a path", "an int", "a float", "a bool", "10**5000",
                                                "repr raises"}),
    "table_to_readable_spans": (table_to_readable_spans, set(HOSTILE)),
    "readable_spans_to_table": (readable_spans_to_table, set(HOSTILE)),
}


CASES = [(e, v) for e, (_, refused) in ENTRIES.items() for v in sorted(refused)]


@pytest.mark.parametrize(("entry", "value"), CASES, ids=[f"{e}-{v}" for e, v in CASES])
def test_a_value_it_cannot_use_is_one_line_naming_it(entry, value) -> None:
    make, _ = ENTRIES[entry]
    with pytest.raises(KVTraceError) as err:
        make(HOSTILE[value])
    line = str(err.value)
    assert "\n" not in line and len(line) < 400, line[:400]


def test_a_store_or_a_sweep_workers_sink_is_taken() -> None:
    assert DuckDBSpanExporter(_CollectedSpans(), "r").run_id == "r"
    assert build_tracer_provider(store=_CollectedSpans(), run_id="r", seed=2**64 - 1) is not None
    assert SeededIdGenerator(2**64 - 1).seed == 2**64 - 1


class IterRaises:
    def __iter__(self):
        raise RuntimeError("no iter")


@pytest.mark.parametrize(("label", "make"), [
    ("processors 5", lambda: KVCacheInstrumentor(None, processors=5)),
    ("processors [5]", lambda: KVCacheInstrumentor(None, processors=[5])),
    ("resource_attributes 5", lambda: build_tracer_provider(resource_attributes=5)),
    ("resource_attributes 'x'", lambda: build_tracer_provider(resource_attributes="x")),
    ("service_name 10**5000", lambda: build_tracer_provider(service_name=10**5000)),
    ("service_name 5", lambda: build_tracer_provider(service_name=5)),
    ("export array", lambda: build_tracer_provider(export=np.array([1, 2]))),
    ("background 'no'", lambda: build_tracer_provider(background="no")),
    ("listeners whose iter raises", lambda: Engine("kimi-hybrid").run([], listeners=IterRaises())),
])
def test_more_arguments_it_cannot_use_are_one_line(label, make) -> None:
    with pytest.raises(KVTraceError) as err:  # (re-probe 31: TypeError, ValueError, RuntimeError tracebacks)
        make()
    line = str(err.value)
    assert "\n" not in line and len(line) < 400, line[:400]
