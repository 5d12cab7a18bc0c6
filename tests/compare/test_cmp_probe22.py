"""Probe 22 (compare): what diff, study, runs, export and demo print agrees with the numbers."""

from __future__ import annotations

import io

import pytest
from rich.console import Console


def test_the_demo_names_the_cost_model_of_the_times_it_shows(tmp_path):
    """README: every summary and diff that shows a latency names the cost model and says
    "modelled". The demo's summary table and its three diffs showed TTFT and ITL with neither
    (`kvtrace diff` of the same runs says "Times: modelled by cost model h200-kimi-hybrid")."""
    from kvtrace.compare.demo import run_demo
    from kvtrace.compare.render import to_text

    out = io.StringIO()
    result = run_demo(tmp_path / "d.duckdb", progress=False, console=Console(file=out, width=250), limit=8)
    models = {r.summary.get("cost_model") for _, r in result.runs}
    assert len(models) == 1 and None not in models  # (the demo's four runs: one preset)
    line = f"Times: modelled by cost model {models.pop()}"
    lines = out.getvalue().splitlines()
    assert lines.count(line) == 1 + len(result.diffs) == 4  # the summary table's runs, then each diff
    # each diff's line is the one `kvtrace diff` prints of the same two runs
    assert all(line in to_text(d, width=250).splitlines() for d in result.diffs.values())
    first = lines.index(line)
    assert any("median_ttft_ms" in x for x in lines[:first])  # (after the table whose times it names)


def test_a_studys_verdict_takes_no_sub_microsecond_latency_change_for_its_effect():
    """The diff calls a latency change below LATENCY_RESOLUTION_MS "same" (interpolation
    between integer-ns samples, shown as 0.0000); the study's verdict line said "Expected
    effect shown: ... median_ttft_ms lower with it on" of such a change, beside that table."""
    from kvtrace.compare.model import LATENCY_RESOLUTION_MS, MetricDelta
    from kvtrace.compare.render import fmt
    from kvtrace.compare.study import TRANSIENT_CHECKPOINT_RETENTION, expected_effect

    off = {"prefix_cache_hit_rate": 0.10, "median_ttft_ms": 61.2580005}
    on = {"prefix_cache_hit_rate": 0.15, "median_ttft_ms": 61.258}
    delta = on["median_ttft_ms"] - off["median_ttft_ms"]
    assert 0 < -delta < LATENCY_RESOLUTION_MS and fmt(delta, signed=True) == "0.0000"
    assert MetricDelta("median_ttft_ms", off["median_ttft_ms"], on["median_ttft_ms"], delta, None).verdict == "same"
    effect = expected_effect(TRANSIENT_CHECKPOINT_RETENTION, on, off)
    assert effect["shown"] is False
    assert [u.split(":")[0] for u in effect["unmet"]] == ["median_ttft_ms"]
    # a change the diff does call one still shows the effect
    on["median_ttft_ms"] = off["median_ttft_ms"] - 2 * LATENCY_RESOLUTION_MS
    assert expected_effect(TRANSIENT_CHECKPOINT_RETENTION, on, off) == {
        "shown": True, "expected": effect["expected"], "unmet": []}


def test_the_diff_table_says_how_many_requests_one_run_alone_holds():
    """A run stopped early against a finished one: --markdown and --json say "only in A: 698",
    the terminal view said nothing of them where no common request gained or lost (no
    per-request table, and its title never named them)."""
    from kvtrace.compare.model import MetricDelta, RequestChange, RequestHitDiff, RunDiff
    from kvtrace.compare.render import to_json, to_markdown, to_text

    run_a, run_b = {"run_id": "r8", "name": "full"}, {"run_id": "r9", "name": "stopped"}
    metrics = [MetricDelta("requests", 1083, 385, -698, -698 / 1083)]
    same = RunDiff(run_a, run_b, metrics, requests=RequestHitDiff(requests=385, only_a=698))
    assert to_json(same)["requests"]["only_a"] == 698 and "Only in A: 698, only in B: 0." in to_markdown(same)
    lines = to_text(same, width=200).splitlines()
    assert ("cached tokens per request (local + external hits): 0 gained, 0 lost of 385; only in A: 698, only in B: 0"
            in lines)
    # with a request that lost: the table's title says it
    lost = RequestChange("q1", 100, 64, 0)
    changed = RunDiff(run_a, run_b, metrics, requests=RequestHitDiff(requests=385, lost=1, only_b=3, top_lost=[lost]))
    text = " ".join(to_text(changed, width=200).split())  # (a title wraps at its table's width)
    assert "cached tokens per request (local + external hits): 0 gained, 1 lost of 385; only in A: 0, only in B: 3" \
        in text
    assert text.count("cached tokens per request") == 1
    # nothing held by one run alone, nothing gained or lost: the line says the requests were compared
    none = RunDiff(run_a, run_b, metrics, requests=RequestHitDiff(requests=40))
    assert "cached tokens per request (local + external hits): 0 gained, 0 lost of 40" in to_text(
        none, width=200).splitlines()


def test_a_study_through_vllm_without_a_store_says_whose_manager_made_each_run(vllm_api):
    """`study --backend vllm` without --db: B is vLLM's manager, A kvtrace's with the behaviour
    off. Its diff said nothing of it (no "Backend:" line, no backend in --json's runs), where
    the same study with --db says "Backend: A kvtrace · B vllm 0.33.0 @ COMMIT"."""
    from kvtrace.compare.render import to_json, to_markdown, to_text
    from kvtrace.compare.study import SHARED_PREFIX_PINNING, run_study
    from kvtrace.metrics import backend_label
    from kvtrace.replay.run import RunSpec

    res = run_study(SHARED_PREFIX_PINNING, trace="gen:mixed", base=RunSpec(trace="", backend="vllm"), limit=3)
    runs = to_json(res.diff)
    assert (runs["run_a"]["backend"], runs["run_b"]["backend"]) == ("kvtrace", "vllm")
    assert runs["run_b"]["vllm_version"] and runs["run_b"]["vllm_commit"]
    label = backend_label("engine", runs["run_b"])
    assert label is not None and label.startswith("vllm ")
    assert f"Backend: A kvtrace · B {label}" in to_text(res.diff, width=250).splitlines()
    assert f"Backend: A `kvtrace` · B `{label}`" in to_markdown(res.diff).splitlines()


def test_a_shift_whose_interval_lies_on_the_other_side_of_zero_is_no_finding():
    """A percentile bootstrap's interval can miss its point estimate (discrete latencies: ITL
    p75 +0.75 µs with an interval of [-0.006, +0.22] µs, measured). Where it lies wholly on
    the other side of zero, the shift was marked "worse" (red, ❌) by its point estimate's
    sign beside an interval saying B is lower."""
    from kvtrace.compare.model import PercentileShift, RunDiff
    from kvtrace.compare.render import to_markdown

    rise_below = PercentileShift("ttft_ms", 50, 10.0, 12.0, 2.0, -5.0, -1.0)
    drop_above = PercentileShift("itl_ms", 90, 10.0, 8.0, -2.0, 1.0, 5.0)
    assert not rise_below.significant and not drop_above.significant
    assert PercentileShift("ttft_ms", 50, 10.0, 12.0, 2.0, 1.0, 5.0).significant  # (agreeing: a finding)
    assert PercentileShift("itl_ms", 90, 10.0, 8.0, -2.0, -5.0, -1.0).significant
    md = to_markdown(RunDiff({"run_id": "a"}, {"run_id": "b"}, [], latency=[rise_below, drop_above]))
    rows = [line for line in md.splitlines() if line.startswith(("| p50_ttft_ms", "| p90_itl_ms"))]
    assert len(rows) == 2 and not any("worse" in r or "better" in r for r in rows)


def test_export_and_diff_help_say_what_the_commands_do(capsys):
    """`export --help` said it exports "spans and summary"; it writes three files, the third
    the evicted-block table. `diff --help` gave --resamples no range, which it refuses outside
    100..10,000 (README: from 100 to 10,000)."""
    from kvtrace.compare.options import MAX_RESAMPLES, MIN_RESAMPLES
    from kvtrace.store.export import EXPORTED_TABLES
    from tests.cli.support import run

    code, out, _ = run(["export", "--help"], capsys)
    flat = " ".join(out.split())
    assert code == 0 and all(f"DIR/{t}.parquet" in flat for t in EXPORTED_TABLES)
    code, out, _ = run(["diff", "--help"], capsys)
    assert code == 0 and f"({MIN_RESAMPLES} to {MAX_RESAMPLES:,})" in " ".join(out.split())


def test_the_latency_bootstrap_holds_a_block_of_replicates_at_a_time(monkeypatch):
    """The resample counts of every replicate were held at once, with two copies the
    percentiles made of them: an unpaired diff of 100,000 requests peaked at 1.7 GB at the
    default 1,000 resamples (about 17 GB at --resamples 10,000). Drawn and used a block at a
    time, from the same stream: the intervals are the same, to the bit."""
    import tracemalloc

    import numpy as np
    import polars as pl

    from kvtrace.compare import bootstrap

    n, resamples = 20_000, 200
    rng = np.random.default_rng(5)
    ids = [f"q{i}" for i in range(n)]

    def frames(shift: int) -> dict[str, pl.DataFrame]:
        return {"ttft_ms": pl.DataFrame({"request_id": ids,
                                         "ttft_ms": rng.gamma(2, 5e7, n).astype(np.int64) + shift})}

    a, b = frames(0), frames(3_000_000)
    whole = n * resamples * np.dtype(np.int32).itemsize  # one run's counts, every replicate at once
    monkeypatch.setattr(bootstrap, "_COUNTS_BLOCK", 1 << 40, raising=False)  # (one block: as before)
    expected = bootstrap.latency_shifts(a, b, seed=3, resamples=resamples, per_unit=1e6, pair=False)
    monkeypatch.setattr(bootstrap, "_COUNTS_BLOCK", 1 << 17, raising=False)
    for pair in (False, True):
        tracemalloc.start()
        try:
            got = bootstrap.latency_shifts(a, b, seed=3, resamples=resamples, per_unit=1e6, pair=pair)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < whole, (pair, peak, whole)  # (before: six times it, unpaired)
    assert got[1]["paired"] is True
    unpaired = bootstrap.latency_shifts(a, b, seed=3, resamples=resamples, per_unit=1e6, pair=False)
    assert unpaired == expected and all(not np.isnan(s.ci_low) for s in unpaired[0])


def test_a_relative_change_that_rounds_to_zero_has_no_minus_sign():
    """The Δ% column said "-0.0%" beside a Δ of "0.0000" (fmt drops a sign that rounds away)."""
    from kvtrace.compare.render import fmt, fmt_rel

    assert fmt_rel(-1e-5) == fmt_rel(1e-5) == fmt_rel(0.0) == "+0.0%"  # (as an unchanged metric reads)
    assert fmt(-1e-5, signed=True) == "0.0000"
    assert fmt_rel(-0.0006) == "-0.1%" and fmt_rel(0.25) == "+25.0%" and fmt_rel(None) == "–"


def test_an_export_of_a_run_whose_derived_rows_were_deleted_is_refused_not_an_empty_file(tmp_path):
    """evicted_blocks deleted by hand was exported as an empty file, exit 0, where the read API
    calls the run damaged."""
    import duckdb

    from kvtrace.replay.run import RunSpec, run_replay
    from kvtrace.store.errors import StoreError
    from kvtrace.store.export import export_parquet

    db = str(tmp_path / "s.duckdb")
    run_replay(RunSpec("gen:chat", limit=20, capacity_blocks=200, content=False), db=db)  # (it evicts)
    export_parquet(db, "r1", tmp_path / "whole")  # (a whole run exports)
    with duckdb.connect(db) as con:
        assert con.execute("SELECT count(*) FROM evicted_blocks WHERE run_id = 'r1'").fetchone()[0] > 0
        con.execute("DELETE FROM evicted_blocks WHERE run_id = 'r1'")
    with pytest.raises(StoreError, match="derived table evicted_blocks holds none of its rows"):
        export_parquet(db, "r1", tmp_path / "out")
    assert not (tmp_path / "out").exists()
