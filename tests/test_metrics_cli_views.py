"""One number, one meaning through the commands a user types: ``replay --json``, ``runs
--json``, ``diff --json`` and ``export`` give the same hit counters and latency statistics as
numpy computes, vllm bench serve's way, from the exported spans alone, for engine runs
replayed with other percentiles than the default (25,75,99.9), with preemptions and an
external tier, and for a cache-only run (no clock: null latencies in every view). Also each
request span's own ITL statistics (mean, p50, p99, max) against numpy."""

from __future__ import annotations

import json

import duckdb
import numpy as np
import polars as pl
import pytest

from kvtrace import metrics
from tests.cli.support import run

PCTS = "25,75,99.9"
ENGINE = ("gen:mixed", "--limit", "50", "--capacity-blocks", "40", "--external-blocks", "400", "--percentiles", PCTS)


@pytest.fixture
def cli(capsys):
    return lambda *argv: run(list(argv), capsys)


@pytest.fixture
def store(tmp_path, cli):
    db = str(tmp_path / "views.duckdb")
    summaries = {}
    for name, args in (("A", ENGINE), ("B", (*ENGINE, "--without", "shared-prefix-pinning")),
                       ("C", ("gen:mixed", "--limit", "80", "--mode", "cache-only", "--capacity-blocks", "100"))):
        code, out, err = cli("replay", *args, "--db", db, "--json", "--name", name)
        assert code == 0, err
        summaries[name] = json.loads(out)
    assert summaries["A"]["preemptions"] > 0 and summaries["A"]["external_prefix_cache_hits"] > 0
    return tmp_path, db, summaries


def from_export(tmp, db: str, run_id: str, cli) -> tuple[dict, dict]:
    """(the exported run record's summary, the metrics numpy computes from the exported spans)."""
    folder = tmp / f"export-{run_id}"
    code, _, err = cli("export", "--db", db, "--run", run_id, "--parquet", str(folder))
    assert code == 0, err
    con = duckdb.connect()
    ((stored,),) = con.execute(f"SELECT summary FROM '{folder / 'runs.parquet'}'").fetchall()
    spans = pl.read_parquet(folder / "spans.parquet")
    req = spans.filter(pl.col("name") == "kvtrace.request")
    got: dict = {}
    if req.height:
        q, h = int(req["num_prompt_tokens"].sum()), int(req["num_hit_tokens"].sum())
        eh, eq = int(req["num_external_hit_tokens"].sum()), int(req["num_external_query_tokens"].sum())
        pq, ph = int(req["num_preempted_query_tokens"].sum()), int(req["num_preempted_hit_tokens"].sum())
        samples: dict[str, list[float]] = {"ttft": [], "tpot": [], "itl": [], "e2el": [], "queue": []}
        for r in req.iter_rows(named=True):
            itl = r["itl_ns"] or []
            ttft, e2el = r["first_token_ns"] - r["arrival_ns"], r["end_ns"] - r["arrival_ns"]
            assert e2el == ttft + sum(itl) and len(itl) == r["num_output_tokens"] - 1
            samples["ttft"].append(ttft)
            samples["e2el"].append(e2el)
            samples["queue"].append(r["first_scheduled_ns"] - r["arrival_ns"])
            samples["itl"] += itl
            if r["num_output_tokens"] > 1:
                samples["tpot"].append((e2el - ttft) / (r["num_output_tokens"] - 1))
            if itl:  # the span's own ITL statistics
                assert r["itl_mean_ns"] == pytest.approx(np.mean(itl), rel=1e-12)
                assert r["itl_p50_ns"] == pytest.approx(np.percentile(itl, 50), rel=1e-12)
                assert r["itl_p99_ns"] == pytest.approx(np.percentile(itl, 99), rel=1e-12)
                assert r["itl_max_ns"] == max(itl)
        for m, xs in samples.items():
            assert xs, m
            a = np.asarray(xs, dtype=np.float64) / 1e6
            got |= {f"mean_{m}_ms": np.mean(a), f"median_{m}_ms": np.median(a), f"std_{m}_ms": np.std(a)}
            got |= {f"p{metrics.percentile_word(float(p))}_{m}_ms": np.percentile(a, float(p)) for p in PCTS.split(",")}
    else:  # cache-only: one lookup per request, no clock
        lk = spans.filter(pl.col("name") == "kvtrace.cache.lookup")
        q, h, eh, eq, pq, ph = int(lk["num_query_tokens"].sum()), int(lk["num_hit_tokens"].sum()), 0, 0, 0, 0
    got |= {"prefix_cache_queries": q, "prefix_cache_hits": h, "external_prefix_cache_hits": eh,
            "external_prefix_cache_queries": eq, "preempted_prefix_cache_queries": pq,
            "preempted_prefix_cache_hits": ph, "prompt_tokens_by_source.local_compute": q - h - eh,
            "prefix_cache_hit_rate": h / q, "external_prefix_cache_hit_rate": eh / eq if eq else None,
            "preempted_prefix_cache_hit_rate": ph / pq if pq else None}
    return json.loads(stored), got


def same(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and a == pytest.approx(b, rel=1e-9))


def test_every_command_gives_the_exported_spans_figures(store, cli):
    tmp, db, summaries = store
    code, out, _ = cli("runs", "--db", db, "--json")
    assert code == 0
    listed = {r["name"]: r for r in json.loads(out)["runs"]}
    code, out, _ = cli("diff", summaries["A"]["run_id"], summaries["B"]["run_id"], "--db", db, "--json",
                       "--percentiles", PCTS)
    assert code == 0
    diff = json.loads(out)
    for name, summary in summaries.items():
        stored, spans = from_export(tmp, db, summary["run_id"], cli)
        for key, value in spans.items():
            assert same(summary[key], value) and same(stored[key], value), (name, key, summary[key], value)
        for key in ("requests", "prefix_cache_hit_rate", "median_ttft_ms", "median_itl_ms"):
            assert listed[name][key] == summary[key], (name, key)
        if name == "C":
            assert all(v is None for k, v in summary.items() if metrics.is_latency_key(k))
            assert set(metrics.latency_keys("ttft")) == {k for k in summary if k.endswith("_ttft_ms")}
            continue
        assert {k for k in summary if k.endswith("_ttft_ms")} == set(metrics.latency_keys("ttft", (25, 75, 99.9)))
        side = "a" if name == "A" else "b"
        for key, value in spans.items():
            assert same(diff["metrics"][key][side], value), (name, key)
        for key, shift in diff["latency"].items():  # the percentile shifts' own point estimates
            assert shift[side] == pytest.approx(spans[key], rel=1e-9), (name, key)
        assert {f"p{p}_ttft_ms" for p in PCTS.split(",")} <= diff["latency"].keys()
