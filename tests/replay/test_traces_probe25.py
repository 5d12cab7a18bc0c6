"""The twenty-fifth probe of trace readers, convert and generate: what a conversion leaves of
its input, and what the numbers read say, against an independent reading of the trace."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvtrace.replay.readers import read_trace
from tests.cli.support import assert_one_line, run

WEKA = Path(__file__).resolve().parents[1] / "data" / "formats" / "weka"


@pytest.mark.parametrize("name", ["all.json", "ALL.JSON", "all.json.gz"])
def test_a_conversion_of_a_weka_folder_is_never_written_among_its_conversations(tmp_path, capsys, name):
    """`kvtrace convert wk -o wk/all.json` wrote the native JSONL into the folder it read,
    exit 0, and every later read of the folder refused that file (`wk/all.json:1: Object
    missing required field block_size`, or a compressed or upper-case name): the input trace
    broken by its own conversion. Refused before any work; the folder reads as it did."""
    folder = tmp_path / "wk"
    shutil.copytree(WEKA, folder)
    before = sorted(p.name for p in folder.iterdir())
    requests = read_trace(folder)
    code, _, err = run(["convert", str(folder), "-o", str(folder / name)], capsys)
    assert_one_line(code, err, name, "WEKA folder", "write the output elsewhere")
    assert sorted(p.name for p in folder.iterdir()) == before
    assert read_trace(folder) == requests


def test_a_conversion_of_a_weka_folder_may_go_beside_its_conversations(tmp_path, capsys):
    """What the folder's read never takes (a .jsonl, a hidden file) is written there as before,
    and the folder reads the same requests afterwards."""
    folder = tmp_path / "wk"
    shutil.copytree(WEKA, folder)
    requests = read_trace(folder)
    for name in ("all.jsonl", ".all.json"):
        code, _, err = run(["convert", str(folder), "-o", str(folder / name)], capsys)
        assert code == 0, err
        assert read_trace(folder / name) == requests
    assert read_trace(folder) == requests
