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

# What only content can tell (no content: null, not measured: a 0 would claim a checked,
# correct cache); every other summary field must be equal
CONTENT_ONLY = ("divergent_outputs", "stale_hashes", "table_disagreements")

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
    assert set(bare.summary) == set(full.summary)
    same = sorted(set(full.summary) - set(CONTENT_ONLY))
    assert {k: bare.summary[k] for k in same} == {k: full.summary[k] for k in same}
    assert [(r.request_id, r.first_token_ns, r.finish_ns, r.itl_ns, r.num_local_hit_tokens) for r in bare.requests] \
        == [(r.request_id, r.first_token_ns, r.finish_ns, r.itl_ns, r.num_local_hit_tokens) for r in full.requests]
    assert all(bare.summary[k] is None for k in CONTENT_ONLY)
    assert all(full.summary[k] is not None for k in CONTENT_ONLY)


def test_no_content_needs_no_torch():
    import subprocess

    code = ("import sys; from kvtrace.replay.run import RunSpec, run_replay; "
            f"s = run_replay(RunSpec({MOONCAKE!r}, limit=30, content=False)).summary; "
            "assert s['requests'] == 30; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
