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


@pytest.mark.parametrize("preset_name", ["dense-attention", "kimi-hybrid"])
def test_a_later_prompt_of_zeros_does_not_hit_the_outputs_no_content_made_up(preset_name):
    """t2 resends t1's 32-token prompt followed by 16 tokens of id 0, a valid token. Without
    content every sampled token was 0: t1's first 16 outputs made the block t2 then hit
    (dense: 48 hit tokens where content mode, whose outputs are the content model's, hits 32)."""
    import numpy as np

    from kvtrace.engine import get_preset
    from kvtrace.workload import TraceRequest

    prompt = np.arange(100, 132)
    work = [TraceRequest("t1", 0, 32, 20, token_ids=prompt),
            TraceRequest("t2", 10**9, 64, 2, token_ids=np.concatenate([prompt, np.zeros(16, int), np.full(16, 5)]))]
    preset = get_preset(preset_name, block_size=16)
    full, bare = Engine(preset).run(work), Engine(preset, content=False).run(work)
    # content mode: t1's prompt (32 tokens; the hybrid keeps t1's state at 16 of them)
    assert full.requests[1].num_local_hit_tokens == (32 if preset_name == "dense-attention" else 16)
    same = sorted(set(full.summary) - set(CONTENT_ONLY))
    assert {k: bare.summary[k] for k in same} == {k: full.summary[k] for k in same}
    assert [(r.num_local_hit_tokens, r.first_token_ns) for r in bare.requests] \
        == [(r.num_local_hit_tokens, r.first_token_ns) for r in full.requests]
