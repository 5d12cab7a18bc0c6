"""The worker on hand-made SchedulerOutputs: own tables, copies, content, sampling."""

import numpy as np

from kvtrace.cache import BlockCopy, CacheConfig, FullAttentionSpec, MambaSpec
from kvtrace.engine import EngineRequest
from kvtrace.engine.scheduler import CachedRequestData, NewRequestData, SchedulerOutput
from kvtrace.engine.storage import DeviceStorage
from kvtrace.engine.worker import Worker
from kvtrace.workload import TraceRequest


def setup(n=20):
    cc = CacheConfig(groups=(FullAttentionSpec(8), MambaSpec(8)), num_gpu_blocks=16, hash_block_size=4)
    storage = DeviceStorage(cc, "cpu")
    worker = Worker(cc, storage)
    req = EngineRequest(TraceRequest("a", 0, n, 5, token_ids=np.arange(100, 100 + n)))
    return cc, storage, worker, req


def output(step, new=(), cached=(), sched=None, copies=()):
    sched = sched or {}
    return SchedulerOutput(step, list(new), list(cached), sched, sum(sched.values()), list(copies), [], [])


def test_tables_come_only_from_the_output_and_prefill_then_decode_match_the_reference():
    cc, storage, worker, req = setup()
    # prefill 0..16 into attention blocks [3, 4], state into Mamba slot 1 (block 7)
    req.num_computed_tokens = 16
    res = worker.execute(output(1, new=[NewRequestData("a", req, ([3, 4], [0, 7]), 0, 0)], sched={"a": 16}))
    assert worker.block_table("a") == ([3, 4], [0, 7])
    assert res.sampled == {} and res.num_prefill_tokens == 16
    # the last 4 prompt tokens: a running request; the worker appends the new ids it is sent
    req.num_computed_tokens = 20
    res = worker.execute(output(2, cached=[CachedRequestData("a", ([5], [0, 9]), 16)], sched={"a": 4}))
    assert worker.block_table("a") == ([3, 4, 5], [0, 7, 0, 9])
    assert list(res.sampled) == ["a"] and res.divergences == []
    assert res.sampled["a"] == worker.reference_token(req, 20)
    # kv of positions 16..19 sits in block 5, slots 0..3
    assert storage.read_kv(0, storage.arrays.ints([5]))[0, :4].tolist() != [0, 0, 0, 0]


def test_a_copy_runs_before_compute_and_a_wrong_table_is_caught_by_the_reference():
    cc, storage, worker, req = setup(12)
    req.num_computed_tokens = 8
    worker.execute(output(1, new=[NewRequestData("a", req, ([3, 4], [6]), 0, 0)], sched={"a": 8}))
    # copy the state at 8 (block 6) to block 10, then continue from a table that names 10
    req2 = EngineRequest(TraceRequest("b", 0, 12, 5, token_ids=np.arange(100, 112)))
    req2.num_computed_tokens = 12
    res = worker.execute(output(2, new=[NewRequestData("b", req2, ([3, 11], [10, 12]), 8, 0)], sched={"b": 4},
                                copies=[BlockCopy(1, 6, 10, "b", "partial_hit")]))
    assert res.num_state_copies == 1 and res.divergences == []
    # the same continuation reading a block that never held the state diverges
    req3 = EngineRequest(TraceRequest("c", 0, 12, 5, token_ids=np.arange(100, 112)))
    req3.num_computed_tokens = 12
    res = worker.execute(output(3, new=[NewRequestData("c", req3, ([3, 13], [14, 15]), 8, 0)], sched={"c": 4}))
    assert [d.request_id for d in res.divergences] == ["c"]
