"""A collected run's times are its sender's: the Latency page's charts say so on their axes,
as its tiles and captions do (metrics.times_word), never 'modelled'."""

from __future__ import annotations

import json

from apptest import render

from kvtrace.metrics import times_word


def _axis_titles(at) -> list[str]:
    titles = []
    for el in at.get("plotly_chart"):
        layout = json.loads(el.proto.spec)["layout"]
        titles += [v["title"]["text"] for k, v in layout.items()
                   if k.startswith(("xaxis", "yaxis")) and isinstance(v, dict) and v.get("title", {}).get("text")]
    return titles


def test_a_collected_runs_latency_charts_label_their_times_recorded(tmp_path, monkeypatch):
    import synthetic_run

    db = str(tmp_path / "collected.duckdb")
    run = synthetic_run.write_collected_run(db)
    word = times_word(("otlp", None))
    assert word == "recorded"
    at = render(db, monkeypatch, "latency", run=run)
    ms_axes = [t for t in _axis_titles(at) if t.startswith("ms (")]
    assert len(ms_axes) >= 5, ms_axes  # two CDFs, two histograms, ITL over time
    assert set(ms_axes) == {f"ms ({word})"}, ms_axes


def _x_titles(at) -> set[str]:
    return {json.loads(el.proto.spec)["layout"].get("xaxis", {}).get("title", {}).get("text")
            for el in at.get("plotly_chart")} - {None}


def test_time_axes_say_what_a_runs_times_are(tmp_path, monkeypatch):
    """Every time axis said "virtual time (s)": a cache-only run's (no clock: its spans are 1 ms
    a request apart, as the README says it has none) and a collected run's (its sender's
    times) too. An engine replay keeps its modelled clock's title."""
    import synthetic_run

    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path / "runs.duckdb")
    engine = run_replay(RunSpec("gen:chat", limit=12, capacity_blocks=40, content=False), db=db).run_id
    cache_only = run_replay(RunSpec("gen:chat", limit=12, mode="cache-only", capacity_blocks=8), db=db).run_id
    collected = synthetic_run.write_collected_run(str(tmp_path / "collected.duckdb"))
    seen = {}
    for name, store, run in (("engine", db, engine), ("cache-only", db, cache_only),
                             ("collected", str(tmp_path / "collected.duckdb"), collected)):
        titles = set()
        for page in ("hit_rate", "evictions"):
            titles |= _x_titles(render(store, monkeypatch, page, run=run))
        seen[name] = titles - {"scheduler steps"}  # (the block histograms' axis)
    assert seen["engine"] == {"virtual time (s)"}, seen
    assert seen["cache-only"] == {"request order (no clock: 1 ms a request)"}, seen
    assert seen["collected"] and "virtual time (s)" not in seen["collected"], seen


def test_compares_time_axis_is_both_runs_or_says_they_differ(tmp_path, monkeypatch):
    """Compare plotted a cache-only A and an engine B on one axis titled by A's clock (request
    order), and its caption said "the same virtual time axis" whatever the runs."""
    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path / "runs.duckdb")
    engine = [run_replay(RunSpec("gen:chat", limit=12, capacity_blocks=c, content=False), db=db).run_id
              for c in (40, 60)]
    cache_only = run_replay(RunSpec("gen:chat", limit=12, mode="cache-only", capacity_blocks=8), db=db).run_id
    same = render(db, monkeypatch, "compare", run=engine[0], b=engine[1])
    assert _x_titles(same) >= {"virtual time (s)"} and "request order" not in str(_x_titles(same))
    mixed = render(db, monkeypatch, "compare", run=cache_only, b=engine[0])
    titles = _x_titles(mixed)
    assert "time (s): each run's own (see its pages)" in titles and not any("request order" in t for t in titles)
    assert any("not of one kind" in c.value for c in mixed.caption), [c.value for c in mixed.caption]
