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


def test_an_azure_prompt_of_the_largest_context_fits_its_ids_at_one_token_a_block(tmp_path, monkeypatch):
    """ContextTokens runs from 1 to MAX_CONTEXT_TOKENS (2^24, the page says), and request i's
    ids are (i << 24) + j: 2^24 of them fit. At --trace-block-size 1 a row of 2^24 tokens was
    refused as 'too long for block_size 1' (the bound was >=). Shrunk here (a 2^24-id request
    is half a GB of ints): the bound and the ids' room alike, to 16."""
    from kvtrace.replay.readers import azure

    monkeypatch.setattr(azure, "MAX_CONTEXT_TOKENS", 16)
    monkeypatch.setattr(azure, "_BLOCKS_PER_REQUEST", 16)
    trace = tmp_path / "az.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,16,1\n"
                     "2023-11-16 18:15:47.0000000,16,1\n")
    first, second = read_trace(trace, block_size=1)
    assert first.hash_ids is not None and second.hash_ids is not None
    assert len(first.hash_ids) == second.input_length == 16
    assert not set(first.hash_ids) & set(second.hash_ids)
