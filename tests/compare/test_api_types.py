"""The public API's comparison and sweep entries refuse what is no value of their kind in one
ConfigError line at the flag the CLI names it by, before anything runs (re-probe 30: each was
an AttributeError, TypeError or numpy truth ValueError traceback, some after replays)."""

from __future__ import annotations

import numpy as np
import pytest

from kvtrace.compare.source import diff_runs
from kvtrace.compare.study import run_study
from kvtrace.errors import ConfigError, KVTraceError
from kvtrace.replay.curve import run_curve
from kvtrace.replay.run import RunSpec
from kvtrace.replay.sweep import run_sweep

SPEC = RunSpec("gen:chat", limit=2, mode="cache-only")


@pytest.mark.parametrize("capacities", [None, 5, ["10"], np.array([10])], ids=repr)
def test_a_curve_of_capacities_that_are_no_text_is_refused(capacities):
    with pytest.raises(ConfigError, match=r"^--capacities: .*expected auto or C1,C2,\.\.\., a string$"):
        run_curve(SPEC, capacities)


@pytest.mark.parametrize("call", [lambda: run_curve(5, "auto"), lambda: run_sweep(5, [("seed", [1])]),
                                  lambda: run_study("shared-prefix-pinning", base=5)],
                         ids=["curve", "sweep", "study"])
def test_a_spec_that_is_no_runspec_is_refused(call):
    with pytest.raises(ConfigError, match=r"^(spec|base): 5: expected a RunSpec$"):
        call()


@pytest.mark.parametrize("params", [None, 5, "x", [("capacity_blocks", 5)], [(5, [1])], [("seed",)]], ids=repr)
def test_sweep_params_that_are_no_pairs_of_a_name_and_values_are_refused(params):
    done = []
    with pytest.raises(ConfigError, match=r"^--param: .*expected a sequence of \(setting name, list of values\)"):
        run_sweep(SPEC, params, workers=1, on_done=done.append)
    assert done == []


@pytest.mark.parametrize(("kwargs", "flag"), [({"trace": np.array(["gen:chat"])}, "TRACE")])
def test_a_study_trace_that_is_no_text_is_refused(kwargs, flag):
    with pytest.raises(ConfigError, match=rf"^{flag}: "):
        run_study("shared-prefix-pinning", **kwargs)


def test_a_study_of_a_behaviour_that_is_no_name_is_refused():
    with pytest.raises(KVTraceError, match="study: unknown behaviour"):
        run_study(np.array(["shared-prefix-pinning", "x"]))


@pytest.mark.parametrize(("args", "kwargs", "flag"), [
    ((["x"], "r1"), {}, "RUN"), (("r1", 5), {}, "RUN"), (("r1", "r2"), {"force": "no"}, "--force"),
    (("r1", "r2"), {"percentiles": "x"}, "--percentiles"), (("r1", "r2"), {"percentiles": 1.5}, "--percentiles"),
    (("r1", "r2"), {"percentiles": None}, "--percentiles"),
], ids=repr)
def test_a_diff_of_odd_run_ids_force_or_percentiles_is_refused_before_the_store(tmp_path, args, kwargs, flag):
    with pytest.raises(ConfigError, match=rf"^{flag}: "):
        diff_runs(str(tmp_path / "missing.duckdb"), *args, **kwargs)
