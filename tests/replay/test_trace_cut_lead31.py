"""A trace cut (or rewritten) in the middle of a line while kvtrace reads it is said to have
changed while it was read, as one cut at a line's end is: the reader met the cut line first
and named it as a bad line ('FILE:15001: invalid JSON: Input data was truncated'), as if the
trace were malformed where it was not; the files are looked at only every 16,384 requests."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvtrace.errors import KVTraceError
from kvtrace.replay.readers import open_trace

LINES = 20_000


@pytest.fixture
def trace(tmp_path: Path) -> tuple[Path, list[int]]:
    path, ends, at = tmp_path / "t.jsonl", [], 0
    with open(path, "w") as f:
        for i in range(LINES):
            line = json.dumps({"timestamp": i, "input_length": 1024, "output_length": 8,
                               "hash_ids": [i, i + 1]}) + "\n"
            f.write(line)
            at += len(line)
            ends.append(at)
    return path, ends


@pytest.mark.parametrize("limit", [None, LINES - 1])
def test_a_trace_cut_mid_line_while_read_is_said_to_have_changed(trace, limit) -> None:
    path, ends = trace
    requests = iter(open_trace(path, limit=limit))
    for _ in range(100):
        next(requests)
    os.truncate(path, ends[15_000] + 20)  # inside line 15,002
    with pytest.raises(KVTraceError, match="changed while kvtrace read it"):
        for _ in requests:
            pass


def test_a_bad_line_of_a_trace_nothing_changed_is_named_as_before(trace) -> None:
    path, ends = trace
    with open(path, "r+b") as f:
        f.seek(ends[15_000])
        f.write(b"x")  # line 15,002 no longer JSON, before the read: nothing changes while it reads
    with pytest.raises(KVTraceError, match=r":15002: "):
        for _ in open_trace(path):
            pass
