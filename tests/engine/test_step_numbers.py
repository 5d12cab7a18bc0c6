"""One step, one number: a step's cache events carry the number of the step they happened
in. The engine numbered its steps from 1 while the cache (and the vLLM backend, capture and
cache-only runs) numbered them from 0, so every cache span of step k lay in the time window
of the step span numbered k + 1, and a join on ``step`` paired each event with the next step."""

from __future__ import annotations

import pytest

from kvtrace.engine import Engine
from kvtrace.replay.run import RunSpec, run_replay
from kvtrace.store.read._sql import connect, query
from kvtrace.workload import TraceRequest


def _workload(n: int = 12):
    return [TraceRequest(f"q{i}", i * 2_000_000, 300 + 40 * (i % 3), 6, hash_ids=(1, 2, 3 + i % 4),
                         hash_block_size=128) for i in range(n)]


@pytest.mark.parametrize("backend", ["kvtrace", "vllm"])
def test_each_step_batch_holds_cache_events_of_its_own_number(backend):
    if backend == "vllm":
        pytest.importorskip("vllm")
    batches = []
    result = Engine("kimi-hybrid", backend=backend).run(_workload(), listeners=[batches.append])
    numbers = [b.step.step for b in batches]
    assert numbers == list(range(len(numbers))) and result.summary["steps"] == len(numbers)
    cache_steps = {(b.step.step, ev.step) for b in batches for ev in b.cache_events}
    assert cache_steps and all(a == b for a, b in cache_steps), sorted(cache_steps)[:5]


def test_stored_cache_and_lookup_spans_lie_in_the_step_span_of_their_number(tmp_path):
    db = tmp_path / "s.duckdb"
    result = run_replay(RunSpec("gen:chat", limit=6), db=db)
    with connect(db) as con:
        steps = query(con, "SELECT step, start_ns, end_ns FROM spans WHERE run_id = 'r1' AND "
                           "name = 'kvtrace.engine.step' ORDER BY step")
        events = query(con, "SELECT name, step, start_ns FROM spans WHERE run_id = 'r1' AND "
                            "(name LIKE 'kvtrace.cache.%')")
    assert steps["step"].to_list() == list(range(result.summary["steps"]))
    window = {r["step"]: (r["start_ns"], r["end_ns"]) for r in steps.iter_rows(named=True)}
    assert events.height > 0
    outside = [r for r in events.iter_rows(named=True)
               if not window[r["step"]][0] <= r["start_ns"] <= window[r["step"]][1]]
    assert not outside, outside[:3]
