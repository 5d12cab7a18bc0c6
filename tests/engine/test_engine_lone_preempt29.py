"""A request whose first chunk fits the pool but whose whole prompt never does, with caching off
and vLLM's admission gate off: it was admitted (its first chunk), preempted itself alone at its
next chunk (every block freed, nothing cached), was admitted again, and so on: `Engine.run`
never returned (474,035 steps in 15 s on a conformance fuzz case). It is refused as a request
the pool cannot hold, as it is with caching on (conformance probe 29)."""

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


def _hung(*_):
    raise AssertionError("Engine.run did not return in 60 s (r0 admitted and preempted for ever)")


@pytest.mark.parametrize("caching", [True, False])
def test_a_prompt_the_pool_cannot_hold_is_refused_not_replayed_for_ever(caching):
    cc = CacheConfig(groups=(FullAttentionSpec(16),), num_gpu_blocks=4, hash_block_size=16,  # 48 tokens usable
                     enable_caching=caching)
    sc = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, scheduler_reserve_full_isl=False)
    preset = replace(get_preset("dense-attention"), cache_config=cc, scheduler_config=sc)
    request = TraceRequest("r0", 0, 100, 2, token_ids=np.arange(1, 101, dtype=np.int64))
    previous = signal.signal(signal.SIGALRM, _hung)
    signal.alarm(60)
    try:
        with pytest.raises(KVTraceError, match=r"request r0 \(100 prompt tokens\) cannot be scheduled: it needs "
                                               r"more KV blocks than the pool holds"):
            Engine(preset, content=False).run([request])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_request_preempted_alone_that_then_fits_still_runs():
    """Preempted alone, then re-admitted beside a freed pool: it finishes (the refusal needs the
    same point twice). Two requests that each fit alone, together too large: both finish."""
    cc = CacheConfig(groups=(FullAttentionSpec(16),), num_gpu_blocks=5, hash_block_size=16, enable_caching=False)
    sc = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, scheduler_reserve_full_isl=False)
    preset = replace(get_preset("dense-attention"), cache_config=cc, scheduler_config=sc)
    requests = [TraceRequest(f"r{i}", i, 48, 8, token_ids=np.arange(1 + i, 49 + i, dtype=np.int64)) for i in range(2)]
    result = Engine(preset, content=False).run(requests)
    assert result.summary["requests"] == 2 and result.summary["preemptions"] >= 1
