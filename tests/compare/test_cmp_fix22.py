"""Fixes of what the re-probe of diff, study, demo, runs and export found (task cmpfix)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console


def test_a_fall_below_a_tenth_of_a_percent_keeps_its_minus_sign_beside_its_delta():
    """fa3a5e4 read every "-0.0%" as "+0.0%", also beside a real fall:
    `| mean_e2el_ms | 883.3 | 883.0 | -0.3239 | +0.0% | ✅ better |`. Only a delta that shows as
    zero makes it +0.0%."""
    from kvtrace.compare.model import diff_summaries
    from kvtrace.compare.render import fmt, to_markdown, to_text

    a = {"mean_e2el_ms": 883.3239, "median_itl_ms": 4.56}
    b = {"mean_e2el_ms": 883.0, "median_itl_ms": 4.56 - 1e-7}
    diff = diff_summaries(a, b)
    fall, noise = (next(m for m in diff.metrics if m.name == k) for k in ("mean_e2el_ms", "median_itl_ms"))
    assert fmt(fall.delta, signed=True) == "-0.3239" and f"{fall.rel * 100:+.1f}%" == "-0.0%"
    assert fmt(noise.delta, signed=True) == "0.0000" and f"{noise.rel * 100:+.1f}%" == "-0.0%"
    md = to_markdown(diff)
    assert "| mean_e2el_ms | 883.3 | 883.0 | -0.3239 | -0.0% | ✅ better |" in md
    assert "| median_itl_ms | 4.560 | 4.560 | 0.0000 | +0.0% |  |" in md
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in to_text(diff, width=200).splitlines()]
    rows = {row[0]: row[1:] for row in cells if row}
    assert rows["mean_e2el_ms"] == ["883.3", "883.0", "-0.3239", "-0.0%"]
    assert rows["median_itl_ms"] == ["4.560", "4.560", "0.0000", "+0.0%"]


def test_a_latency_change_of_exactly_one_microsecond_is_a_change():
    """The `< 1e-3` ms check ran on float ms: 60.279851 - 60.280851 is -0.000999999... ms, a
    whole microsecond called "same" (and no finding in the percentiles, nor in a study's verdict)."""
    from kvtrace.compare.model import MetricDelta, PercentileShift
    from kvtrace.compare.study import TRANSIENT_CHECKPOINT_RETENTION, expected_effect

    a, b = 60.280851, 60.279851
    assert -(b - a) < 1e-3  # (the float difference lies under the resolution)
    assert MetricDelta("median_ttft_ms", a, b, b - a, None).verdict == "better"
    assert MetricDelta("median_ttft_ms", b, a, a - b, None).verdict == "worse"
    assert MetricDelta("median_ttft_ms", a, a - 999e-9, -999e-9, None).verdict == "same"  # (999 ns)
    shift = PercentileShift("ttft_ms", 50.0, a, b, b - a, -0.01, -0.0005)
    assert shift.significant
    assert not PercentileShift("ttft_ms", 50.0, a, a - 999e-9, -999e-9, -0.01, -0.0005).significant
    off = {"prefix_cache_hit_rate": 0.10, "median_ttft_ms": a}
    on = {"prefix_cache_hit_rate": 0.15, "median_ttft_ms": b}
    assert expected_effect(TRANSIENT_CHECKPOINT_RETENTION, on, off)["shown"] is True


@pytest.mark.parametrize("backend", ["duckdb", "chdb"])
def test_runs_of_one_second_are_listed_newest_first_by_number(tmp_path, backend):
    """`kvtrace runs` broke ties of one second on run_id DESC as text: r9 above r10."""
    from kvtrace.store import read
    from kvtrace.store.writer import Store

    db = str(tmp_path / "s.duckdb") if backend == "duckdb" else f"chdb:{tmp_path / 's'}"
    store = Store.open(db)
    try:
        for n in range(1, 12):
            store.create_run(f"run {n}", created="2026-12-06T01:00:00+00:00")
        store.create_run("named", created="2026-12-06T01:00:00+00:00", run_id="custom")
        store.create_run("later", created="2026-12-06T01:00:01+00:00", run_id="r2x")
    finally:
        store.close()
    ids = read.runs(db)["run_id"].to_list()
    assert ids == ["r2x", *(f"r{n}" for n in range(11, 0, -1)), "custom"]


def _demo_result(backend_config: dict):
    from kvtrace.compare.demo import DemoResult, demo_specs
    from kvtrace.replay.run import RunResult

    specs = demo_specs(limit=8, backend="vllm" if backend_config else "kvtrace")
    return DemoResult("d.duckdb", runs=[
        (spec, RunResult({}, f"r{i + 1}", record={"config": {**(backend_config if i == 0 else {})}}))
        for i, spec in enumerate(specs)])


def test_the_demos_summary_table_says_whose_manager_made_each_run():
    """`demo --backend vllm`: each diff said `Backend: A kvtrace · B vllm ...`; the summary
    table above them never said its "all on" column is vLLM's manager."""
    from kvtrace.compare.demo import runs_backend_note
    from kvtrace.metrics import backend_label

    config = {"backend": "vllm", "vllm_version": "0.33.0", "vllm_commit": "4ba787ec9aaa1111"}
    label = backend_label("engine", config)
    note = runs_backend_note(_demo_result(config))
    assert note == f"Backend: all on {label} · without a behaviour kvtrace"
    assert runs_backend_note(_demo_result({})) is None  # (kvtrace's own everywhere: nothing to say, as diff)


def test_the_demos_diffs_print_what_kvtrace_diff_prints_of_the_same_runs(tmp_path):
    """The demo's diffs left out the `cached tokens per request (local + external hits): ...` line
    kvtrace diff prints of the same runs (f72899e): one renderer for both, the demo's without
    evictions and top requests."""
    from kvtrace.compare.demo import run_demo
    from kvtrace.compare.render import requests_line, to_text

    out = io.StringIO()
    result = run_demo(tmp_path / "d.duckdb", progress=False, console=Console(file=out, width=250), limit=8)
    lines = out.getvalue().splitlines()
    assert len(result.diffs) == 3
    for d in result.diffs.values():
        assert d.requests is not None and d.requests.requests == 8
        line = requests_line(d.requests)
        assert any(x.strip() == line for x in lines)  # (a table's title or a line of its own)
        assert line in to_text(d, width=250)
    assert sum(x.strip().startswith("cached tokens per request (local + external hits):") for x in lines) == 3


def test_a_study_swept_over_one_value_has_its_sweep_table_in_every_view():
    """`study ... --sweep retention=0 --markdown` left out the sweep table the terminal view
    and --json show for one value (markdown asked for two points, the others for a sweep)."""
    from kvtrace.compare.model import diff_summaries
    from kvtrace.compare.study import SHARED_PREFIX_PINNING, StudyPoint, StudyResult

    on = {"prefix_cache_hit_rate": 0.2, "prefix_cache_hits": 20, "median_ttft_ms": 5.0}
    off = {"prefix_cache_hit_rate": 0.1, "prefix_cache_hits": 10, "median_ttft_ms": 6.0}
    point = StudyPoint(on=on, off=off, diff=diff_summaries(off, on), parameter="retention", value=0)
    result = StudyResult(SHARED_PREFIX_PINNING, "gen:study-shared-prefix-pinning", points=[point])
    assert result.to_json()["sweep"]["parameter"] == "retention"
    terminal = io.StringIO()
    result.print(Console(file=terminal, width=200))
    assert f"{SHARED_PREFIX_PINNING}: on - off, per retention" in terminal.getvalue()
    md = result.to_markdown()
    assert result.sweep_markdown() in md and "| retention | prefix_cache_hit_rate off |" in md
    unswept = StudyResult(SHARED_PREFIX_PINNING, "t", points=[StudyPoint(on=on, off=off, diff=point.diff)])
    assert "sweep" not in unswept.to_json() and "| None |" not in unswept.to_markdown()


def test_an_empty_export_directory_is_named_at_its_flag_once(tmp_path, capsys):
    """`kvtrace export --parquet ""` said `kvtrace: error: kvtrace export: --parquet: ...`."""
    from kvtrace.store.writer import Store
    from tests.cli.support import assert_one_line, run

    db = str(tmp_path / "a.duckdb")
    Store.open(db).close()
    code, _, err = run(["export", "--db", db, "--run", "r1", "--parquet", ""], capsys)
    line = assert_one_line(code, err, "--parquet")
    assert line.startswith("kvtrace: error: --parquet: expected an output directory") and line.count("kvtrace") == 1


def test_the_per_request_line_writes_counts_with_separators():
    """`of 1626; only in A: 1374` and `net -322560 tokens` beside tables that write 1,626."""
    from kvtrace.compare.model import RequestHitDiff, RunDiff
    from kvtrace.compare.render import requests_line, to_markdown, to_text

    r = RequestHitDiff(requests=1626, gained=0, lost=1200, only_a=1374, only_b=0, cached_tokens_delta=-322560)
    assert requests_line(r) == ("cached tokens per request (local + external hits): 0 gained, 1,200 lost of 1,626; "
                                "only in A: 1,374, only in B: 0")
    diff = RunDiff({"run_id": "r1"}, {"run_id": "r2"}, [], requests=r)
    md = to_markdown(diff)
    assert "0 gained, 1,200 lost, 426 unchanged of 1,626 common requests (net -322,560 tokens)." in md
    assert "Only in A: 1,374, only in B: 0." in md
    assert requests_line(r) in to_text(diff, width=200).splitlines()
