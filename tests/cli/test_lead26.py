"""Fixes the lead made from the twenty-sixth session's probes (each named in its test)."""

from __future__ import annotations

from tests.cli.support import run

CALIBRATION = "tests/data/calibration/aic-h200-llama-3.1-8b-tp1.csv"


def test_calibrate_to_dev_null_does_not_advise_config_dev_null(capsys):
    """`kvtrace calibrate -o /dev/null` said "use it with: kvtrace replay TRACE --config
    /dev/null", which reads nothing back (docs probe)."""
    code, _, err = run(["calibrate", "--from", CALIBRATION, "-o", "/dev/null"], capsys)
    assert code == 0, err
    assert "--config /dev/null" not in err
    assert "wrote the cost model to /dev/null (not a file" in err


def test_calibrate_to_a_file_says_how_to_use_it(tmp_path, capsys):
    out = tmp_path / "model.toml"
    code, _, err = run(["calibrate", "--from", CALIBRATION, "-o", str(out)], capsys)
    assert code == 0, err
    assert f"use it with: kvtrace replay TRACE --config {out}" in err and out.is_file()


def test_curve_help_says_auto_is_cache_only(capsys):
    """`curve --mode engine` refuses the default `--capacities auto`, where its help said
    nothing of it (docs probe)."""
    code, out, _ = run(["curve", "--help"], capsys)
    assert code == 0
    flat = " ".join(out.replace("│", " ").split())
    assert "auto, cache-only mode" in flat and "Engine mode: explicit block counts (no auto, no inf)" in flat


def _steps_csv(path, attn_pair_ps: int) -> None:
    """Steps whose times are their attention pairs and KV reads alone (no overhead, no per-token cost)."""
    rows = ["num_tokens,prefill_pairs,num_decode_seqs,decode_context_tokens,step_ms,label"]
    for t in (128, 300, 512, 700, 1024, 2048, 4096):
        pairs = t * (t + 1) // 2
        rows.append(f"{t},{pairs},0,0,{pairs * attn_pair_ps * 1e-9:.9f},prefill {t}")
    for seqs, context in ((1, 1000), (4, 8000), (8, 5000), (16, 40000), (32, 100000), (64, 300000)):
        rows.append(f"{seqs},0,{seqs},{context},{context * 3e-5:.9f},decode {seqs}")
    path.write_text("\n".join(rows) + "\n")


def test_calibrate_does_not_write_a_model_replay_would_refuse(tmp_path, capsys):
    """A fit of no step overhead and no per-token cost, its pairs under a ns each, priced a short
    prefill at 0 ns (a TTFT of 0 ms); --config refuses such a model, so -o does not write it
    (engine probe)."""
    csv, out = tmp_path / "steps.csv", tmp_path / "model.toml"
    _steps_csv(csv, attn_pair_ps=500)
    code, _, err = run(["calibrate", "--from", str(csv), "-o", str(out)], capsys)
    assert code == 2 and not out.exists()
    assert err.strip().splitlines()[-1].startswith(f"kvtrace: error: -o {out}: not written: ")
    assert "a prefill of a few tokens would take 0 ns" in err
    _steps_csv(csv, attn_pair_ps=2_000)  # (each pair 2 ns: every step takes time)
    code, _, err = run(["calibrate", "--from", str(csv), "-o", str(out)], capsys)
    assert code == 0 and out.is_file(), err


def test_a_belady_runs_lookups_name_their_prefix_and_first_miss_as_its_lru_twins_do(tmp_path, capsys):
    """A Belady run's lookup spans had no root hash and no first-miss hash: its dashboard had no
    prefix-reuse table and no reuse-gap histogram (dashboard probe). They name the blocks an LRU
    replay of the trace names."""
    import duckdb

    db = str(tmp_path / "s.duckdb")
    for policy in ("lru", "belady"):
        code, _, err = run(["replay", "gen:mixed", "--limit", "60", "--mode", "cache-only", "--policy", policy,
                            "--capacity-blocks", "50", "--db", db], capsys)
        assert code == 0, err
    with duckdb.connect(db, read_only=True) as con:
        rows = con.execute(
            "SELECT a.root_hash, b.root_hash, a.first_miss_index, b.first_miss_index, a.first_miss_hash, "
            "b.first_miss_hash FROM spans a JOIN spans b USING (request_id) WHERE a.run_id = 'r1' AND "
            "b.run_id = 'r2' AND a.name = 'kvtrace.cache.lookup' AND b.name = a.name").fetchall()
    assert len(rows) == 60
    assert all(lru_root is not None and lru_root == belady_root for lru_root, belady_root, *_ in rows)
    same_miss = [r for r in rows if r[2] == r[3] and r[2] >= 0]
    assert same_miss and all(r[4] == r[5] is not None for r in same_miss)
    assert all((r[5] is None) == (r[3] == -1) for r in rows)


def test_small_values_keep_their_digits_in_the_summary_and_diff_tables():
    """A run's 3e-05 output tokens/s read 0.0000 in diff (beside +50%), 1 hit in 30,002 queries
    0.00% in the replay table, and 0.0015 showed coarser (0.002) than 0.00099 (re-probe C)."""
    from kvtrace.compare.model import diff_summaries
    from kvtrace.compare.render import fmt, to_markdown
    from kvtrace.replay.report import format_value

    assert format_value("prefix_cache_hit_rate", 1 / 30002) == "0.0033%"
    assert format_value("prefix_cache_hit_rate", 0.5) == "50.00%"
    assert [format_value("x", v) for v in (0.0015, 0.00099, 0.00455, 0.25)] == ["0.0015", "0.00099", "0.00455",
                                                                               "0.250"]
    md = to_markdown(diff_summaries({"output_tok_per_s": 2e-5, "median_itl_ms": 4.56},
                                    {"output_tok_per_s": 3e-5, "median_itl_ms": 4.56 - 3e-6}))
    assert "| output_tok_per_s | 2e-05 | 3e-05 | +1e-05 | +50.0% |" in md
    assert "| median_itl_ms | 4.560 | 4.560 | 0.0000 |" in md  # (a sub-µs latency change is still none)
    assert fmt(-3e-6, signed=True) == "0.0000" and fmt(3e-5) == "3e-05"


def test_a_tiny_hit_rate_keeps_its_digits_in_curve_sweep_study_and_dashboard_tables():
    """16 hit tokens in 416,000 read 0.00% in a curve, (+0.00 pp) in a sweep and the notebook's
    verdict, 0.0% on the Overview tile, beside the replay table's 0.0038% (re-probe F): one
    rule, metrics.percent_text and points_text."""
    from kvtrace.compare.study import _delta_cell
    from kvtrace.dashboard import ui
    from kvtrace.metrics import percent_text, points_text

    rate = 16 / 416_000
    assert percent_text(rate) == "0.0038%" and percent_text(0.2306) == "23.06%" and percent_text(0) == "0.00%"
    assert points_text(-rate) == "-0.0038 pp" and points_text(0.0255) == "+2.55 pp"
    # (the top end too: one miss in 416,000 read 100.00%; float noise is no change)
    assert percent_text(1 - 1 / 416_000) == "99.9998%" and percent_text(1.0) == "100.00%"
    assert points_text(-1e-12) == "+0.00 pp"
    assert ui.pct(rate) == "0.0038%" and ui.pct(0.2306) == "23.1%"
    assert _delta_cell("prefix_cache_hit_rate", rate) == "+0.0038 pp"


def test_a_curve_table_shows_a_tiny_hit_rate_in_its_digits(tmp_path, capsys):
    from tests.support.traces import tiny_hit_trace

    trace = tiny_hit_trace(tmp_path / "t.jsonl")  # (16 hit tokens in 409,600)
    code, out, err = run(["curve", str(trace), "--capacities", "inf", "--policy", "lru"], capsys)
    assert code == 0, err
    assert "0.0039%" in out and "0.00%" not in out
