"""Sweep and curve, re-probed (session 23): what a failed replay leaves said, a flag that
did nothing, and a capacity curve that falls where LRU is no stack algorithm."""

from __future__ import annotations

import pytest

from kvtrace.errors import ConfigError, KVTraceError
from kvtrace.replay.curve import CurveResult, capacity_curve, run_curve
from kvtrace.replay.run import RunSpec
from kvtrace.replay.sweep import run_sweep
from kvtrace.store import read
from kvtrace.workload import TraceRequest
from tests.conftest import MOONCAKE


def test_a_replay_failed_midway_says_where_the_sweep_stopped_and_what_it_kept(tmp_path):
    """A worker's death said where the sweep stopped and how many runs it stored; a replay's
    own failure said neither (the combinations after it never ran, unsaid), and its advice
    named --capacity-blocks, which a sweep of the capacity refuses beside --param."""
    db = tmp_path / "s.duckdb"
    with pytest.raises(KVTraceError) as caught:
        run_sweep(RunSpec("gen:chat", limit=3, content=False), [("capacity_blocks", [2000, 4, 3000])], db=db,
                  workers=1)
    line = str(caught.value)
    assert line.startswith("--param capacity_blocks=4: engine: ")
    assert line.endswith("; the sweep stopped at capacity_blocks=4, 1 of 3 combinations stored")
    assert "raise the capacity_blocks values of --param" in line and "--capacity-blocks" not in line
    assert read.runs(db)["status"].to_list() == ["complete"]


def test_a_curves_failed_capacity_says_the_curve_is_not_recorded(tmp_path):
    db = tmp_path / "c.duckdb"
    with pytest.raises(KVTraceError) as caught:
        run_curve(RunSpec("gen:chat", limit=3, content=False), "2000,4", policies=("lru",), db=db, workers=1)
    line = str(caught.value)
    assert line.startswith("--capacities 4: engine: ") and "raise the --capacities" in line
    assert line.endswith("; the curve stopped at --capacities 4, 0 of 2 capacities stored "
                         "(the curve itself is not recorded)")


def test_a_cache_only_curve_refuses_workers_as_it_refuses_ray():
    """--workers was taken in cache-only mode and did nothing (the curve is one pass in this
    process), where --ray beside it was refused."""
    spec = RunSpec(str(MOONCAKE), mode="cache-only", limit=20)
    with pytest.raises(ConfigError, match=r"^--workers: 2: engine mode only"):
        run_curve(spec, "10", workers=2)
    assert run_curve(spec, "10").points  # (without it, as before)


def _falling_trace() -> list[TraceRequest]:
    """A, then B C, then A again, one token a block: one block of cache keeps A (B C does not
    fit it and passes by), two blocks give it to B C."""
    paths = [(0,), (1, 2), (0,)]
    return [TraceRequest(f"r{i}", i, len(p), 1, hash_ids=p, hash_block_size=1) for i, p in enumerate(paths)]


def test_a_curve_that_falls_below_the_largest_request_says_why():
    """Below the largest request LRU is no stack algorithm: the curve fell as the capacity
    grew, and nothing said that it could."""
    points = capacity_curve(_falling_trace(), [1, 2], policies=("lru",))
    assert [(p.capacity_blocks, p.hit_tokens, p.method) for p in points] == [(1, 1, "replay"), (2, 0, "one-pass")]
    note = CurveResult("c", "t", "cache-only", 1, points).method_note()
    assert "the LRU curve can fall as the capacity grows" in note
    above = capacity_curve(_falling_trace(), [2, 3], policies=("lru",))
    assert "can fall" not in CurveResult("c", "t", "cache-only", 1, above).method_note()


def test_a_config_file_changed_while_the_sweep_ran_is_refused_not_mixed_in(tmp_path, monkeypatch):
    """Each replay reads the --config file itself, as it reads the trace: one rewritten midway
    gave runs of two configurations under one sweep id (the id hashing the file as it was
    when the first replay came back), exit 0; a rewritten trace was refused already."""
    from kvtrace.replay import sweep

    config = tmp_path / "c.toml"
    config.write_text("[scheduler]\nmax_num_seqs = 256\n")
    real, done = sweep._replay_one, []

    def rewritten_after_the_first(spec, keep):
        res = real(spec, keep)
        if not done:  # as an editor saving it would
            config.write_text("[scheduler]\nmax_num_seqs = 1\n")
        done.append(spec.capacity_blocks)
        return res

    monkeypatch.setattr(sweep, "_replay_one", rewritten_after_the_first)
    db = tmp_path / "s.duckdb"
    base = RunSpec("gen:chat", limit=3, content=False, config_file=str(config))
    with pytest.raises(ConfigError) as caught:
        run_sweep(base, [("capacity_blocks", [2000, 3000, 4000])], db=db, workers=1)
    assert str(caught.value).startswith(f"{config}: changed while the sweep ran: its replay may have read other "
                                        "settings than the sweep began with; the sweep stopped at "
                                        "capacity_blocks=3000, 1 of 3 combinations stored")
    runs = read.runs(db)
    assert runs["name"].to_list() == ["sweep capacity_blocks=2000"] and runs["status"].to_list() == ["complete"]


def test_an_engine_curves_capacities_are_drawn_one_fewer_as_its_help_says(capsys):
    """`--capacities 30` drew its point at 29 (the run's usable blocks, vLLM's null block
    left out), and the help said only 'capacities in blocks'."""
    import json

    from tests.cli.support import run

    code, out, _ = run(["curve", "--help"], capsys)
    assert code == 0 and "num_gpu_blocks" in " ".join(out.split()) and "one fewer" in " ".join(out.split())
    code, out, _ = run(["curve", "gen:chat", "--limit", "3", "--mode", "engine", "--no-content", "--capacities",
                        "2000", "--workers", "1", "--json"], capsys)
    assert code == 0 and [p["capacity_blocks"] for p in json.loads(out)["points"]] == [1999]


def _fake_ray(calls: list[str], stops: list[int]):
    """A stand-in for Ray whose init installs Ray's SIGTERM handler (sys.exit(signum)) and
    meets ``stops`` midway: the handler in place is called as the signal would call it."""
    import signal
    import sys
    import types

    def set_sigterm_handler(handler):  # as Ray's
        signal.signal(signal.SIGTERM, handler)

    def init(**kwargs):
        fake._private.utils.set_sigterm_handler(lambda signum, frame: sys.exit(signum))
        for sig in stops:
            signal.getsignal(sig)(sig, None)
        calls.append("started")

    fake = types.SimpleNamespace(is_initialized=lambda: False, init=init, shutdown=lambda: calls.append("shut down"),
                                 _private=types.SimpleNamespace(utils=types.SimpleNamespace(
                                     set_sigterm_handler=set_sigterm_handler)))
    return fake


@pytest.mark.parametrize(("stops", "calls"), [
    (["SIGTERM"], ["started", "shut down"]), (["SIGINT"], ["started", "shut down"]),
    (["SIGTERM", "SIGTERM"], ["shut down"])])  # (a second one forces the stop midway)
def test_a_stop_while_ray_starts_is_the_commands_and_ray_is_shut_down(monkeypatch, stops, calls):
    """A SIGTERM while `--ray local` started its cluster met Ray's own handler (put in place
    by ray.init: sys.exit(15)): the command exited with status 15 without a word; and a stop
    midway left the cluster half started, its agents running on with no parent. A stop is
    held until ray.init is done, then taken as the command's, the cluster shut down."""
    import signal
    import sys

    from kvtrace.process import Terminated, sigterm_as_interrupt

    done: list[str] = []
    fake = _fake_ray(done, [getattr(signal, s) for s in stops])
    installer = fake._private.utils.set_sigterm_handler
    monkeypatch.setitem(sys.modules, "ray", fake)
    with sigterm_as_interrupt(), pytest.raises(Terminated if stops[0] == "SIGTERM" else KeyboardInterrupt) as caught:
        run_sweep(RunSpec("gen:chat", limit=2, content=False), [("capacity_blocks", [2000, 3000])],
                  ray_address="local")
    assert (stops[0] == "SIGTERM") == isinstance(caught.value, Terminated)
    assert done == calls
    assert fake._private.utils.set_sigterm_handler is installer  # (put back)


def test_a_sweep_of_mode_shows_each_runs_own_cache():
    """capacity_blocks=30 was one cell for an engine run (the preset's 512-token blocks, 29
    usable) and a cache-only one (the trace's 16-token blocks, 30): 53% against 0% read as
    the same cache. The table shows each run's blocks and their size where they differ."""
    from kvtrace.replay.sweep import sweep_table

    result = run_sweep(RunSpec("gen:chat", limit=3), [("mode", ["engine", "cache-only"]), ("capacity_blocks", [30])],
                       workers=1)
    rows = sweep_table(result)
    column = rows[0].index("cache (blocks x tokens)")
    shown = [row[column] for row in rows[1:]]
    assert shown == [f"{r.summary['capacity_blocks']:,} x {r.summary['block_size']}" for r in result.runs]
    assert shown[0] != shown[1]
    same = run_sweep(RunSpec("gen:chat", limit=3, content=False), [("capacity_blocks", [30, 60])], workers=1)
    assert "cache (blocks x tokens)" not in sweep_table(same)[0]  # (one block size: the params say it)


@pytest.mark.parametrize(("params", "given", "what"), [
    ([("capacity_blocks", [30, 60]), ("capacity_tokens", [20_000])], {},
     "--param: capacity_blocks: is swept with capacity_tokens, the same capacity in other units; sweep one of them"),
    ([("capacity_blocks", [30, 60])], {"capacity_tokens": 20_000},
     "--param: capacity_blocks: is also set for the whole sweep (capacity_tokens = 20000); give it one way"),
    ([("capacity_tokens", [20_000])], {"capacity_blocks": 30},
     "--param: capacity_tokens: is also set for the whole sweep (capacity_blocks = 30); give it one way"),
    # (probe 35: a tuple of names was shown as Python's, "(('shared-prefix-pinning',))")
    ([("without", [(), ("external-hit-running-cow",)])], {"without": ("shared-prefix-pinning",)},
     "--param: without: is also set for the whole sweep (shared-prefix-pinning); give it one way"),
])
def test_a_capacity_swept_in_one_unit_and_given_in_the_other_is_refused_by_the_sweep(params, given, what):
    """The capacity in blocks and in tokens are one setting (as study takes them): swept in
    one and given in the other, each combination was refused as "give either it or
    --capacity-blocks (30)", naming a flag never typed."""
    with pytest.raises(ConfigError) as err:
        run_sweep(RunSpec("gen:mixed", limit=2, content=False, **given), params)
    assert str(err.value) == what
