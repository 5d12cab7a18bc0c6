"""run_sweep, run_curve and diff_runs refuse an API caller's hostile arguments in one
ConfigError line before anything runs (re-probe 31, the holes beside 640e767): a sweep's
on_done that is no callable was a TypeError after the first replay, a ray_address or
values_flag that is no string a TypeError or a numpy truth ValueError, a swept name that is
no setting an AttributeError, a swept value that is no key (a list) an unhashable TypeError,
one past 4,300 digits or with a raising repr str()'s own exception; a curve's policies that
are no sequence of names a TypeError, a ``computed`` that is no callable a TypeError once the
whole curve was computed; a diff's seed, top or resamples of 2.5 or a numpy float a
TypeError in numpy, one past 4,300 digits check_option's str() ValueError."""

from __future__ import annotations

import numpy as np
import pytest

from kvtrace.compare.source import diff_runs
from kvtrace.errors import ConfigError
from kvtrace.names import shown_value
from kvtrace.replay.curve import run_curve
from kvtrace.replay.run import RunSpec
from kvtrace.replay.sweep import run_sweep

SPEC = RunSpec("gen:chat", limit=2, mode="cache-only")


class _NoRepr:
    def __repr__(self):
        raise RuntimeError("no repr")

    def __hash__(self):
        return 1


@pytest.mark.parametrize(("kwargs", "flag"), [
    ({"on_done": 5}, "on_done"), ({"on_done": "x"}, "on_done"),
    ({"ray_address": 5}, "--ray"), ({"ray_address": np.array(["a", "b"])}, "--ray"),
    ({"values_flag": np.array(["a", "b"])}, "values_flag"),
    ({"params": [("", [1])]}, "--param"), ({"params": [("name", ["x"])]}, "--param"),
    ({"params": [("nope", [1])]}, "--param"),
    ({"params": [("without", [["shared-prefix-pinning"]])]}, "--param"),
    ({"params": [("seed", [np.array([1, 2])])]}, "--param"),
    ({"params": [("seed", [10**5000])]}, "--param"), ({"params": [("seed", [_NoRepr()])]}, "--param"),
], ids=lambda v: shown_value(v, 40))
def test_a_sweep_of_hostile_callers_arguments_is_refused_before_any_replay(kwargs, flag):
    done: list = []
    args = {"params": [("seed", [1, 2])], "workers": 1, "on_done": done.append, **kwargs}
    with pytest.raises(ConfigError, match=rf"^{flag}: "):
        run_sweep(SPEC, **args)
    assert done == []


@pytest.mark.parametrize(("kwargs", "flag"), [
    ({"policies": 5}, "--policy"), ({"policies": np.array(["lru", "belady"])}, "--policy"),
    ({"policies": [5]}, "--policy"), ({"policies": b"lru"}, "--policy"), ({"policies": "lru"}, "--policy"),
    ({"computed": 5}, "computed"), ({"computed": "x"}, "computed"),
], ids=lambda v: shown_value(v, 40))
def test_a_curve_of_hostile_policies_or_computed_is_refused_before_it_is_computed(kwargs, flag):
    with pytest.raises(ConfigError, match=rf"^{flag}: "):
        run_curve(SPEC, "10,20", **kwargs)


@pytest.mark.parametrize(("option", "value"), [
    ("seed", 2.5), ("seed", np.float64(2.0)), ("top", 2.5), ("top", np.float64(3.0)), ("resamples", 500.0),
    ("seed", 10**5000), ("top", 10**5000), ("resamples", -(10**5000)), ("seed", "1"),
], ids=lambda v: shown_value(v, 40))
def test_a_diff_of_a_count_that_is_no_whole_number_is_refused_at_its_option(tmp_path, option, value):
    with pytest.raises(ConfigError, match=rf"^--{option}: .*expected"):
        diff_runs(str(tmp_path / "missing.duckdb"), "r1", "r2", **{option: value})
