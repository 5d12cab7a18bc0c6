"""Sweep and curve, re-probed (session 25): what a replay's own error says of the runs a
sweep kept before it, and what a curve's note says of the curves it drew."""

from __future__ import annotations

import os

import pytest

from kvtrace.errors import TraceFormatError
from kvtrace.replay.run import RunSpec
from kvtrace.replay.sweep import run_sweep
from kvtrace.store import read
from tests.conftest import MOONCAKE


@pytest.mark.parametrize("how", ["deleted", "cut"])
def test_a_trace_lost_midway_says_where_the_sweep_stopped_and_what_it_kept(tmp_path, how):
    """A trace deleted (or cut to a bad line) while the sweep ran stopped it with one line
    naming the file, and nothing said that the runs stored before it were kept and the
    rest never ran (a replay's untyped error said both)."""
    trace = tmp_path / "t.jsonl"
    lines = MOONCAKE.read_text().splitlines()[:30]
    trace.write_text("\n".join(lines) + "\n")
    db = tmp_path / "s.duckdb"

    def lose(run) -> None:  # (workers=1: the next replay starts after the first is stored)
        if how == "deleted":
            os.unlink(trace)
        else:
            trace.write_text("\n".join(lines[:3]) + '\n{"timestamp": 5, "input_length": "x"}\n')

    with pytest.raises(TraceFormatError) as caught:
        run_sweep(RunSpec(str(trace), mode="cache-only"), [("capacity_blocks", [300, 600, 900])], db=db,
                  workers=1, on_done=lose)
    line = str(caught.value)
    assert line.startswith(str(trace)) and caught.value.path == str(trace)
    assert line.endswith("; the sweep stopped at capacity_blocks=600, 1 of 3 combinations stored")
    assert "\n" not in line and caught.value.what.endswith("1 of 3 combinations stored")
    assert read.runs(db)["status"].to_list() == ["complete"]
