"""A request the pool CAN finish is refused as one it cannot hold (574d887's lone-preemption
rule, and the older idle refusal with caching on): a sliding-window request alone takes the
whole budget a step (vLLM's long_prefill_token_threshold applies only while another request
waits), which with the window's blocks overflows a small pool at token 64, so it preempts
itself there (caching off) or cannot be admitted (caching on), twice. A later arrival makes
the threshold apply, its 16-token chunks fit, and it finishes (as it did when that arrival
came before its second preemption). It was refused while an arrival that changes its chunk
was pending; it is now replayed as vLLM does (preempted and admitted again, or idle) until that
arrival (re-probe 30)."""

from __future__ import annotations

import signal
from dataclasses import replace

import numpy as np
import pytest

from kvtrace.cache import CacheConfig
from kvtrace.cache.config import SlidingWindowSpec
from kvtrace.engine import Engine
from kvtrace.engine.config import SchedulerConfig
from kvtrace.engine.presets import get_preset
from kvtrace.workload.request import TraceRequest


def lone_preset(spec, caching: bool):
    """One group on a 5-block pool, a 64-token budget, chunks cut at 16 tokens while another
    request waits, no admission gate."""
    cc = CacheConfig(groups=(spec,), num_gpu_blocks=5, hash_block_size=16, enable_caching=caching)
    sc = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, scheduler_reserve_full_isl=False,
                         long_prefill_token_threshold=16)
    return replace(get_preset("dense-attention"), cache_config=cc, scheduler_config=sc)


def _hung(*_):
    raise AssertionError("Engine.run did not return in 60 s")


def run_within_60s(preset, requests):
    """The engine's run of ``requests``, failed as a hang past 60 s."""
    previous = signal.signal(signal.SIGALRM, _hung)
    signal.alarm(60)
    try:
        return Engine(preset, content=False).run(requests)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("later", [10**6, 10**8])
def test_a_request_a_later_arrival_lets_fit_is_not_refused(caching, later):
    preset = lone_preset(SlidingWindowSpec(16, 32), caching)
    requests = [TraceRequest("A", 0, 512, 2, token_ids=np.arange(1, 513, dtype=np.int64)),
                TraceRequest("B", later, 16, 2, token_ids=np.arange(1000, 1016, dtype=np.int64))]
    assert run_within_60s(preset, requests).summary["requests"] == 2


def test_a_request_no_arrival_can_help_is_still_refused_at_once():
    """Preempted alone at a decode (its prompt and first outputs fill the pool): another request
    beside it cuts nothing, so it is refused at its second preemption there, not replayed until a
    request a simulated day later arrives."""
    from kvtrace.cache import FullAttentionSpec
    from kvtrace.errors import KVTraceError

    preset = lone_preset(FullAttentionSpec(16), caching=False)
    requests = [TraceRequest("A", 0, 48, 40, token_ids=np.arange(1, 49, dtype=np.int64)),
                TraceRequest("B", 86_400 * 10**9, 16, 2, token_ids=np.arange(1000, 1016, dtype=np.int64))]
    with pytest.raises(KVTraceError, match=r"request A \(48 prompt tokens and \d+ generated before a preemption"):
        run_within_60s(preset, requests)
