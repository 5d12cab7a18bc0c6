"""Probe 29 (dash): hostile text in the notebooks' stores shown as typed."""

from __future__ import annotations

import html
import json

import pytest

from kvtrace.names import plotly_literal

# Run names and request ids that plotly would read as markup (a subset of HTML: bold, a line
# break, a link) where it draws them: legends, hover labels.
NAME_A = "<b>A</b><br>two lines"
NAME_B = "<i>B</i> <a href='https://example.com'>x</a> a<b & c"
REQUEST = "<b>q</b><br>"


def _hostile_trace(path) -> str:
    """A native trace of four requests sharing a prefix, one of them with a hostile id."""
    rows = [{"kvtrace_trace": 1, "block_size": 16}]
    for i in range(4):
        rows.append({"request_id": f"{REQUEST}{i}", "arrival_ns": i * 1_000_000, "input_length": 48,
                     "hash_ids": [1, 2, 10 + i], "output_length": 3})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _plotly_strings(nb) -> list[str]:
    """Every name and hover string of every chart the notebook drew."""
    found = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            fig = out.get("data", {}).get("application/vnd.plotly.v1+json")
            for trace in (fig or {}).get("data", []):
                for field in ("name", "hovertemplate", "legendgroup"):
                    if isinstance(trace.get(field), str):
                        found.append(trace[field])
                for field in ("hovertext", "text"):
                    found += [v for v in trace.get(field) or [] if isinstance(v, str)]
    return found


def test_run_names_and_request_ids_reach_the_notebooks_charts_as_text(run_notebook, tmp_path):
    """The legends and hover labels of regression_analysis's charts drew a run's name and a
    request's id as plotly markup: a name with <b> in bold, <br> as a line break, an <a> as a
    link, and 'a<b & c' cut at its '<'; they are shown as typed (the dashboard's charts
    escape them the same way, ``names.plotly_literal``)."""
    from kvtrace.replay.run import RunSpec, run_replay

    db, trace = tmp_path / "names.duckdb", _hostile_trace(tmp_path / "hostile.jsonl")
    run_replay(RunSpec(trace, name=NAME_A, without=("shared-prefix-pinning",)), db=db)
    run_replay(RunSpec(trace, name=NAME_B), db=db)
    _, nb = run_notebook("regression_analysis", db_path=str(db), run_a="r1", run_b="r2")
    strings = _plotly_strings(nb)
    for name in (f"A: {NAME_A}", f"B: {NAME_B}"):
        assert any(plotly_literal(name) in s for s in strings), (name, strings)
        assert not any(name in s for s in strings), (name, strings)
    assert any(html.unescape(s).startswith(REQUEST) for s in strings), strings  # the scatter's hover names
    assert not any(s.startswith(REQUEST) for s in strings), strings


def _one_request_trace(path) -> str:
    path.write_text('{"kvtrace_trace":1,"block_size":16}\n'
                    '{"request_id":"a","arrival_ns":0,"input_length":64,"hash_ids":[1,2,3,4],"output_length":2}\n')
    return str(path)


def test_a_capacity_beyond_any_pool_names_the_capacities_parameter(run_notebook, tmp_path):
    """A capacity past what a bounded pool holds was refused in the replay's words, "--capacity-blocks: ...
    omit it, or say --capacity-blocks inf": a flag the notebook has not."""
    import re

    from papermill.exceptions import PapermillExecutionError

    from kvtrace.replay.cache_only import MAX_CAPACITY_BLOCKS

    trace = _one_request_trace(tmp_path / "one.jsonl")
    too_many = MAX_CAPACITY_BLOCKS + 1
    with pytest.raises(PapermillExecutionError) as caught:
        run_notebook("trace_characterisation", trace_path=trace, capacities=[8, too_many])
    said = f"{caught.value.ename}: {caught.value.evalue}"
    assert re.fullmatch(rf"ConfigError: trace_characterisation: capacities: expected an int from 1 to "
                        rf"{MAX_CAPACITY_BLOCKS:,}, got {too_many}", said), said


def test_an_empty_trace_is_refused_not_replaced_by_the_generated_workload(run_notebook):
    """``-p trace ''`` ran the study on the behaviour's generated workload, as if no trace were
    given (`kvtrace study --trace ''` refuses it)."""
    from papermill.exceptions import PapermillExecutionError

    with pytest.raises(PapermillExecutionError, match=r"KVTraceError: trace: expected a trace file"):
        run_notebook("regression_analysis", trace="", limit=4)


@pytest.mark.parametrize(("notebook", "parameter"), [("trace_characterisation", "trace_path"),
                                                     ("regression_analysis", "trace")])
def test_a_trace_of_other_sized_ids_names_the_trace_block_size_parameter(run_notebook, tmp_path, notebook,
                                                                        parameter):
    """A Mooncake trace of 64-token ids read at 512 was refused with the CLI's hint, "give it with
    --trace-block-size", a flag the notebooks have not: their parameter is trace_block_size."""
    from papermill.exceptions import PapermillExecutionError

    path = tmp_path / "mooncake64.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 100, "output_length": 1, "hash_ids": [1, 2]}\n'
                    '{"timestamp": 5, "input_length": 100, "output_length": 1, "hash_ids": [1, 2]}\n')
    with pytest.raises(PapermillExecutionError) as caught:
        run_notebook(notebook, **{parameter: str(path), "limit": 2})
    said = f"{caught.value.ename}: {caught.value.evalue}"
    assert said.startswith("TraceFormatError: ") and "are the trace's ids of another block size?" in said, said
    assert "--trace-block-size" not in said and "trace_block_size" in said, said


def test_arrivals_far_apart_are_characterised_without_a_window_per_tenth_of_a_second(run_notebook, tmp_path):
    """Two requests 4e18 ns apart (a trace's valid times): the index of dispersion counted arrivals in
    every 0.1 s window of the span, 4e10 windows: "MemoryError: Unable to allocate 298. GiB" (or the
    kernel killed). Only the windows that hold arrivals are counted now; the empty ones add zeros."""
    path = tmp_path / "far.jsonl"
    path.write_text('{"kvtrace_trace":1,"block_size":16}\n'
                    '{"request_id":"a","arrival_ns":0,"input_length":64,"hash_ids":[1,2,3,4],"output_length":2}\n'
                    '{"request_id":"b","arrival_ns":1000000000,"input_length":64,"hash_ids":[1,2,5,6],"output_length":2}\n'
                    '{"request_id":"c","arrival_ns":4000000000000000000,"input_length":64,"hash_ids":[1,2,7,8],'
                    '"output_length":2}\n')
    result, _ = run_notebook("trace_characterisation", trace_path=str(path), capacities=[4, 8])
    dispersion = result["index_of_dispersion"]
    assert set(dispersion) == {"0.1", "1.0", "10.0", "60.0"}
    # three arrivals in n windows of w seconds: mean 3/n; two windows hold one or two (0 and 1 s apart)
    for w, d in dispersion.items():
        n = int(4e9 // float(w)) + 1
        counts = [2, 1] if float(w) > 1 else [1, 1, 1]
        mean = 3 / n
        var = (sum((c - mean) ** 2 for c in counts) + (n - len(counts)) * mean ** 2) / n
        assert d == pytest.approx(var / mean), (w, d)


def test_a_behaviour_beside_a_stores_runs_is_refused_not_ignored(run_notebook, tmp_path):
    """``-p behaviour external-hit-running-cow`` beside a store and its two run ids was ignored unsaid
    (the runs are compared as they are), as trace and limit were before they were refused."""
    from papermill.exceptions import PapermillExecutionError

    with pytest.raises(PapermillExecutionError) as caught:
        run_notebook("regression_analysis", db_path=str(tmp_path / "x.duckdb"), run_a="r1", run_b="r2",
                     behaviour="external-hit-running-cow")
    said = f"{caught.value.ename}: {caught.value.evalue}"
    assert said == ("KVTraceError: behaviour: study settings, for a study without db_path; a store's runs are "
                    "compared as they are"), said
