"""An instrumented engine's ``run`` refuses listeners that are no sequence of callables as the
engine does, in one KVTraceError line: the instrumentor's wrapper spread them first, a
TypeError traceback (re-probe 30)."""

from __future__ import annotations

import numpy as np
import pytest
from opentelemetry.sdk.trace import TracerProvider

from kvtrace.engine import Engine
from kvtrace.errors import KVTraceError
from kvtrace.instrument import KVCacheInstrumentor
from kvtrace.workload.request import TraceRequest


@pytest.mark.parametrize("listeners", [None, 5, 1.5, object()])
def test_an_instrumented_run_refuses_listeners_that_are_no_sequence_as_the_engine_does(listeners):
    engine = Engine("dense-attention", content=False)
    KVCacheInstrumentor(TracerProvider()).instrument(engine)
    request = TraceRequest("q", 0, 20, 2, token_ids=np.arange(1, 21, dtype=np.int64))
    with pytest.raises(KVTraceError, match=r"^engine: listeners .*; expected a sequence of callables"):
        engine.run([request], listeners)
    assert engine.run([request], [lambda batch: None]).summary["requests"] == 1  # (a good call still runs)
