"""What the docs say of the engine's step spans, held to a replay (session 25's calibration
probe: a prompt's lone last token counted as a decode in the step span and as a prompt token
in the request span, and the README's "prefill tokens scheduled" said neither)."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_a_lone_last_prompt_token_runs_as_a_decode_as_the_readme_says(tmp_path, capsys):
    from tests.cli.support import run

    trace = tmp_path / "t.jsonl"
    prompts = {"one": [7], "three": [1, 2, 3]}  # a 1-token prompt, and one computed in a single chunk
    trace.write_text(json.dumps({"kvtrace_trace": 1}) + "\n" + "".join(
        json.dumps({"request_id": rid, "arrival_ns": i * 10**9, "input_length": len(toks), "output_length": 2,
                    "token_ids": toks}) + "\n" for i, (rid, toks) in enumerate(prompts.items())))
    db = str(tmp_path / "s.duckdb")
    code, _, err = run(["replay", str(trace), "--preset", "dense-attention", "--no-content", "--db", db], capsys)
    assert code == 0, err
    con = duckdb.connect(db, read_only=True)
    try:
        prefill, decodes = con.execute("SELECT sum(num_prefill_tokens), sum(num_decode_seqs) FROM spans "
                                       "WHERE name = 'kvtrace.engine.step'").fetchone()
        computed = con.execute("SELECT sum(num_computed_tokens) FROM spans WHERE name = 'kvtrace.request'").fetchone()
    finally:
        con.close()
    # the request spans count both prompts whole; the steps count the 1-token one as a decode
    assert computed[0] == 4
    assert prefill == 3
    assert decodes == 1 + 2  # the lone prompt token, then one decode of each request's second output token
    assert "a chunk of one token that samples (a 1-token prompt, or a prompt's last token alone)" in README
