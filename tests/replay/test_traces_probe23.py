"""The twenty-third probe of trace readers, convert and generate: what their headers and
numbers say, against the trace they describe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtrace.replay.readers import native_header, read_trace
from tests.cli.support import run


def _mooncake(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": 600, "output_length": 1,
                                        "hash_ids": [i, 1000 + i]}) + "\n" for i in range(n)))
    return path


def _convert(capsys, *argv: str) -> None:
    code, _, err = run(["convert", *argv], capsys)
    assert code == 0, err


@pytest.mark.parametrize("first_limit", [None, 5])
def test_a_cut_of_a_converted_trace_says_how_many_of_the_first_source_it_keeps(tmp_path, capsys, first_limit):
    """A converted trace cut again (--limit 2) kept the earlier cut's converted_from_limit (5),
    or none (all of the source), in its header: 'how many of its requests are kept' said 5 or
    all of a file that holds 2 of them, until a further conversion said 2 of the same requests."""
    source = _mooncake(tmp_path / "m.jsonl", 8)
    once, twice, thrice = tmp_path / "once.jsonl", tmp_path / "twice.jsonl", tmp_path / "thrice.jsonl"
    _convert(capsys, str(source), "-o", str(once), *(("--limit", str(first_limit)) if first_limit else ()))
    _convert(capsys, str(once), "-o", str(twice), "--limit", "2")
    _convert(capsys, str(twice), "-o", str(thrice))
    cut, again = native_header(twice), native_header(thrice)
    kept = len(read_trace(twice))
    assert kept == 2 and cut["source_limit"] == 2 and cut["converted_from"].startswith("mooncake:sha256:")
    assert cut["converted_from_limit"] == kept, cut
    # the same requests say the same provenance, whichever file they are read from
    assert (again["converted_from"], again["converted_from_limit"]) == (cut["converted_from"], kept), again


def test_a_limit_that_cuts_nothing_leaves_the_first_sources_count_as_it_was(tmp_path, capsys):
    source = _mooncake(tmp_path / "m.jsonl", 8)
    once, twice = tmp_path / "once.jsonl", tmp_path / "twice.jsonl"
    _convert(capsys, str(source), "-o", str(once), "--limit", "5")
    _convert(capsys, str(once), "-o", str(twice), "--limit", "5")  # (all 5: no cut, no source_limit)
    header = native_header(twice)
    assert "source_limit" not in header and header["converted_from_limit"] == 5, header
