"""run_study and run_demo refuse an API caller's hostile arguments in one line before any
replay (re-probe 31, beside 640e767): a study's behaviour whose repr raises, or an int past
4,300 digits, raised that exception in place of 'unknown behaviour'; a limit that is an
array or whose __eq__ raises was that exception; a demo's progress of None or an array ran
on its truth (or a ValueError), and a console that is none was an AttributeError once the
whole demo was recorded."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvtrace.compare.demo import run_demo
from kvtrace.compare.study import run_study
from kvtrace.errors import ConfigError, KVTraceError


class _NoRepr:
    def __repr__(self):
        raise RuntimeError("no repr")


class _NoEq:
    def __eq__(self, other):
        raise RuntimeError("no eq")

    __hash__ = object.__hash__


@pytest.mark.parametrize("behaviour", [_NoRepr(), 10**5000], ids=["raising-repr", "huge-int"])
def test_a_study_of_a_behaviour_with_no_repr_is_refused_as_unknown(behaviour):
    with pytest.raises(KVTraceError, match=r"^study: unknown behaviour <(_NoRepr whose repr raised|int of about)"):
        run_study(behaviour)


@pytest.mark.parametrize("limit", [np.array([1, 2]), _NoEq(), 2.5, "3", True], ids=["array", "raising-eq", "float",
                                                                                    "str", "bool"])
def test_a_study_of_a_limit_that_is_no_count_is_refused_at_limit(limit):
    with pytest.raises(ConfigError, match=r"^--limit: .*expected a number of requests >= 1"):
        run_study("shared-prefix-pinning", limit=limit)


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"progress": None}, "progress"), ({"progress": np.array([True, False])}, "progress"),
    ({"progress": "no"}, "progress"), ({"console": 5}, "console"), ({"console": "stdout"}, "console"),
], ids=["progress-none", "progress-array", "progress-str", "console-int", "console-str"])
def test_a_demo_of_hostile_progress_or_console_is_refused_before_any_replay(tmp_path, kwargs, name):
    with pytest.raises(ConfigError, match=rf"^{name}: "):
        run_demo(tmp_path / "d.duckdb", limit=2, **{"progress": False, **kwargs})
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("backend", [np.array(["vllm", "kvtrace"]), _NoEq(), 5], ids=["array", "raising-eq", "int"])
def test_a_demo_through_a_backend_that_is_no_name_is_refused_at_backend(tmp_path, backend):
    with pytest.raises(ConfigError, match=r"^--backend: .*expected a string$"):
        run_demo(tmp_path / "d.duckdb", progress=False, limit=2, backend=backend)
    assert os.listdir(tmp_path) == []


def test_a_study_of_a_trace_given_as_a_path_replays_it_as_runspec_takes_one():
    from pathlib import Path

    trace = Path(__file__).parents[1] / "data" / "mooncake_synthetic_trace.jsonl"
    result = run_study("shared-prefix-pinning", trace=trace, limit=3)
    assert result.trace == str(trace)


@pytest.mark.parametrize("capacity", [5000, np.array([1, 2]), _NoRepr()], ids=["int", "array", "raising-repr"])
def test_a_base_that_also_sets_the_swept_setting_is_refused_in_one_line(capacity):
    # (an array's != was its truth ValueError in the check, a raising repr that exception)
    from kvtrace.compare.study import check_sweep_given_once
    from kvtrace.replay.run import RunSpec
    from kvtrace.replay.sweep import run_sweep

    with pytest.raises(ConfigError, match=r"^--sweep: capacity_blocks: is also set for the whole study"):
        check_sweep_given_once(RunSpec("gen:chat", limit=2, capacity_blocks=capacity), "capacity_blocks=100,200")
    with pytest.raises(ConfigError, match=r"^--param: capacity_blocks: is also set for the whole sweep"):
        run_sweep(RunSpec("gen:chat", limit=2, mode="cache-only", capacity_blocks=capacity),
                  [("capacity_blocks", [10])], workers=1)
