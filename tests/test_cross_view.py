"""One number, one meaning, everywhere: the same run and window give the same hit counters,
hit rates and latency statistics in every view.

The views: the run summary the replay wrote (JSON), the request spans' own OTel attributes
(summed here with ``kvtrace.metrics``), the store's queries, the dashboard (AppTest),
``kvtrace diff`` and the regression notebook. The run has what can make them part: requests
that waited for blocks (repeated lookups), preemptions (re-lookups counted apart) and an
external tier.
"""

from __future__ import annotations

import json

import duckdb
import pytest

from kvtrace import metrics
from kvtrace.compare.source import diff_runs
from kvtrace.dashboard import ui
from kvtrace.store import read
from tests.dashboard.apptest import render, traces
from tests.notebooks.conftest import kernel_name, run_notebook  # noqa: F401  (the notebook fixtures)

# OTel attribute of each per-request quantity on a request span (kvtrace.metrics.PER_REQUEST)
ATTRIBUTE = {
    metrics.PROMPT: "gen_ai.usage.input_tokens",
    metrics.LOCAL_HIT: "kvtrace.hit_tokens",
    metrics.EXTERNAL_HIT: "kvtrace.external_hit_tokens",
    metrics.EXTERNAL_QUERY: "kvtrace.request.external_query_tokens",
    metrics.PREEMPTED_QUERY: "kvtrace.request.preempted_query_tokens",
    metrics.PREEMPTED_HIT: "kvtrace.request.preempted_hit_tokens",
}
HEADLINE = ("prefix_cache_queries", "prefix_cache_hits", "external_prefix_cache_queries", "external_prefix_cache_hits",
            "preempted_prefix_cache_queries", "preempted_prefix_cache_hits", *metrics.SOURCE_KEYS, *metrics.RATE_KEYS)
LATENCY = ("mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
           "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "p99_e2el_ms")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two engine runs of one trace (pinning on, off) with a small pool and an external tier."""
    from kvtrace.compare.demo import DEMO_SETTINGS
    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path_factory.mktemp("cross") / "cross.duckdb")
    a = run_replay(RunSpec("gen:mixed", limit=70, name="A", without=("shared-prefix-pinning",), **DEMO_SETTINGS),
                   db=db)
    b = run_replay(RunSpec("gen:mixed", limit=70, name="B", **DEMO_SETTINGS), db=db)
    s = b.summary
    # the run exercises what makes the views part
    assert s["preemptions"] > 0 and s["preempted_prefix_cache_queries"] > 0 and s["external_prefix_cache_hits"] > 0
    with duckdb.connect(db, read_only=True) as con:
        lookups, requests = con.sql("SELECT count(*) FILTER (WHERE name = 'kvtrace.cache.lookup'), "
                                    "count(*) FILTER (WHERE name = 'kvtrace.request') FROM spans WHERE run_id = $r",
                                    params={"r": b.run_id}).fetchall()[0]
    assert lookups > requests  # repeated lookups, which count nothing
    return db, a, b


def span_requests(db: str, run_id: str) -> list[dict]:
    """The request spans as OTel sees them: their SpanAttributes (strings) parsed."""
    with duckdb.connect(db, read_only=True) as con:
        rows = con.sql("""SELECT "SpanAttributes" FROM otel_traces
                          WHERE "RunId" = $r AND "SpanName" = 'kvtrace.request'""", params={"r": run_id}).fetchall()
    return [{k: json.loads(v) if v.startswith("[") else int(v) if v.lstrip("-").isdigit() else v
             for k, v in attrs.items()} for (attrs,) in rows]


def from_spans(spans: list[dict], t0: int | None = None, t1: int | None = None) -> dict:
    """vLLM's counters and rates summed from the spans' attributes, over the requests first
    scheduled in [t0, t1)."""
    chosen = [s for s in spans if (t0 is None or s["kvtrace.request.first_scheduled_ns"] >= t0)
              and (t1 is None or s["kvtrace.request.first_scheduled_ns"] < t1)]
    per = [{f: s.get(key, 0) for f, key in ATTRIBUTE.items()} for s in chosen]
    return {**metrics.hit_summary(per), "requests": len(chosen)}


def latency_from_spans(spans: list[dict]) -> dict:
    samples: dict[str, list[float]] = {k: [] for k in metrics.LATENCY_KEYS}
    for s in spans:
        arrival, first = s["kvtrace.request.arrival_ns"], s["kvtrace.request.first_token_ns"]
        itl = s.get("kvtrace.request.itl_ns") or []
        e2el = first + sum(itl) - arrival  # the last token: the first plus every gap
        samples["ttft"].append(s["kvtrace.request.ttft_ns"])
        samples["e2el"].append(e2el)
        samples["itl"] += itl
        samples["queue"].append(s["kvtrace.request.first_scheduled_ns"] - arrival)
        tpot = metrics.tpot_ns(e2el, s["kvtrace.request.ttft_ns"], s["gen_ai.usage.output_tokens"])
        if tpot is not None:
            samples["tpot"].append(tpot)
    return metrics.latency_summary(samples)


def test_the_whole_run_is_one_figure_in_every_view(runs, monkeypatch, run_notebook):  # noqa: F811
    db, a, b = runs
    for res in (a, b):
        summary = read.run(db, res.run_id)["summary"]
        spans = span_requests(db, res.run_id)
        store = read.hit_counters(db, res.run_id)
        diff = diff_runs(db, a.run_id, b.run_id)
        side = "a" if res is a else "b"
        by_diff = {m.name: (m.a if side == "a" else m.b) for m in diff.metrics}
        for key in HEADLINE:
            assert summary[key] == store[key] == from_spans(spans)[key] == by_diff.get(key), key
        assert store["requests"] == summary["requests"] == len(spans)
        # latency: vllm bench serve's statistics, one percentile definition
        lat_store = read.latency_summary(db, res.run_id)
        lat_spans = latency_from_spans(spans)
        for key in LATENCY:
            assert summary[key] == pytest.approx(lat_store[key], rel=1e-12) == pytest.approx(lat_spans[key],
                                                                                             rel=1e-12), key
            assert by_diff[key] == summary[key], key
        for shift in diff.latency:  # the bootstrap's point estimates
            assert (shift.a if side == "a" else shift.b) == pytest.approx(lat_store[shift.name], rel=1e-12)
        # the dashboard's tiles and charts
        m = {x.label: x.value for x in render(db, monkeypatch, run=res.run_id).metric}
        assert m["Prefix cache hit rate"] == ui.pct(store["prefix_cache_hit_rate"])
        assert m["External prefix cache hit rate"] == ui.pct(store["external_prefix_cache_hit_rate"])
        assert m["Prefix cache queries"] == ui.count(store["prefix_cache_queries"])
        # (labelled when it counts: diff's computed_prompt_tokens adds the recompute after preemption)
        computed = m["Prompt tokens computed at first schedule"]
        assert computed == ui.count(store["prompt_tokens_by_source.local_compute"])
        assert m["TTFT p99 (modelled)"] == ui.ms(summary["p99_ttft_ms"])
        at = render(db, monkeypatch, "hit_rate", run=res.run_id)
        cum = next(t for t in traces(at) if t["name"] == "prefix cache hit rate (cumulative)")
        assert cum["y"][-1] == summary["prefix_cache_hit_rate"]
    # Compare's tiles are kvtrace diff's
    at = render(db, monkeypatch, "compare", run=a.run_id, b=b.run_id)
    tiles = {x.label: x for x in at.metric}
    assert tiles["Prefix cache hit rate (B)"].value == ui.pct(b.summary["prefix_cache_hit_rate"])
    assert tiles["Prefix cache hit rate (B)"].proto.delta == ui.pp(
        b.summary["prefix_cache_hit_rate"] - a.summary["prefix_cache_hit_rate"])
    # the notebook
    out, _ = run_notebook("regression_analysis", db_path=db, run_a=a.run_id, run_b=b.run_id)
    assert out["prefix_cache_hit_rate_a"] == a.summary["prefix_cache_hit_rate"]
    assert out["prefix_cache_hit_rate_b"] == b.summary["prefix_cache_hit_rate"]
    assert out["cum_hit_rate_end"]["b"] == b.summary["prefix_cache_hit_rate"]
    for key in HEADLINE:
        assert out["metrics"][key]["b"] == b.summary[key], key
    for key in LATENCY:
        assert out["metrics"][key]["a"] == a.summary[key], key


def test_a_time_window_is_one_figure_in_every_view(runs, monkeypatch):
    db, _, b = runs
    window_ns = read.nice_window(int(b.summary["virtual_duration_s"] * 1e9), 20)
    frame = read.hit_counters_over_time(db, b.run_id, window_ns=window_ns)
    assert frame.height >= 3
    row = frame.row(frame.height // 2, named=True)  # a window in the middle of the run
    t0 = row["window_start_ns"]
    t1 = t0 + window_ns
    store = read.hit_counters(db, b.run_id, start_ns=t0, end_ns=t1)
    spans = from_spans(span_requests(db, b.run_id), t0, t1)
    for key in ("requests", *HEADLINE):
        assert row[key] == store[key] == spans[key], key
    # the dashboard's per-window point of the same window (its own window length, so ask the
    # store for that one)
    from kvtrace.dashboard import queries

    dw = read.nice_window(int(b.summary["virtual_duration_s"] * 1e9), queries.windows_for(b.summary["requests"]))
    at = render(db, monkeypatch, "hit_rate", run=b.run_id)
    per = next(t for t in traces(at) if t["name"] == "prefix cache hit rate (per window)")
    x, y = per["x"][len(per["x"]) // 2], per["y"][len(per["y"]) // 2]
    start = round(x * 1e9)
    assert y == read.hit_counters(db, b.run_id, start_ns=start, end_ns=start + dw)["prefix_cache_hit_rate"]
    assert y == from_spans(span_requests(db, b.run_id), start, start + dw)["prefix_cache_hit_rate"]
