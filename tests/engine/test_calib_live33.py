"""calibrate's inputs: the thirty-third session's live/calibrate probe."""

from __future__ import annotations

import json

import pytest

from kvtrace.errors import KVTraceError
from kvtrace.replay.calibrate import calibrate

_BENCH = {"input_lens": [100, 200, 300], "output_lens": [10, 10, 10], "ttfts": [0.01, 0.02, 0.03],
          "itls": [[0.005] * 9] * 3}


def test_a_bench_result_that_gives_a_key_twice_is_refused_naming_it(tmp_path):
    """JSON leaves which of a repeated key's values counts to the reader: a bench result that
    gave input_lens twice was fitted on the last one without a word (trace files refuse such a
    key, as kvtrace takes neither)."""
    body = json.dumps(_BENCH)[1:]
    path = tmp_path / "bench.json"
    path.write_text('{"input_lens": [1, 2, 3], ' + body)
    with pytest.raises(KVTraceError, match=r"bench\.json: key `input_lens` given twice"):
        calibrate([str(path)], name="x")


def test_a_key_given_twice_with_the_same_value_or_a_key_calibrate_does_not_read_is_taken(tmp_path):
    body = json.dumps(_BENCH)[1:]
    path = tmp_path / "bench.json"
    path.write_text('{"itls": ' + json.dumps(_BENCH["itls"]) + ', "model_id": "a", "model_id": "b", ' + body)
    assert calibrate([str(path)], name="x").model.name == "x"


def test_a_live_capture_named_by_run_is_called_one_not_a_replay(tmp_path):
    """--run naming a `kvtrace capture vllm` run (mode live) was refused as "it is a replay (live
    mode)": a capture of KV events is no replay. It is called what `runs` calls it."""
    from kvtrace.instrument.vllm import capture_vllm

    db = tmp_path / "s.duckdb"
    stats = capture_vllm(f"ipc://{tmp_path}/nobody", store_path=db, duration=0)
    with pytest.raises(KVTraceError) as info:
        calibrate([str(db)], name="x", run_id=stats.run_id)
    assert "run r1: no vLLM llm_request spans: it is a live capture, not a collected run" in str(info.value)
    assert "replay" not in str(info.value)
