"""The read API's argument checks hold for hostile values too (re-probe 31): an int past 64
bits reached DuckDB ('Python integer too large for 128-bit integer type'), a numpy integer
as a time was DuckDB's NotImplementedException, an int past a float's range among the
percentiles an OverflowError, percentiles whose __iter__ raises that exception, and a value
whose repr raises (a run id of a str subclass, valid) raised it before the query."""

from __future__ import annotations

import numpy as np
import pytest

import kvtrace.store.read as read
from kvtrace.errors import KVTraceError
from kvtrace.store.read._api import BadArgument


class _NoRepr(str):
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


class _NoIter:
    def __iter__(self):
        raise RuntimeError("no iter")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path_factory.mktemp("read") / "s.duckdb")
    run_replay(RunSpec("gen:chat", limit=20, mode="cache-only"), db=db, export=False)
    return db


@pytest.mark.parametrize(("call", "parameter"), [
    (lambda db: read.hit_counters(db, "r1", 10**30, None), "start_ns"),
    (lambda db: read.hit_counters_over_time(db, "r1", window_ns=2**64), "window_ns"),
    (lambda db: read.stale_hash_chain(db, "r1", "00", -(2**70)), "group_id"),
    (lambda db: read.latency_percentiles(db, "r1", "ttft", [10**400]), "qs"),
    (lambda db: read.latency_stats(db, "r1", "ttft", _NoIter()), "percentiles"),
    (lambda db: read.hit_counters(db, "r1", 10**5000, None), "start_ns"),
    (lambda db: read.per_prefix_reuse(db, "r1", 10**5000), "top"),
], ids=["2^100-start", "2^64-window", "-2^70-group", "1e400-percentile", "raising-iter", "huge-start", "huge-top"])
def test_a_hostile_number_or_list_is_one_line_naming_the_parameter(store, call, parameter):
    with pytest.raises(BadArgument, match=rf"^\w+: {parameter}: expected") as err:
        call(store)
    assert "\n" not in str(err.value)


def test_a_numpy_integer_as_a_time_is_read_as_the_int_it_is(store):
    whole = read.hit_counters(store, "r1", None, None)
    assert read.hit_counters(store, "r1", np.int64(0), np.int64(2**62)) == whole


def test_a_str_subclass_whose_repr_raises_is_a_run_id_like_any_string(store):
    assert read.span_counts(store, _NoRepr("r1")).height > 0
    with pytest.raises(KVTraceError, match=r"metric: expected one of .*, got .nope.$"):
        read.latency_stats(store, "r1", _NoRepr("nope"))


@pytest.mark.parametrize("window", [0, -1])
def test_a_window_of_no_length_names_the_function_asked(store, window):
    """(probe 35: every *_over_time said 'read: window_ns: must be positive')"""
    for call, name in ((read.hit_counters_over_time, "hit_counters_over_time"),
                       (read.usage_over_time, "usage_over_time")):
        with pytest.raises(BadArgument, match=rf"^{name}: window_ns: expected 1 to "):
            call(store, "r1", window_ns=window)


def test_a_stored_summary_that_is_no_mapping_is_refused(store):
    """(probe 35: stored='x' gave the spans' summary, as for a run that kept none)"""
    with pytest.raises(BadArgument, match=r"^summary_with_spans: stored: expected the run's stored summary"):
        read.summary_with_spans(store, "r1", "x")
    assert read.summary_with_spans(store, "r1", None)["requests"] == 20
