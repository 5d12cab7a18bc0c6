"""``Engine.run`` given what is no workload or no listener (the Python API, re-probe 30): each
is one KVTraceError line before the run, where it was a TypeError or AttributeError traceback
(listeners after the first step), a numpy array's truth ValueError, and a None among the
requests ended the run there without a word, the requests after it never replayed."""

from __future__ import annotations

import numpy as np
import pytest

from kvtrace.engine import Engine
from kvtrace.errors import KVTraceError
from kvtrace.workload.request import TraceRequest


def _request(i: int = 0) -> TraceRequest:
    return TraceRequest(f"q{i}", i, 20, 2, token_ids=np.arange(1 + i, 21 + i, dtype=np.int64))


@pytest.mark.parametrize("workload", [None, 0, 1.5, True, object(), "gen:mixed", b"x", np.int64(3)])
def test_a_workload_that_is_no_iterable_is_refused(workload):
    with pytest.raises(KVTraceError, match=r"^engine: workload .*; expected an iterable of TraceRequests$"):
        Engine("dense-attention", content=False).run(workload)


@pytest.mark.parametrize("item", [None, 1, "q", {"request_id": "q"}, ("q", 0, 20, 2)])
def test_an_item_that_is_no_request_is_refused_where_it_comes(item):
    with pytest.raises(KVTraceError, match=r"^workload: an item .* of type \w+; expected a TraceRequest$"):
        Engine("dense-attention", content=False).run([_request(0), item, _request(1)])


def test_a_none_among_the_requests_does_not_end_the_run_unsaid():
    """(it was the workload's end: one request replayed of two, exit 0)"""
    with pytest.raises(KVTraceError, match="an item None of type NoneType"):
        Engine("dense-attention", content=False).run(iter([_request(0), None, _request(1)]))


@pytest.mark.parametrize("listeners", [None, 5, "x", [None], [1], (print, "x"), np.array([1, 2])])
def test_listeners_that_are_not_callables_are_refused_before_the_run(listeners):
    with pytest.raises(KVTraceError, match=r"^engine: listeners? .*(expected a sequence of callables|is not callable)"):
        Engine("dense-attention", content=False).run([_request()], listeners=listeners)


def test_a_backend_that_is_no_name_is_refused():
    with pytest.raises(KVTraceError, match="unknown backend"):
        Engine("dense-attention", backend=np.array(["kvtrace", "vllm"]))  # type: ignore[arg-type]


def test_a_generator_of_requests_and_a_listener_list_still_run():
    seen: list = []
    result = Engine("dense-attention", content=False).run((_request(i) for i in range(3)), listeners=[seen.append])
    assert result.summary["requests"] == 3 and seen
