"""A study stopped at a swept value says what it kept, as a sweep's line does (sweep33's report)."""

from __future__ import annotations

import re

import pytest

from kvtrace.compare import study as S
from kvtrace.errors import KVTraceError
from kvtrace.replay.run import RunSpec
from kvtrace.store import read


def test_a_study_stopped_at_a_swept_value_names_the_pairs_it_stored(tmp_path):
    """`study --sweep capacity_blocks=60,2 --db X` stopped at 2 in one line that said nothing of
    the pair at 60 it had stored: the line now says how many values' pairs the store keeps."""
    db = tmp_path / "s.duckdb"
    base = RunSpec(trace="", **S.study_defaults("external-hit-running-cow"), content=False)
    with pytest.raises(KVTraceError) as err:
        S.run_study("external-hit-running-cow", base=base, sweep="capacity_blocks=60,2", limit=2, db=str(db))
    line = str(err.value)
    assert "\n" not in line
    assert re.search(r"; the study stopped at capacity_blocks=2, 1 of 2 values' pairs stored$", line), line
    stored = read.runs(str(db))
    assert sum(1 for s in stored["status"].to_list() if s == "complete") == 2  # (the pair at 60)
