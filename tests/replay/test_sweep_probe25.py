"""Sweep and curve, re-probed (session 25): what a replay's own error says of the runs a
sweep kept before it, and what a curve's note says of the curves it drew."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from kvtrace.errors import TraceFormatError
from kvtrace.replay.curve import CurveResult, capacity_curve, run_curve
from kvtrace.replay.run import RunSpec
from kvtrace.replay.sweep import run_sweep
from kvtrace.store import read
from kvtrace.workload import TraceRequest
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


def _tiny_trace() -> list[TraceRequest]:
    paths = [(0, 1), (0, 2), (0, 1)]
    return [TraceRequest(f"r{i}", i, 2 * 16, 1, hash_ids=p, hash_block_size=16) for i, p in enumerate(paths)]


@pytest.mark.parametrize("policies", [("lru",), ("belady",), ("lru", "belady")])
def test_a_curves_note_tells_how_the_curves_it_drew_were_made_and_no_other(policies):
    """`kvtrace curve --policy lru` closed with how its Belady bound was made (a replay at each
    capacity), a curve it never drew; `--policy belady`, with how its LRU curve was."""
    points = capacity_curve(_tiny_trace(), [2, 3, None], policies=policies)
    note = CurveResult("c", "t", "cache-only", 16, points).method_note()
    assert ("Belady" in note) == ("belady" in policies)
    assert ("LRU from one exact pass" in note) == ("lru" in policies)
    # the unbounded Belady point is the one pass's (its table row says one-pass), not a replay
    assert [p.method for p in points if p.capacity_blocks is None] == ["one-pass"] * len(policies)
    assert ("the unbounded cache's from the one pass" in note) == ("belady" in policies)


def test_an_engine_curves_runs_are_named_as_the_curves_not_a_sweeps(tmp_path):
    """An engine curve's runs were stored as "sweep capacity_blocks=300", the runs of a
    `kvtrace sweep` never typed, as `kvtrace runs` listed them; their events are a sweep's."""
    db = tmp_path / "c.duckdb"
    spec = RunSpec("gen:chat", limit=3, content=False)
    curve = run_curve(spec, "300,3000", db=db, workers=1)
    runs = read.runs(db).sort("run_id")
    assert runs["name"].to_list() == ["curve capacity_blocks=300", "curve capacity_blocks=3000"]
    assert [p.run_id for p in curve.points] == runs["run_id"].to_list()
    named = run_curve(replace(spec, name="mine"), "300", db=tmp_path / "n.duckdb", workers=1)
    assert read.runs(tmp_path / "n.duckdb")["name"].to_list() == ["mine capacity_blocks=300"]
    swept = run_sweep(spec, [("capacity_blocks", [300, 3000])], workers=1)
    assert runs["digest"].to_list() == [r.summary["digest"] for r in swept.runs]
    assert named.points[0].hit_tokens == curve.points[0].hit_tokens
