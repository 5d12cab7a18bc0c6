"""Probe 22 (compare): what diff, study, runs, export and demo print agrees with the numbers."""

from __future__ import annotations

import io

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
