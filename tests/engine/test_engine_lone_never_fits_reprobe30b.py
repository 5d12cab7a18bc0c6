"""A request no chunking lets fit is refused at once, not after the next arrival (re-probe 30b).

6d4f5ca / 12be138 let a request that preempts itself alone wait for a later arrival whose
long_prefill_token_threshold may cut its chunk (vLLM cuts only while another request waits).
A request whose full-attention blocks alone outgrow the pool fits under no chunking, yet it
waited too: with caching off it was preempted and admitted again every step until the next
arrival (a simulated day later: minutes of replay, millions of preemptions), then refused as
before. It is refused at once; the sliding-window request a later arrival does help still
waits (test_engine_lone_wait_reprobe30.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvtrace.cache import FullAttentionSpec
from kvtrace.errors import KVTraceError
from kvtrace.workload.request import TraceRequest
from tests.engine.test_engine_lone_wait_reprobe30 import lone_preset, run_within_60s

DAY_NS = 86_400 * 10**9


@pytest.mark.parametrize("caching", [False, True])
def test_a_request_larger_than_the_pool_is_refused_without_waiting_for_the_next_arrival(caching):
    # 100 prompt tokens need 7 blocks of 16; the pool holds 5 (16-token chunks would not help)
    preset = lone_preset(FullAttentionSpec(16), caching)
    requests = [TraceRequest("A", 0, 100, 2, token_ids=np.arange(1, 101, dtype=np.int64)),
                TraceRequest("B", DAY_NS, 16, 2, token_ids=np.arange(1000, 1016, dtype=np.int64))]
    with pytest.raises(KVTraceError, match=r"request A \(100 prompt tokens\) cannot be scheduled: it needs more KV "
                                           r"blocks than the pool holds \(num_gpu_blocks 5\)"):
        run_within_60s(preset, requests)
