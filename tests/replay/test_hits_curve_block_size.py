"""A curve states the block size its replays state, an empty trace's included."""

from __future__ import annotations

import json

from kvtrace.replay.curve import run_curve
from kvtrace.replay.run import RunSpec, run_replay


def test_an_empty_traces_curve_states_the_block_size_its_replay_does(tmp_path):
    # the curve said block_size null where `replay --mode cache-only` of the same file says 16
    trace = tmp_path / "empty.jsonl"
    trace.write_text(json.dumps({"kvtrace_trace": 1}) + "\n")
    spec = RunSpec(str(trace), mode="cache-only")
    replayed = run_replay(spec).summary
    curve = run_curve(spec, "3,inf")
    assert replayed["requests"] == 0 and curve.block_size == replayed["block_size"] == 16
    assert curve.to_json()["block_size"] == 16
