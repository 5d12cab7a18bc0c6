"""Fixes of the re-probe of this session's diff/study fixes: a failed run of the trace's block size,
one rule for a latency statistic's verdict (its bootstrap CI's) in every view, a study's expected
effect as its own diff judges it, a gate's word on a CI that finds no change, the Belady note."""

from __future__ import annotations

import json

import duckdb
import pytest

from kvtrace.compare import study as S
from kvtrace.compare.gates import check_fail_if
from kvtrace.compare.model import PercentileShift, diff_summaries, with_latency_findings
from kvtrace.compare.render import to_json, to_markdown
from tests.cli.support import run

A = {"prefix_cache_hit_rate": 0.5, "median_ttft_ms": 14.0, "p50_ttft_ms": 14.0, "p90_ttft_ms": 20.0,
     "mean_ttft_ms": 15.0, "p50_tpot_ms": 5.0}
B = {"prefix_cache_hit_rate": 0.8, "median_ttft_ms": 10.0, "p50_ttft_ms": 10.0, "p90_ttft_ms": 23.0,
     "mean_ttft_ms": 11.0, "p50_tpot_ms": 4.0}


def _shift(q: float, a: float, b: float, lo: float, hi: float) -> PercentileShift:
    return PercentileShift("ttft_ms", q, a, b, b - a, lo, hi)


def _diff(latency: list[PercentileShift]):
    d = diff_summaries(A, B, ci_verdicts=True)  # (as kvtrace diff and study build theirs)
    d.latency = latency
    d.metrics = with_latency_findings(d.metrics, latency)
    return d


def _summary_marks(markdown: str) -> dict[str, str]:
    marks = {}
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0] in A:
            marks.setdefault(cells[0], cells[5])
    return marks


def test_a_latency_statistics_verdict_is_its_ci_s_whatever_the_percentiles():
    """With --percentiles 90 median_ttft_ms had no CI and kept a raw "better" (with 50 its CI
    found nothing and it had none); mean, tpot and uncertain rows kept raw verdicts too."""
    only_p90 = _diff([_shift(90, 20.0, 23.0, -1.0, 6.0)])
    verdicts = {m.name: m.verdict for m in only_p90.metrics}
    # no CI (median at --percentiles 90, mean, tpot) or a CI across zero (p90): no verdict, the delta kept
    assert verdicts == {"prefix_cache_hit_rate": "better", "median_ttft_ms": "", "p50_ttft_ms": "",
                        "p90_ttft_ms": "", "mean_ttft_ms": "", "p50_tpot_ms": ""}
    assert only_p90.metric("median_ttft_ms").delta == -4.0
    marks = _summary_marks(to_markdown(only_p90))
    assert marks["median_ttft_ms"] == marks["mean_ttft_ms"] == marks["p50_tpot_ms"] == ""
    assert marks["prefix_cache_hit_rate"] == "✅ better"
    j = to_json(only_p90)
    assert j["verdicts"]["metrics"]["median_ttft_ms"] is None
    assert j["verdicts"]["metrics"]["prefix_cache_hit_rate"] == "better"
    assert j["verdicts"]["latency"] == {"p90_ttft_ms": None}
    # a CI that finds the change gives the row, and its median, the verdict in every view
    found = _diff([_shift(50, 14.0, 10.0, -6.0, -2.0), _shift(90, 20.0, 23.0, 1.0, 6.0)])
    assert found.metric("median_ttft_ms").verdict == found.metric("p50_ttft_ms").verdict == "better"
    assert found.metric("p90_ttft_ms").verdict == "worse"
    assert to_json(found)["verdicts"]["metrics"]["median_ttft_ms"] == "better"
    assert _summary_marks(to_markdown(found))["median_ttft_ms"] == "✅ better"


def test_a_percentile_only_the_bootstrap_holds_keeps_its_ci_finding():
    """RunDiff.metric's fallback to a bootstrap percentile (a gate's, a dashboard tile's) read the
    raw delta: p99_itl_ms "worse" beside its CI [-0.5, +0.8]."""
    d = diff_summaries({"requests": 3}, {"requests": 3})
    d.latency = [PercentileShift("itl_ms", 99, 4.0, 4.2, 0.2, -0.5, 0.8),
                 PercentileShift("itl_ms", 50, 4.0, 4.4, 0.4, 0.1, 0.6)]
    assert d.metric("p99_itl_ms").verdict == ""
    assert d.metric("p50_itl_ms").verdict == "worse"


def test_a_gate_on_a_change_its_ci_does_not_find_says_so():
    d = _diff([_shift(90, 20.0, 23.0, -1.0, 6.0)])
    (msg,) = check_fail_if(d, ["p90_ttft_ms:+1"])  # the gate still reads the raw delta
    assert msg.startswith("p90_ttft_ms rose by 3") and "bootstrap CI [-1.000, +6.000] finds no change" in msg
    (msg,) = check_fail_if(d, ["mean_ttft_ms:-1"])
    assert msg.startswith("mean_ttft_ms dropped by 4") and "no bootstrap CI judged it" in msg
    found = _diff([_shift(90, 20.0, 23.0, 1.0, 6.0)])
    (msg,) = check_fail_if(found, ["p90_ttft_ms:+1"])
    assert "CI" not in msg


def test_a_studys_expected_effect_is_its_own_diffs_finding():
    """transient-checkpoint-retention said "Expected effect shown: ... median_ttft_ms lower with it
    on" beside a table whose CI [-49.6, 0.0] found no change (and, without --db, a raw "better")."""
    behaviour = S.TRANSIENT_CHECKPOINT_RETENTION
    on, off = B, A  # (A = off)
    assert S.expectation_failures(behaviour, on, off) == []  # the raw directions hold
    # without --db: no CI, no verdict in the table, and the effect is not judged
    effect = S.StudyPoint(on=on, off=off, diff=_diff([])).effect(behaviour)
    assert effect["shown"] is None and "not judged" in effect["unmet"][0]
    assert S.verdict_line(effect).startswith("Expected effect not measured")
    # with --db, a CI that finds nothing: not shown
    effect = S.StudyPoint(on=on, off=off, diff=_diff([_shift(50, 14.0, 10.0, -8.0, 0.0)])).effect(behaviour)
    assert effect["shown"] is False and "[-8.000, 0.0000] does not find" in effect["unmet"][0]
    # and a CI that finds it: shown
    effect = S.StudyPoint(on=on, off=off, diff=_diff([_shift(50, 14.0, 10.0, -8.0, -1.0)])).effect(behaviour)
    assert effect == {**effect, "shown": True, "unmet": []}


@pytest.fixture(scope="module")
def trace_block_size_runs(tmp_path_factory):
    """Cache-only runs of one trace: r1 at 32-token blocks; r2 and r3 at the trace's (config
    block_size None), each then recorded as a killed replay leaves it (failed, no summary)."""
    from kvtrace.replay.run import RunSpec, run_replay

    db = tmp_path_factory.mktemp("fix26") / "k.duckdb"
    ids = [run_replay(RunSpec("gen:mixed", limit=300, mode="cache-only", capacity_blocks=60, block_size=size),
                      db=db).run_id for size in (32, None, None)]
    with duckdb.connect(str(db)) as con:
        con.execute("UPDATE runs SET status = 'failed', summary = NULL WHERE run_id IN (?, ?)", ids[1:])
    return str(db), ids


def test_a_failed_run_of_the_traces_block_size_gets_no_eviction_delta(trace_block_size_runs, capsys):
    db, (r32, r_a, r_b) = trace_block_size_runs
    code, out, err = run(["diff", r32, r_a, "--db", db, "--json"], capsys)
    assert code == 0, err
    d = json.loads(out)
    assert d["metrics"]["evictions"]["delta"] is None and d["metrics"]["publishes"]["delta"] is None
    assert d["metrics"]["evictions"]["a"] and d["metrics"]["evictions"]["b"]
    assert all(v["delta"] is None for v in d["evictions"]["by_reason"].values())
    assert any(n.startswith("the block size of run B is unknown") for n in d["notes"])
    code, out, err = run(["diff", r32, r_a, "--db", db, "--fail-if", "evictions:+10%"], capsys)
    assert code == 1 and "evictions:+10%: cannot evaluate: the block size of B is unknown" in err
    # two runs at the one trace's block size count the same blocks: their deltas stand
    code, out, err = run(["diff", r_a, r_b, "--db", db, "--json"], capsys)
    d = json.loads(out)
    assert code == 0 and d["metrics"]["evictions"]["delta"] == 0
    assert not any("block size" in n for n in d["notes"])


def test_the_belady_note_names_each_runs_policy(tmp_path, capsys):
    from kvtrace.replay.run import RunSpec, run_replay

    db = tmp_path / "b.duckdb"
    lru = run_replay(RunSpec("gen:chat", limit=40, mode="cache-only", capacity_blocks=50), db=db)
    bel = run_replay(RunSpec("gen:chat", limit=40, mode="cache-only", policy="belady", capacity_blocks=50), db=db)
    bel2 = run_replay(RunSpec("gen:chat", limit=40, mode="cache-only", policy="belady", capacity_blocks=60), db=db)
    code, out, err = run(["diff", lru.run_id, bel.run_id, "--db", str(db), "--json"], capsys)
    assert code == 0, err
    assert any(n.startswith("run B (cache-only) counts evictions but records no evicted blocks (a Belady bound "
                            "records none; policies: A lru, B belady)") for n in json.loads(out)["notes"])
    code, out, err = run(["diff", bel.run_id, bel2.run_id, "--db", str(db), "--json"], capsys)
    assert code == 0, err
    assert any(n.startswith("runs A (cache-only) and B (cache-only) count evictions but record no evicted blocks "
                            "(a Belady bound records none; policies: A belady, B belady)")
               for n in json.loads(out)["notes"])
