"""The Capacity page under AppTest, on a real store holding a curve and runs of its trace."""

from __future__ import annotations

import json

import pytest
from apptest import app_test
from streamlit.testing.v1 import AppTest

from kvtrace.dashboard import DB_ENV
from kvtrace.replay.curve import run_curve
from kvtrace.replay.run import RunSpec, run_replay
from tests.conftest import MOONCAKE

LIMIT = 300


@pytest.fixture(scope="module")
def capacity_db(tmp_path_factory):
    db = tmp_path_factory.mktemp("capacity") / "capacity.duckdb"
    spec = RunSpec(str(MOONCAKE), mode="cache-only", limit=LIMIT)
    run_curve(spec, "100,200,400,inf", db=db)
    cache_only = run_replay(RunSpec(str(MOONCAKE), mode="cache-only", capacity_blocks=200, limit=LIMIT), db=db)
    engine = run_replay(RunSpec(str(MOONCAKE), limit=LIMIT, preset="dense-attention"), db=db)
    other = run_replay(RunSpec("gen:chat", mode="cache-only", capacity_blocks=50, limit=20), db=db)
    return str(db), cache_only, engine, other


def render(db: str, monkeypatch, **params: str) -> AppTest:
    monkeypatch.setenv(DB_ENV, db)
    at = app_test(60)
    for k, v in params.items():
        at.query_params[k] = v
    at.run()
    at.switch_page("views/capacity.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    return at


def traces(at: AppTest) -> dict[str, dict]:
    return {t["name"]: t for el in at.get("plotly_chart") for t in json.loads(el.proto.spec)["data"]}


def test_the_curve_and_the_runs_of_its_trace(capacity_db, monkeypatch):
    db, cache_only, engine, _ = capacity_db
    shown = traces(render(db, monkeypatch, run=cache_only.run_id))
    lru, belady = shown["LRU"], shown["Belady bound (MIN)"]
    assert lru["x"] == [100, 200, 400] and belady["x"] == [100, 200, 400]
    assert all(b >= a for a, b in zip(lru["y"], belady["y"]))
    # the cache-only run at 200 blocks sits exactly on the curve's (one-pass) point at 200
    mark = shown[f"{cache_only.run_id} (cache-only/lru)"]
    assert mark["x"] == [200] and mark["y"] == [cache_only.summary["prefix_cache_hit_rate"]] == [lru["y"][1]]
    assert mark["marker"]["symbol"] == "diamond"  # the selected run
    assert "unbounded cache" in shown
    # the engine run is marked at its own full-attention capacity, in the curve's 512-token blocks
    engine_mark = shown[f"{engine.run_id} (engine)"]
    assert engine_mark["marker"]["symbol"] == "circle"
    assert engine_mark["y"] == [engine.summary["prefix_cache_hit_rate"]] and engine_mark["x"][0] > 0


def test_a_run_of_another_trace_is_told_so(capacity_db, monkeypatch):
    db, *_, other = capacity_db
    at = render(db, monkeypatch, run=other.run_id)
    assert any("No curve of this run's trace" in i.value for i in at.info)
    assert traces(at)  # another trace's curve is still shown, labelled as such


def test_a_store_without_curves_names_the_command(replayed_store, monkeypatch):
    at = render(replayed_store.path, monkeypatch)
    assert any("kvtrace curve TRACE --db PATH" in i.value for i in at.info)
    assert not at.get("plotly_chart")


def test_a_linked_curve_that_is_not_in_the_store_is_named_not_silently_replaced(capacity_db, monkeypatch):
    db, cache_only, *_ = capacity_db
    at = render(db, monkeypatch, run=cache_only.run_id, curve="curve-gone")
    assert [w.value for w in at.warning] == [
        "Curve `curve-gone` from the link is not in this store: the newest of this run's trace is shown instead."]
    assert traces(at)["LRU"]["x"] == [100, 200, 400]  # the run's own curve, in its place


def test_a_run_without_a_trace_digest_is_told_it_has_no_curve(capacity_db, tmp_path, monkeypatch):
    """A collected run stores no trace digest: its page says so, without a polars warning
    about comparing with None in the server's log."""
    import shutil
    import warnings

    from kvtrace.store.writer import Store

    db = str(tmp_path / "collected.duckdb")
    shutil.copy(capacity_db[0], db)
    with Store.open(db) as store:
        run = store.create_run("collected", mode="otlp")
        store.finish_run(run)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        at = render(db, monkeypatch, run=run)
    assert any("No curve of this run's trace" in i.value for i in at.info)


def test_a_store_of_curves_alone_shows_them_on_the_capacity_page(tmp_path, monkeypatch):
    """`kvtrace curve --db` in cache-only mode records points and no run: every page said
    'This store has no runs yet', the Capacity page included, so the curve was never shown."""
    from kvtrace.store import read

    db = str(tmp_path / "curves.duckdb")
    run_curve(RunSpec(str(MOONCAKE), mode="cache-only", limit=40), "50,inf", db=db)
    assert read.runs(db).height == 0 and read.curves(db).height > 0
    from apptest import render as render_page

    at = render_page(db, monkeypatch)  # the Overview
    assert not at.error and not any("no runs yet" in i.value for i in at.info)
    links = [link.proto for link in at.get("page_link")]
    assert any(p.page == "capacity" and "capacity curves and no runs" in p.label for p in links), links
    at = render(db, monkeypatch)  # the Capacity page: no error, the curve drawn
    assert [t.value for t in at.title] == ["Capacity"] and at.get("plotly_chart")
    assert not any("this run's trace" in i.value for i in at.info)


def test_the_curves_table_shows_a_tiny_hit_rate_in_its_digits(tmp_path, monkeypatch):
    """16 hit tokens in 409,600 read 0.0 in the table's rate column beside `kvtrace curve`'s
    0.0039% (re-probe H): the table shows a rate as every table does (metrics.percent_text)."""
    from tests.support.traces import tiny_hit_trace

    trace = tiny_hit_trace(tmp_path / "t.jsonl")
    db = str(tmp_path / "c.duckdb")
    run_curve(RunSpec(str(trace), mode="cache-only"), "100,inf", db=db)
    run = run_replay(RunSpec(str(trace), mode="cache-only"), db=db)
    table = render(db, monkeypatch, run=run.run_id).dataframe[0].value
    unbounded = table.to_dict("records")[-1] if hasattr(table, "to_dict") else None
    assert unbounded is not None and unbounded["prefix cache hit rate"] == "0.0039%", table
