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
