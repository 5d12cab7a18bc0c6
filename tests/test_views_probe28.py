"""Probe 28 (views): the numbers a user reads of a run stopped early, against the same run's
finished summary and an independent count over its raw OTel spans."""

from __future__ import annotations

import json
import math

import duckdb
import pytest

from kvtrace.store import read
from tests.notebooks.conftest import kernel_name, run_notebook  # noqa: F401  (the notebook fixtures)

# What a stopped run cannot know: its end-of-run audit never ran (stale_hashes,
# table_disagreements), and its clock ran on past the requests that finished (duration and
# throughput); the rest is its record's, not its spans'.
UNKNOWN_WHEN_STOPPED = {"stale_hashes", "table_disagreements", "virtual_duration_s", "output_tok_per_s",
                        "backend", "cost_model", "digest", "mode", "preset", "trace"}


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """(store, run id, its finished summary): a kimi-hybrid engine run with an external tier
    (hits in blocks of 512 tokens, local and external), then its record made a stopped run's
    (no summary, ``incomplete``) with every span kept, as a replay killed after its last flush."""
    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path_factory.mktemp("views28") / "stopped.duckdb")
    res = run_replay(RunSpec("gen:mixed", limit=40, name="stopped", capacity_blocks=40,
                             external_capacity_blocks=400), db=db)
    finished = res.summary
    assert finished["external_prefix_cache_hits"] > 0 and finished["hit_blocks"] > 0
    with duckdb.connect(db) as con:
        con.execute("UPDATE runs SET summary = NULL, status = 'incomplete' WHERE run_id = ?", [res.run_id])
    return db, res.run_id, finished


def _blocks_from_otel(db: str, run_id: str, block_size: int) -> tuple[int, int, int]:
    """(hit blocks, prompt blocks, computed prompt tokens) counted from the request spans' OTel
    attributes: a request's cached tokens (local + external) in whole blocks, its prompt's blocks."""
    with duckdb.connect(db, read_only=True) as con:
        rows = con.execute("""SELECT "SpanAttributes" FROM otel_traces
                              WHERE "RunId" = ? AND "SpanName" = 'kvtrace.request'""", [run_id]).fetchall()
    hit = total = computed = 0
    for (attrs,) in rows:
        cached = int(attrs["kvtrace.hit_tokens"]) + int(attrs["kvtrace.external_hit_tokens"])
        hit += cached // block_size
        total += math.ceil(int(attrs["gen_ai.usage.input_tokens"]) / block_size)
        computed += int(attrs["kvtrace.request.computed_prompt_tokens"])
    return hit, total, computed


def test_a_stopped_runs_summary_from_spans_is_its_finished_summary(stopped):
    """Every key of the finished summary reads the same from the stopped run's spans, but what
    a stopped run cannot know: its block hit rate, block counts, block size, capacity and
    computed prompt tokens were missing (the dashboard's Block hit rate tile read – beside the
    prefix cache hit rate of the same requests; diff took an eviction delta against a run of
    another block size, having no block size to tell them apart)."""
    db, run_id, finished = stopped
    assert read.run(db, run_id)["summary"] is None
    got = read.run_summary(db, run_id)
    for key, want in finished.items():
        if key in UNKNOWN_WHEN_STOPPED or key == "run_id":
            continue
        assert key in got, key
        if isinstance(want, float):
            assert got[key] == pytest.approx(want, rel=1e-12), key
        else:
            assert got[key] == want, key
    hit, total, computed = _blocks_from_otel(db, run_id, got["block_size"])
    assert (got["hit_blocks"], got["total_blocks"], got["computed_prompt_tokens"]) == (hit, total, computed)
    assert got["block_hit_rate"] == hit / total


def test_a_stopped_runs_block_hit_rate_in_runs_and_on_the_dashboard(stopped, monkeypatch, capsys):
    from kvtrace.dashboard import ui
    from tests.cli.support import run as cli
    from tests.dashboard.apptest import render

    db, run_id, finished = stopped
    tiles = {m.label: m.value for m in render(db, monkeypatch, run=run_id).metric}
    assert tiles["Block hit rate"] == ui.pct(finished["block_hit_rate"]) != "–"
    code, out, err = cli(["diff", run_id, run_id, "--db", db, "--json"], capsys)
    assert code in (0, 1), err
    rows = json.loads(out)["metrics"]
    assert rows["block_hit_rate"]["a"] == finished["block_hit_rate"]
    assert rows["block_size"]["a"] == finished["block_size"]


def test_the_trace_notebooks_knee_names_the_best_of_the_capacities_swept(run_notebook):  # noqa: F811
    """Capacities that stop short of the whole trace: the knee sentence said "LRU reaches 90%
    of its best hit rate at 100 blocks" of 10.4% (the best of the three swept) where the
    unbounded cache hits 79.3%; the Belady headroom printed a difference of fractions (+0.0000)
    where every view shows a rate's change in percentage points."""
    from kvtrace import metrics

    result, nb = run_notebook("trace_characterisation", generator="mixed", limit=80, capacities=[20, 50, 100])
    lru = result["lru_prefix_cache_hit_rate"]
    best = max(lru)
    assert 0 < best < result["reuse_fraction"]  # the sweep stops short of every block fitting
    printed = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    knee = next(c for c, h in zip(result["capacities"], lru) if h >= 0.9 * best)
    assert (f"LRU reaches 90% of the highest hit rate swept ({metrics.percent_text(best)}, at "
            f"{result['capacities'][lru.index(best)]:,} blocks) at {knee:,} blocks; the capacities swept stop short "
            "of ") in printed, printed
    assert "90% of its best" not in printed
    headroom = result["belady_prefix_cache_hit_rate"][0] - lru[0]
    assert f"Belady headroom at the smallest capacity (20 blocks): {metrics.points_text(headroom)}\n" in printed


def test_the_regression_notebooks_verdict_gives_the_hit_rate_in_percent_beside_its_change_in_points(
        run_notebook, tmp_path):  # noqa: F811
    """"B raises the prefix cache hit rate from 0.1042 to 0.1186 (+1.44 pp, +13.8%)": a rate as a
    fraction beside its change in percentage points, in one sentence; every other view shows the
    rate in % (runs, replay, curve, the dashboard)."""
    from kvtrace import metrics
    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path / "pair.duckdb")
    a, b = (run_replay(RunSpec("gen:mixed", limit=60, mode="cache-only", capacity_blocks=100, policy=policy,
                               name=policy), db=db) for policy in ("lru", "belady"))
    ra, rb = a.summary["prefix_cache_hit_rate"], b.summary["prefix_cache_hit_rate"]
    assert rb > ra
    out, _ = run_notebook("regression_analysis", db_path=db, run_a=a.run_id, run_b=b.run_id)
    assert (f"B raises the prefix cache hit rate from {metrics.percent_text(ra)} to {metrics.percent_text(rb)} "
            f"({metrics.points_text(rb - ra)}, ") in out["verdict"], out["verdict"]
