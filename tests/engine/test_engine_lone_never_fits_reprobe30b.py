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

import signal
from dataclasses import replace

import numpy as np
import pytest

from kvtrace.cache import CacheConfig, FullAttentionSpec
from kvtrace.engine import Engine
from kvtrace.engine.config import SchedulerConfig
from kvtrace.engine.presets import get_preset
from kvtrace.errors import KVTraceError
from kvtrace.workload.request import TraceRequest

DAY_NS = 86_400 * 10**9


def _hung(*_):
    raise AssertionError("Engine.run did not return in 60 s")


@pytest.mark.parametrize("caching", [False, True])
def test_a_request_larger_than_the_pool_is_refused_without_waiting_for_the_next_arrival(caching):
    # 100 prompt tokens need 7 blocks of 16; the pool holds 5 (16-token chunks would not help)
    cc = CacheConfig(groups=(FullAttentionSpec(16),), num_gpu_blocks=5, hash_block_size=16, enable_caching=caching)
    sc = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, scheduler_reserve_full_isl=False,
                         long_prefill_token_threshold=16)
    preset = replace(get_preset("dense-attention"), cache_config=cc, scheduler_config=sc)
    requests = [TraceRequest("A", 0, 100, 2, token_ids=np.arange(1, 101, dtype=np.int64)),
                TraceRequest("B", DAY_NS, 16, 2, token_ids=np.arange(1000, 1016, dtype=np.int64))]
    previous = signal.signal(signal.SIGALRM, _hung)
    signal.alarm(60)
    try:
        with pytest.raises(KVTraceError, match=r"request A \(100 prompt tokens\) cannot be scheduled: it needs more KV "
                                               r"blocks than the pool holds \(num_gpu_blocks 5\)"):
            Engine(preset, content=False).run(requests)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
