"""What a finished request leaves behind (memory at scale, session 30).

An engine replay grew about 16 KB a request (a day of traffic is 340,000): each finished
request was kept to the end as a ``RequestFinished`` whose ``itl_ns`` held every
inter-token gap as a Python int in a tuple (28-32 bytes an int, 8 its slot: about 6 KB of a
Mooncake request's), and the replay's per-request rows kept the same tuples. The engine now
keeps every gap of a run in one ``array('q')`` (``FinishedRequests``); reading a request
gives the event back as its listeners saw it, and every figure of the summary is the one
the events give.
"""

from __future__ import annotations

import gc
from array import array

from kvtrace.engine import Engine
from kvtrace.engine.engine import request_metrics
from kvtrace.engine.events import FinishedRequests, RequestFinished
from kvtrace.engine.request import EngineRequest
from kvtrace.replay.run import RunSpec, run_replay
from tests.engine.test_decode_fast_path import MOONCAKE, _replay_case


def _run(content: bool = False, limit: int = 60):
    preset, work = _replay_case(MOONCAKE, limit=limit)
    seen: list[RequestFinished] = []

    def listener(batch) -> None:
        seen.extend(e for e in batch.engine_events if isinstance(e, RequestFinished))

    return preset, Engine(preset, content=content).run(work, listeners=[listener]), seen


def test_a_runs_gaps_are_kept_in_one_array_and_read_back_as_the_events_had_them():
    _, result, seen = _run()
    done = result.requests
    assert isinstance(done, FinishedRequests) and len(done) == len(seen) == 60
    # kept: no tuple of gaps a request, every gap in one array of 8-byte ints
    assert all(r.itl_ns == () for r in done.without_gaps())
    assert isinstance(done.all_gaps, array) and done.all_gaps.typecode == "q"
    assert len(done.all_gaps) == sum(len(r.itl_ns) for r in seen) == sum(r.num_output_tokens - 1 for r in seen)
    # read back: the events as the listeners saw them, gaps a tuple of ints
    assert list(done) == seen and done == seen and done[-1] == seen[-1] and done[10:13] == seen[10:13]
    assert all(type(r.itl_ns) is tuple for r in done)
    assert [list(done.gaps(i)) for i in range(len(done))] == [list(r.itl_ns) for r in seen]
    assert done.gaps(-1).typecode == "q" and list(done.gaps(-1)) == list(seen[-1].itl_ns)


def test_the_summary_is_the_one_the_events_give():
    preset, result, seen = _run()
    block_size = preset.cache_config.groups[preset.cache_config.unit_group or 0].block_size
    assert request_metrics(result.requests, block_size) == request_metrics(seen, block_size)
    assert result.summary["requests"] == 60 and result.summary["mean_itl_ms"] is not None


def test_no_request_object_outlives_the_run():
    gc.collect()
    before = sum(type(o) is EngineRequest for o in gc.get_objects())  # (isinstance warns on torch proxies)
    _, result, _ = _run(content=True)
    gc.collect()
    assert sum(type(o) is EngineRequest for o in gc.get_objects()) == before
    assert len(result.requests) == 60


def test_a_replays_per_request_rows_keep_the_gaps_as_an_array():
    result = run_replay(RunSpec(MOONCAKE, limit=30, content=False))
    rows = result.per_request
    assert len(rows) == 30
    assert all(isinstance(r["itl_ns"], array) and r["itl_ns"].typecode == "q" for r in rows)
    _, _, seen = _run(limit=30)
    assert [list(r["itl_ns"]) for r in rows] == [list(r.itl_ns) for r in seen]
