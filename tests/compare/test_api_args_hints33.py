"""The compare API's public builders and formatters refuse what is no value of their kind in one
KVTraceError line naming the argument (re-probe hints33 of ce8fc96 and 45338fc, which checked
render's views, the gates and ``fmt``'s value): ``fmt_rel`` of a string was abs()'s TypeError and
of NaN "+nan%"; ``fmt``'s ``signed``/``fine`` an array's truth ValueError; ``metrics`` or
``gates`` whose iteration raises its own error; ``metric_direction(None)`` an AttributeError;
``metric_deltas``, ``diff_summaries``, ``request_hit_diff``, ``count_shifts``,
``resample_counts`` and ``latency_shifts`` of a None, a string or an array each a TypeError,
AttributeError or numpy error inside them; ``check_behaviour`` of a str subclass ran its own
``__eq__``; ``study_defaults(5)`` a TypeError; ``parse_sweep({"retention": 5})`` a TypeError;
and a 5,000-character unknown run id was quoted whole."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from kvtrace.compare import bootstrap, model, render, study
from kvtrace.compare.gates import check_fail_if, parse_gates
from kvtrace.compare.model import RunDiff
from kvtrace.errors import KVTraceError


class Raising:
    """An object every protocol of which raises."""

    def __iter__(self):
        raise RuntimeError("iter")

    def __bool__(self):
        raise RuntimeError("bool")

    def __len__(self):
        raise RuntimeError("len")

    def __repr__(self):
        raise RuntimeError("repr")


class EqRaises(str):
    def __eq__(self, other):
        raise RuntimeError("eq")

    __hash__ = str.__hash__


HOSTILE = [None, "x", b"x", [1], {"a": 1}, np.array([1.0, 2.0]), Raising(), math.nan, 10**5000, object()]
FRAME = pl.DataFrame({"request_id": ["a", "b"], "cached_tokens": [1, 2], "prompt_tokens": [3, 4]})
COUNTS = pl.DataFrame({"reason": ["x"], "count": [1]})
LATENCY = {"ttft_ms": pl.DataFrame({"request_id": [str(i) for i in range(20)], "ttft_ms": [1.0] * 20})}


def one_line(call, name: str) -> None:
    with pytest.raises(KVTraceError) as caught:
        call()
    text = str(caught.value)
    assert "\n" not in text and len(text) < 1_000 and name in text, text


def diff() -> RunDiff:
    return model.diff_summaries({"requests": 5, "prefix_cache_hit_rate": 0.5},
                                {"requests": 5, "prefix_cache_hit_rate": 0.25})


@pytest.mark.parametrize("rel", ["x", [1], np.array([1.0, 2.0]), Raising(), object()],
                         ids=lambda v: type(v).__name__)
def test_fmt_rel_of_no_number_is_one_line(rel):
    one_line(lambda: render.fmt_rel(rel), "rel")


def test_fmt_rel_of_nan_is_a_dash_and_of_a_huge_int_its_digits():
    assert render.fmt_rel(math.nan) == render.fmt_rel(np.float64("nan")) == render.fmt_rel(None) == "–"
    assert render.fmt_rel(10**5000) == "+1.00e+5002%"
    assert render.fmt_rel(np.int64(2)) == render.fmt_rel(2) == "+200.0%"


@pytest.mark.parametrize("flag", [np.array([True, False]), Raising(), "no", 1])
def test_fmts_flags_that_are_no_bool_are_one_line(flag):
    one_line(lambda: render.fmt(1.0, signed=flag), "signed")
    one_line(lambda: render.fmt(1.0, fine=flag), "fine")
    one_line(lambda: render.shows_no_change(1.0, fine=flag), "fine")
    one_line(lambda: render.fmt_rel(0.5, 0.1, fine=flag), "fine")


def test_metrics_and_gates_whose_iteration_raises_are_one_line():
    one_line(lambda: render.tables(diff(), metrics=Raising()), "metrics")
    one_line(lambda: parse_gates(Raising()), "--fail-if")
    one_line(lambda: check_fail_if(diff(), Raising()), "--fail-if")


@pytest.mark.parametrize("name", [None, 5, True, [1], np.array(["a"])], ids=lambda v: type(v).__name__)
def test_metric_direction_of_no_name_is_one_line(name):
    one_line(lambda: model.metric_direction(name), "name")


def test_metric_direction_of_a_str_subclass_reads_its_string():
    assert model.metric_direction(EqRaises("median_ttft_ms")) == -1


@pytest.mark.parametrize("value", HOSTILE, ids=lambda v: type(v).__name__)
def test_the_builders_refuse_what_is_no_value_of_their_kind(value):
    if not isinstance(value, dict):  # (a dict is a summary, a run record)
        one_line(lambda: model.metric_deltas(value, {}), "summary_a")
        one_line(lambda: model.metric_deltas({}, value), "summary_b")
        one_line(lambda: model.diff_summaries(value, {}), "summary_a")
    if value is not None and not isinstance(value, dict):
        one_line(lambda: model.diff_summaries({}, {}, run_a=value), "run_a")
    one_line(lambda: model.diff_summaries({}, {}, ci_verdicts=value), "ci_verdicts")
    one_line(lambda: model.request_hit_diff(value, FRAME), "per_request_a")
    one_line(lambda: model.request_hit_diff(FRAME, value), "per_request_b")
    one_line(lambda: model.request_hit_diff(FRAME, FRAME, top=value), "top")
    one_line(lambda: model.count_shifts(value, COUNTS, "reason"), "counts_a")
    # (a name that is no column: the frame's columns said)
    one_line(lambda: model.count_shifts(COUNTS, COUNTS, value), "counts_a" if isinstance(value, str) else "key")
    rng = np.random.default_rng(0)
    one_line(lambda: bootstrap.resample_counts(value, 5, 10), "rng")
    one_line(lambda: bootstrap.resample_counts(rng, value, 10), "n_requests")
    one_line(lambda: bootstrap.resample_counts(rng, 5, value), "resamples")
    one_line(lambda: bootstrap.latency_shifts(value, LATENCY), "latency_a")
    one_line(lambda: bootstrap.latency_shifts(LATENCY, LATENCY, seed=value), "seed")
    one_line(lambda: bootstrap.latency_shifts(LATENCY, LATENCY, per_unit=value), "per_unit")
    one_line(lambda: bootstrap.latency_shifts(LATENCY, LATENCY, pair=value), "pair")


def test_a_summary_keyed_by_no_name_and_frames_of_text_counts_are_one_line():
    one_line(lambda: model.metric_deltas({1: 2, "a": 3}, {}), "summary_a")
    text = pl.DataFrame({"request_id": ["a"], "cached_tokens": ["many"]})
    one_line(lambda: model.request_hit_diff(text, FRAME), "per_request_a")
    one_line(lambda: model.count_shifts(COUNTS, pl.DataFrame({"reason": ["x"], "count": ["y"]}), "reason"),
             "counts_a/counts_b")
    one_line(lambda: model.count_shifts(COUNTS, COUNTS, "a" * 5000), "counts_a")


def test_the_builders_still_take_numpy_numbers():
    assert model.request_hit_diff(FRAME, FRAME, top=np.int64(3)).requests == 2
    counts = bootstrap.resample_counts(np.random.default_rng(0), np.int64(4), np.int32(3))
    assert counts.shape == (3, 4)
    shifts, info = bootstrap.latency_shifts(LATENCY, LATENCY, seed=np.uint64(1), resamples=100, per_unit=np.float64(1))
    assert info["seed"] == 1 and shifts


@pytest.mark.parametrize("behaviour", [EqRaises("shared-prefix-pinning"), 5, None, [1]],
                         ids=lambda v: type(v).__name__)
def test_study_behaviours_that_are_no_name_are_one_line_and_a_subclass_reads_its_string(behaviour):
    if isinstance(behaviour, str):
        assert type(study.check_behaviour(behaviour)) is str
        assert study.study_trace(behaviour) == "gen:study-shared-prefix-pinning"
        assert study.study_defaults(behaviour)
        return
    one_line(lambda: study.study_defaults(behaviour), "behaviour")


@pytest.mark.parametrize("sweep", [{"retention": 5}, {5: [1]}, {"retention": [object()]}, {"retention": [10**5000]}],
                         ids=lambda v: type(v).__name__)
def test_a_sweep_mapping_of_no_list_of_values_is_one_line(sweep):
    one_line(lambda: study.parse_sweep(sweep), "--sweep")


def test_a_sweep_mapping_takes_numpy_values_and_str_subclasses():
    assert study.parse_sweep({EqRaises("capacity_blocks"): [np.int64(64), 128]}) == ("capacity_blocks", [64, 128])


def test_an_unknown_run_id_of_thousands_of_characters_is_quoted_cut(tmp_path):
    from kvtrace.store import UnknownRunError

    err = UnknownRunError(str(tmp_path / "s.duckdb"), "r" * 5000)
    assert len(str(err)) < 400 and "characters left out" in str(err)


@pytest.mark.parametrize("value", [None, {"run_a": {}}, "x", Raising()], ids=lambda v: type(v).__name__)
def test_the_notes_a_notebook_prints_refuse_what_is_no_diff(value):
    one_line(lambda: render.times_note(value), "diff")
    one_line(lambda: render.backend_note(value), "diff")
    one_line(lambda: render.requests_line(value), "r")


def test_the_notes_refuse_a_code_that_is_no_function():
    one_line(lambda: render.times_note(diff(), code="x"), "code")
    one_line(lambda: render.backend_note(diff(), code=None), "code")
    assert render.times_note(diff(), code=str).startswith("Times:")


class HostileFloat(float):
    def __format__(self, spec):
        raise RuntimeError("format")

    def __abs__(self):
        raise RuntimeError("abs")


class HostileInt(int):
    def __format__(self, spec):
        raise RuntimeError("format")

    def __int__(self):
        raise RuntimeError("int")

    def __abs__(self):
        raise RuntimeError("abs")


def test_fmt_and_fmt_rel_read_a_number_subclass_past_its_own_methods():
    assert render.fmt(HostileFloat(1.5)) == "1.500" and render.fmt(HostileInt(3)) == "3"
    assert render.fmt_rel(HostileFloat(0.5)) == "+50.0%" and render.fmt_rel(HostileInt(3)) == "+300.0%"
    assert render.fmt(np.float32(1.5)) == "1.500" and render.fmt(np.float32("nan")) == "–"
