"""run_replay's refusals quote an API caller's value without str() (re-probe 31): a setting
whose repr raises (a block size, a capacity, a format) raised that exception where its
ConfigError line was to be, as did a percentile past 4,300 digits among the percentiles, and
a trace path-like whose __fspath__ raises was that traceback from RunSpec itself."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvtrace.errors import ConfigError
from kvtrace.replay.run import RunSpec, run_replay


class _NoRepr:
    def __repr__(self):
        raise RuntimeError("no repr")

    __str__ = __repr__


class _NoPath(os.PathLike):
    def __fspath__(self):
        raise RuntimeError("no path")


@pytest.mark.parametrize(("setting", "flag"), [
    ({"block_size": _NoRepr()}, "--block-size"), ({"capacity_tokens": _NoRepr()}, "--capacity-tokens"),
    ({"external_capacity_blocks": _NoRepr()}, "--external-blocks"), ({"seed": _NoRepr()}, "--seed"),
    ({"trace_block_size": _NoRepr()}, "--trace-block-size"),
    ({"percentiles": (50, 10**5000, "x")}, "--percentiles"), ({"percentiles": (50, _NoRepr())}, "--percentiles"),
], ids=["block_size", "capacity_tokens", "external", "seed", "trace_block_size", "huge-percentile",
        "norepr-percentile"])
def test_a_setting_with_no_str_is_refused_in_one_line_at_its_flag(setting, flag):
    with pytest.raises(ConfigError, match=rf"^{flag}: ") as err:
        run_replay(RunSpec("gen:chat", limit=2, mode="cache-only", **setting), export=False)
    assert "\n" not in str(err.value)


def test_a_trace_whose_path_cannot_be_read_is_refused_at_trace():
    with pytest.raises(ConfigError, match=r"^TRACE: <_NoPath whose repr raised>|^TRACE: <.*_NoPath object"):
        RunSpec(_NoPath())


@pytest.mark.parametrize(("setting", "flag"), [
    ({"limit": np.int64(3)}, "--limit"), ({"capacity_blocks": np.int64(100)}, "--capacity-blocks"),
], ids=["limit", "capacity_blocks"])
def test_a_numpy_count_is_told_to_be_a_python_int_as_the_other_counts_are(setting, flag):
    # (it read "100: expected a number of blocks", "expected a number of requests >= 1")
    with pytest.raises(ConfigError, match=rf"^{flag}: \d+: expected a Python int, not numpy\.int64 \(int\(\) it\)$"):
        run_replay(RunSpec("gen:chat", mode="cache-only", **{"limit": 2, **setting}), export=False)


def test_a_run_given_two_destinations_for_its_spans_is_refused_before_it_is_recorded(tmp_path):
    # (the store won and the other was dropped unsaid: db's file never made, spans_to never called)
    from kvtrace.replay.sweep import _CollectedSpans
    from kvtrace.store import Store

    spec = RunSpec("gen:chat", limit=2, mode="cache-only")
    other = tmp_path / "other.duckdb"
    with Store.open(str(tmp_path / "s.duckdb")) as store:
        with pytest.raises(ConfigError, match=r"^store: .*given with db="):
            run_replay(spec, db=str(other), store=store, export=False)
        with pytest.raises(ConfigError, match=r"^spans_to: .*not both$"):
            run_replay(spec, store=store, spans_to=_CollectedSpans(), export=False)
        assert not store.has_run("r1")
    with pytest.raises(ConfigError, match=r"^spans_to: .*not both$"):
        run_replay(spec, db=str(other), spans_to=_CollectedSpans(), export=False)
    assert not other.exists()
