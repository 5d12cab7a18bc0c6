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
