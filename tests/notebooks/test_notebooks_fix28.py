"""Notebook fixes of session 28 (fixdash): what the notebooks print agrees with the numbers
they print it of."""

from __future__ import annotations

import pytest

from kvtrace.errors import KVTraceError


def _printed(nb) -> str:
    return "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))


def test_a_sweep_that_reaches_every_unique_block_is_not_said_to_stop_short(run_notebook, tmp_path):
    """At a capacity holding all of a trace's unique blocks (no eviction: the reuse bound), the
    summary said the capacities "stop short of" unique + longest-request blocks, "where LRU may
    hit more"; a capacity of one block was "(1 blocks)"."""
    path = tmp_path / "two.jsonl"
    path.write_text('{"kvtrace_trace":1,"block_size":16}\n'
                    '{"request_id":"a","arrival_ns":0,"input_length":64,"hash_ids":[1,2,3,4],"output_length":2}\n'
                    '{"request_id":"b","arrival_ns":1000,"input_length":64,"hash_ids":[1,2,5,6],"output_length":2}\n')
    result, nb = run_notebook("trace_characterisation", trace_path=str(path), capacities=[1, 6])
    assert result["unique_blocks"] == 6 and result["lru_prefix_cache_hit_rate"][-1] > 0
    printed = _printed(nb)
    assert "stop short" not in printed and "may hit more" not in printed, printed
    assert "every unique block fits there" in printed
    assert "(1 blocks)" not in printed and "Belady headroom at the smallest capacity (1 block):" in printed


def test_a_stopped_run_against_a_finished_one_is_not_called_worse_on_its_sums(run_notebook, tmp_path):
    """A failed replay (5 requests done) against the same trace finished (150): the verdict called
    B "worse on computed_prompt_tokens" (a sum over 30 times the requests), and printed counts
    without thousands separators (``:g`` and raw ints: 8856, 1.23457e+06)."""
    from kvtrace.replay.run import RunSpec, run_replay

    db = tmp_path / "nb.duckdb"
    with pytest.raises(KVTraceError):  # a request bigger than the pool: the run fails, stored
        run_replay(RunSpec("gen:mixed", preset="dense-attention", capacity_blocks=200), db=db)
    run_replay(RunSpec("gen:mixed", preset="dense-attention", capacity_blocks=2000), db=db)
    out, _ = run_notebook("regression_analysis", db_path=str(db), run_a="r1", run_b="r2")
    metrics = out["metrics"]
    assert metrics["requests"]["a"] < metrics["requests"]["b"]  # what the test is about
    assert metrics["computed_prompt_tokens"]["a"] < metrics["computed_prompt_tokens"]["b"]
    counted = {"computed_prompt_tokens", "prompt_tokens", "prefix_cache_queries", "prefix_cache_hits", "requests"}
    assert not counted & set(out["worse"]) and not counted & set(out["better"]), out["verdict"]
    assert "did not replay the same requests" in out["verdict"]
    shifted = [(k, v) for k, v in out["evictions_by_publish_kind"].items() if k != "none" and v["a"] != v["b"]]
    assert shifted and max(v["b"] for _, v in shifted) >= 1000  # a count with a separator to show
    assert any(f"A {v['a']:,}, B {v['b']:,}." in out["verdict"] for _, v in shifted), out["verdict"]
