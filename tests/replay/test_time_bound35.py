"""A trace time past what kvtrace replays names the bound exactly (probe 35): the message
said "below 4,611,686,018" (seconds, rounded down) while 4,611,686,018.4 was taken."""

from __future__ import annotations

import json

from tests.cli.support import assert_one_line, run


def _bailian(tmp_path, ts: float):
    path = tmp_path / f"t{ts}.jsonl"
    row = {"chat_id": 0, "parent_chat_id": -1, "timestamp": ts, "input_length": 5, "output_length": 1,
           "type": "text", "turn": 1, "hash_ids": [0]}
    path.write_text(json.dumps(row) + "\n")
    return str(path)


def test_the_bound_said_is_the_bound_kept(tmp_path, capsys):
    code, _, err = run(["replay", _bailian(tmp_path, 4611686018.4), "--mode", "cache-only"], capsys)
    assert code == 0, err
    code, _, err = run(["replay", _bailian(tmp_path, 4611686018.5), "--mode", "cache-only"], capsys)
    assert_one_line(code, err, ":1: timestamp: 4611686018.5 is not a time kvtrace can replay",
                    "expected a finite number below 4,611,686,018.427387904)")
