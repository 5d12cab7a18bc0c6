"""The re-probe of the trace readers' and curve's fixes of the twenty-seventh session."""

from __future__ import annotations

import pytest

from kvtrace.errors import TraceFormatError
from kvtrace.replay.readers import open_trace

_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"


@pytest.mark.parametrize(("row", "field"), [
    ("2023-11-16 18:15:46.68,374,44\x00", 3),   # (GeneratedTokens: said field 1)
    ("2023-11-16 18:15:46.68,3\x0074,44", 2),   # (ContextTokens: said field 1)
    ("2023-11-16 18:15:46.68\x00,374,44", 1),
])
def test_a_nul_in_an_azure_row_is_named_at_its_own_field(tmp_path, row, field):
    path = tmp_path / "n.csv"
    path.write_text(f"{_HEADER}\n{row}\n", encoding="utf-8")
    with pytest.raises(TraceFormatError, match=rf"n\.csv:2: a NUL byte .* in field {field}:"):
        list(open_trace(str(path)))


def test_a_nul_in_an_azure_column_kvtrace_does_not_read_is_refused_too(tmp_path):
    """docs/trace-format.md: a NUL byte is refused naming its line; in an extra column it was read as text."""
    path = tmp_path / "n.csv"
    path.write_text(f"{_HEADER},Note\n2023-11-16 18:15:46.68,374,44,a\x00\n", encoding="utf-8")
    with pytest.raises(TraceFormatError, match=r"n\.csv:2: a NUL byte .* in field 4:"):
        list(open_trace(str(path)))


@pytest.mark.timeout(600)
def test_an_engine_curve_with_a_tier_gives_each_points_external_hit_rate_as_its_run_does():
    """Its note sent the user to its runs' external_prefix_cache_hit_rate, without a store
    (no run to look at) and not in --json at all (re-probe C)."""
    from kvtrace.replay.curve import run_curve
    from kvtrace.replay.run import RunSpec, run_replay

    spec = RunSpec("gen:mixed", mode="engine", limit=30, external_capacity_blocks=64, content=False)
    curve = run_curve(spec, "100,200")
    got = curve.to_json()
    assert got["external_tier"] is True
    single = run_replay(RunSpec("gen:mixed", mode="engine", limit=30, external_capacity_blocks=64, content=False,
                                capacity_blocks=100)).summary
    assert got["points"][0]["external_prefix_cache_hit_rate"] == single["external_prefix_cache_hit_rate"] > 0
    header = curve.table()[0]
    assert "external tier hit rate" in header and "see its runs" not in curve.method_note()


def test_a_cache_only_curve_takes_the_default_percentiles_in_any_order_and_refuses_others():
    from kvtrace.errors import ConfigError
    from kvtrace.replay.curve import run_curve
    from kvtrace.replay.run import RunSpec

    for given in ((99.0, 50.0, 90.0), (50.0, 50.0, 90.0, 99.0)):
        assert run_curve(RunSpec("gen:chat", mode="cache-only", limit=5, percentiles=given), "auto").points
    with pytest.raises(ConfigError, match="--percentiles"):
        run_curve(RunSpec("gen:chat", mode="cache-only", limit=5, percentiles=(50.0, 90.0)), "auto")


def test_a_vllm_coordinator_without_the_per_group_lookup_is_refused_for_several_groups(monkeypatch):
    """Without it each group's hit is unknown: the request's was written into every group,
    unmarked, and read as the groups' own hit rates (re-probe D)."""
    import vllm.v1.core.kv_cache_coordinator as coordinators

    from kvtrace.errors import KVTraceError
    from kvtrace.replay.run import RunSpec, run_replay

    monkeypatch.delattr(coordinators.HybridKVCacheCoordinator, "find_longest_cache_hit_per_group")
    with pytest.raises(KVTraceError, match="has no find_longest_cache_hit_per_group"):
        run_replay(RunSpec("gen:mixed", backend="vllm", capacity_blocks=100, content=False, limit=5))
    one_group = run_replay(RunSpec("gen:mixed", backend="vllm", preset="dense-attention", content=False, limit=5))
    assert one_group.summary["requests"] == 5  # (one KV group: nothing to look up per group)


def test_the_conformance_reports_disagreement_counts_and_steps_have_their_separators():
    """'<- 1984 disagree' beside '2,002 / 4,069' on one row; 'at step 12345' (re-probe D)."""
    from collections import Counter

    from kvtrace.cache import CacheConfig, FullAttentionSpec
    from kvtrace.replay.conformance import ConformanceResult, ConformanceRun, Disagreement, format_report

    run = ConformanceRun(120, CacheConfig(groups=(FullAttentionSpec(512),), num_gpu_blocks=120, hash_block_size=512),
                         compared=Counter({"hit_tokens": 4069}), agreed=Counter({"hit_tokens": 2085}),
                         first=Disagreement("hit_tokens", 12345, "r1", 512, 0),
                         stopped="step 12,345: the managers parted on allocation (request r1)")
    lines = format_report(ConformanceResult("t.jsonl", "dense-attention", "0.33.0", [run]))
    row = next(line for line in lines if line.lstrip().startswith("hit_tokens"))
    assert row.endswith("<- 1,984 disagree"), row
    assert any(line.strip() == "first disagreement: hit_tokens at step 12,345, request r1" for line in lines), lines


def test_calibrates_csv_and_a_toml_config_name_their_encoding_and_nul_bytes_as_the_trace_readers_do(tmp_path):
    """UTF-16 step timings read 'unreadable CSV header (... open the file in universal-newline
    mode?)', a file padded with zeros '39: 1 fields; the header has 6', a UTF-16 TOML 'Invalid
    initial character for a key part' (re-probe C)."""
    from pathlib import Path

    from kvtrace.errors import ConfigError, KVTraceError
    from kvtrace.replay.calibrate import step_csv_observations
    from kvtrace.replay.config_file import load_config_file

    source = Path(__file__).parents[1] / "data" / "calibration" / "aic-h200-llama-3.1-8b-tp1.csv"
    text = source.read_text(encoding="utf-8")
    wide = tmp_path / "wide.csv"
    wide.write_bytes(text.encode("utf-16-le"))
    with pytest.raises(KVTraceError, match=r"wide\.csv: UTF-16LE text without a byte-order mark; .*iconv"):
        step_csv_observations(str(wide))
    padded = tmp_path / "padded.csv"
    padded.write_bytes(text.encode() + b"\x00" * 300)
    lines = text.count("\n")
    with pytest.raises(KVTraceError, match=rf"padded\.csv:{lines + 1}: a NUL byte .* in field 1"):
        step_csv_observations(str(padded))
    toml = tmp_path / "c.toml"
    toml.write_bytes('preset = "kimi-hybrid"\n'.encode("utf-16"))
    with pytest.raises(ConfigError, match=r"c\.toml: UTF-16 text; kvtrace reads TOML configs as UTF-8"):
        load_config_file(toml)


def test_a_parquet_or_duckdb_file_given_as_a_config_or_step_timings_is_named_as_not_what_was_expected(tmp_path):
    """They were "not a trace; a store is given as --db STORE" (re-probe E)."""
    from kvtrace.errors import ConfigError, KVTraceError
    from kvtrace.replay.calibrate import step_csv_observations
    from kvtrace.replay.config_file import load_config_file

    parquet = tmp_path / "p.toml"
    parquet.write_bytes(b"PAR1" + b"\x00" * 64)
    with pytest.raises(ConfigError, match=r"a Parquet file .*not one of the TOML configs kvtrace reads here"):
        load_config_file(parquet)
    store = tmp_path / "s.csv"
    store.write_bytes(b"\x00" * 8 + b"DUCK" + b"\x00" * 64)
    with pytest.raises(KVTraceError, match=r"a DuckDB database .*not one of the step timings kvtrace reads here"):
        step_csv_observations(str(store))
