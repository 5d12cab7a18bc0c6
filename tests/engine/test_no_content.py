"""``--no-content``: the engine without device content gives content mode's hits and timings.

Token values reach nothing but the keys of output blocks, which no later prompt of these
workloads shares, so every hit, eviction, preemption and virtual time must be the same;
what differs is only what needs content (divergences, stale hashes, table checks) and
the output blocks' hashes.
"""

from __future__ import annotations

import sys

import pytest

from kvtrace.cache.config import BEHAVIOURS
from kvtrace.engine import Engine
from kvtrace.replay.generate import WORKLOADS, study_workload
from tests.engine.test_decode_fast_path import MOONCAKE, _replay_case

SAME = ("requests", "prompt_tokens", "hit_tokens", "external_hit_tokens", "computed_prompt_tokens", "token_hit_rate",
        "block_hit_rate", "output_tokens", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99", "e2e_ms_p50",
        "e2e_ms_p99", "queue_ms_p50", "queue_ms_p99", "virtual_duration_s", "publishes", "evictions", "cow_copies",
        "steps", "preemptions", "evictions_by_reason")

CASES = {
    "kimi-mooncake": (MOONCAKE, dict(limit=120)),
    "kimi-mooncake-preempting": (MOONCAKE, dict(capacity_blocks=300, limit=60)),
    "dense-mixed": ("gen:mixed", dict(preset="dense-attention", limit=60)),
    "kimi-mixed-external": ("gen:mixed", dict(capacity_blocks=40, external_capacity_blocks=4096, limit=80)),
    **{f"study-{b}": (f"gen:study-{b}", dict(WORKLOADS[study_workload(b)].hints)) for b in BEHAVIOURS},
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_no_content_gives_the_same_hits_and_timings(name):
    trace, settings = CASES[name]
    preset, work = _replay_case(trace, **settings)
    full = Engine(preset).run(work)
    bare = Engine(preset, content=False).run(work)
    assert {k: bare.summary[k] for k in SAME} == {k: full.summary[k] for k in SAME}
    assert [(r.request_id, r.first_token_ns, r.finish_ns, r.itl_ns, r.num_local_hit_tokens) for r in bare.requests] \
        == [(r.request_id, r.first_token_ns, r.finish_ns, r.itl_ns, r.num_local_hit_tokens) for r in full.requests]
    assert bare.summary["divergent_outputs"] == bare.summary["stale_hashes"] == 0


def test_no_content_needs_no_torch():
    import subprocess

    code = ("import sys; from kvtrace.replay.run import RunSpec, run_replay; "
            f"s = run_replay(RunSpec({MOONCAKE!r}, limit=30, content=False)).summary; "
            "assert s['requests'] == 30; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
