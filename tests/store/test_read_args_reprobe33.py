"""reprobe33: a percentile list the read API checks (1bf9312) is read once: a generator or
iterator was consumed by the check, and the function got an empty one: latency_summary said no
percentile and latency_percentiles {} of a run with samples, without a word."""

from __future__ import annotations

from kvtrace.replay.run import RunSpec, run_replay
from kvtrace.store import read
from tests.conftest import TRACES


def test_a_generator_of_percentiles_gives_them(tmp_path):
    db = str(tmp_path / "s.duckdb")
    run_replay(RunSpec(str(TRACES / "mooncake_synthetic_trace.jsonl"), limit=12), db=db)
    as_list = read.latency_percentiles(db, "r1", "ttft", [50, 90])
    assert len(as_list) == 2
    assert read.latency_percentiles(db, "r1", "ttft", (q for q in [50, 90])) == as_list
    assert read.latency_percentiles(db, "r1", qs=iter([50, 90])) == as_list
    summary = read.latency_summary(db, "r1", percentiles=(q for q in (50, 90)))
    assert summary == read.latency_summary(db, "r1", percentiles=[50, 90])
    assert summary["p90_ttft_ms"] is not None
