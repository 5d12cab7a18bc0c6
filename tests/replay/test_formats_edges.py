"""Trace formats at their edges: what a probe of the readers, ``convert`` and the writers
found, each held here."""

from __future__ import annotations

import json

from kvtrace.replay.readers import detect_format, read_trace
from kvtrace.workload import lines
from tests.cli.support import assert_one_line, run


def _conversation(n: int) -> dict:
    return {"id": "c", "block_size": 64, "hash_id_scope": "local",
            "requests": [{"t": float(i), "in": 150, "out": 3, "hash_ids": [1, 2]} for i in range(n)]}


def test_a_weka_conversation_on_one_line_longer_than_a_trace_line_is_detected(tmp_path, monkeypatch, capsys):
    """A conversation is one JSON document, read whole up to 256 MiB; written on one line
    (``json.dump``'s way) past the 64 MiB a line format's line may have, detection refused
    it as 'line longer than 64 MiB; expected one request a line', while ``--format weka``
    (or its directory) read it."""
    monkeypatch.setattr(lines, "MAX_LINE_BYTES", 1 << 10)  # (the bound, at a size a test can write)
    conv = tmp_path / "conv.json"
    conv.write_text(json.dumps(_conversation(40)))
    assert conv.stat().st_size > lines.MAX_LINE_BYTES and "\n" not in conv.read_text()
    assert detect_format(str(conv)) == "weka"
    assert len(read_trace(conv)) == 40
    code, out, err = run(["replay", str(conv), "--mode", "cache-only", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["requests"] == 40
    # a line format's file of such a line is still refused at it
    jsonl = tmp_path / "conv.jsonl"
    jsonl.write_text(conv.read_text() + "\n")
    code, _, err = run(["replay", str(jsonl), "--mode", "cache-only"], capsys)
    assert_one_line(code, err, f"{jsonl}:1: line longer than")
