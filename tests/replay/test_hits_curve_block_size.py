"""A trace of no request is refused alike by replay and curve (a curve stated the block size of one)."""

from __future__ import annotations

import json

import pytest

from kvtrace.errors import TraceFormatError
from kvtrace.replay.curve import run_curve
from kvtrace.replay.run import RunSpec, run_replay
from tests.cli.test_cli import kvtrace


def test_a_trace_of_no_request_is_refused_by_replay_and_curve_alike(tmp_path):
    """A trace that parses but holds no request (a native header, an Azure CSV's header
    alone) replayed nothing and exited 0 with a digest, where an empty file was an error
    (a curve of it stated its block size): now one error naming the file, everywhere."""
    native = tmp_path / "empty.jsonl"
    native.write_text(json.dumps({"kvtrace_trace": 1}) + "\n")
    azure = tmp_path / "header.csv"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    for trace in (native, azure):
        spec = RunSpec(str(trace), mode="cache-only")
        for attempt, args in ((run_replay, (spec,)), (run_curve, (spec, "3,inf"))):
            with pytest.raises(TraceFormatError, match="holds no request") as err:
                attempt(*args)
            assert str(trace) in str(err.value)
    limited = RunSpec(str(native), mode="cache-only", limit=5)  # (a --limit read alike)
    with pytest.raises(TraceFormatError, match="holds no request"):
        run_replay(limited)
    out = kvtrace("replay", str(azure), "--mode", "cache-only")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "header.csv: holds no request" in out.stderr
