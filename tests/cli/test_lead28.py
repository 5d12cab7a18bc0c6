"""The lead's fixes of the twenty-eighth session's CLI findings."""

from __future__ import annotations

import pytest

from tests.cli.support import run


@pytest.mark.parametrize(("name", "text", "said"), [
    ("a\nb.csv", None, "no such file"),
    ("c\nd.csv", "x,y\n1,2\n", "missing column(s)"),
    ("e\nf.csv", "num_tokens,prefill_pairs,num_decode_seqs,decode_context_tokens,step_ms\n1,1,0,0,abc\n",
     "step_ms: expected"),
    ("g\nh.json", "{}", "input_lens, output_lens, ttfts, itls: missing"),
])
def test_calibrate_names_a_file_with_a_newline_as_typed(tmp_path, capsys, name, text, said):
    """Each --from file with a newline in its name was named with a space there instead:
    another file's name (the cli probe of the twenty-eighth session)."""
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    code, _, err = run(["calibrate", "--from", str(path)], capsys)
    shown = str(path).replace("\n", "\\n")
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"kvtrace: error: {shown}") and said in err


@pytest.mark.parametrize("mode", ["cache-only", "engine"])
def test_a_runs_latency_keys_are_its_percentiles_whatever_the_mode(mode):
    """A cache-only replay at --percentiles 10 also held p99_ttft_ms and p99_itl_ms (null), keys
    an engine run at the same percentiles has not: one summary, one set of keys."""
    from kvtrace.metrics import LATENCY_KEYS, is_latency_key, latency_keys
    from kvtrace.replay.run import RunSpec, run_replay

    content = {"content": False} if mode == "engine" else {}
    summary = run_replay(RunSpec("gen:chat", mode=mode, limit=3, percentiles=(10.0,), **content)).summary
    assert {k for k in summary if is_latency_key(k)} == {k for m in LATENCY_KEYS for k in latency_keys(m, (10.0,))}


def test_the_replay_summary_folds_a_digest_too_wide_for_the_terminal():
    """On an 80-column terminal the summary table cut the digest with an ellipsis: the one
    value a user copies to compare two runs (the cli probe)."""
    import io

    from rich.console import Console

    from kvtrace.replay.report import print_summary

    digest = "d2650e63a5ff3b15e6b62fdfdcde7176f580033741a1f70bbedd6e839882c2fe"
    screen = io.StringIO()
    print_summary({"requests": 5, "digest": digest}, console=Console(file=screen, width=40, force_terminal=False))
    text = screen.getvalue()
    assert "…" not in text
    folded = "".join(line.split("│")[2].strip() for line in text.splitlines()
                     if line.count("│") == 3 and "requests" not in line and "metric" not in line)
    assert folded == digest, text
