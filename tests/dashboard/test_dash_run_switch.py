"""Picking another run in the sidebar: the filters that named something of the last run
(B, a request, a time window) are dropped, not reported as a link's values that the new
run lacks."""

from __future__ import annotations

from apptest import render

from kvtrace.store import read
from tests.support.markdown import shown


def _run_picker(at):
    return next(s for s in at.selectbox if s.label == "Run")


def test_picking_as_a_the_run_that_was_b_compares_it_with_its_own_partner(dashboard_db, monkeypatch):
    first, second = read.runs(dashboard_db)["run_id"].to_list()[:2]  # (one trace, one behaviour apart)
    at = render(dashboard_db, monkeypatch, "compare", run=first, b=second)
    assert at.query_params["b"] in (second, [second])
    _run_picker(at).set_value(second).run()
    warnings = [shown(w.value) for w in at.warning]
    assert not any("from the link" in w for w in warnings), warnings  # it said B (second) was A itself
    (b_picker,) = [s for s in at.selectbox if s.label == "B"]
    assert b_picker.value == first  # the new A's partner, as a fresh link to it would show


def test_picking_another_run_drops_the_last_runs_time_window_and_request(dashboard_db, monkeypatch):
    first, second = read.runs(dashboard_db)["run_id"].to_list()[:2]  # (one trace, one behaviour apart)
    at = render(dashboard_db, monkeypatch, "latency", run=first, t0="0.001", t1="0.002", log="1")
    assert at.slider[0].value == (0.001, 0.002)
    _run_picker(at).set_value(second).run()
    assert at.slider[0].value[0] == 0 and at.slider[0].value[1] > 0.002  # the whole of the new run
    assert "t0" not in at.query_params and "t1" not in at.query_params
    assert at.query_params["log"] in ("1", ["1"])  # a preference, not a run's: kept
    assert not at.warning, [w.value for w in at.warning]
