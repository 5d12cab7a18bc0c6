"""capture_vllm refuses an API caller's arguments the CLI's flags cannot give before its run
is made: a topic, trace_out, seed, replay_timeout_s, should_stop or on_ready of another kind
was a traceback once a failed run was recorded for it, and run_name=5 was stored as '5'."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtrace.errors import KVTraceError
from kvtrace.instrument.vllm import capture_vllm
from kvtrace.store import read

ARGS = {
    "topic": 5, "trace_out": 5, "run_name": 5, "seed": "x", "replay_timeout_s": float("nan"),
    "should_stop": 5, "on_ready": "x", "replay_endpoint": 5,
}


@pytest.mark.parametrize(("name", "value"), ARGS.items(), ids=ARGS.keys())
def test_an_argument_of_another_kind_records_no_run(tmp_path: Path, name, value) -> None:
    db = tmp_path / "c.duckdb"
    with pytest.raises(KVTraceError, match=name) as err:
        capture_vllm("tcp://127.0.0.1:1", store_path=db, duration=0.1, **{name: value})
    assert "\n" not in str(err.value)
    assert not db.exists() or read.runs(db).is_empty()
