"""The run driver: recorded runs, failures mid-run, determinism of stored rows."""

from __future__ import annotations

from dataclasses import replace

import duckdb
import pytest

from kvtrace.errors import ConfigError, TraceFormatError
from kvtrace.replay.generate import write_generated
from kvtrace.replay.run import RunSpec, run_replay
from tests.conftest import TRACES

MOONCAKE = TRACES / "mooncake_synthetic_trace.jsonl"


def _rows(db, sql, params=()):
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute(sql, list(params)).fetchall()
    finally:
        con.close()


def test_failure_mid_run_keeps_spans_and_marks_run_failed(tmp_path, monkeypatch):
    from kvtrace.replay.readers import source

    # (a bad line among the first requests is refused before the run is created: this one
    # must come after those read before the trace is hashed)
    monkeypatch.setattr(source, "CHECKED_BEFORE_DIGEST", 5)
    trace = tmp_path / "t.jsonl"
    write_generated("chat", trace, seed=3, num_requests=20)
    with open(trace, "a") as f:
        f.write('{"arrival_ns": 999999999999, "input_length": -1}\n')
    db = tmp_path / "runs.duckdb"
    with pytest.raises(TraceFormatError) as err:
        run_replay(RunSpec(str(trace), preset="dense-attention"), db=db)
    assert "t.jsonl:22" in str(err.value)
    (status,) = _rows(db, "SELECT status FROM runs")[0]
    assert status == "failed"
    # Every span emitted before the bad line is stored, none lost in the instrumentor's buffer.
    n_spans = _rows(db, "SELECT count(*) FROM otel_traces")[0][0]
    n_requests = _rows(db, "SELECT count(*) FROM otel_traces WHERE SpanName = 'kvtrace.request'")[0][0]
    # The bad line is read ahead while request 20 is in flight, so 19 finished before it.
    assert n_spans > 0 and n_requests == 19


def test_same_replay_stores_identical_rows(tmp_path):
    rows = []
    for name in ("a", "b"):
        db = tmp_path / f"{name}.duckdb"
        run_replay(RunSpec("gen:chat", limit=12, name="same"), db=db)
        rows.append(_rows(db, 'SELECT "TraceId", "SpanId", "ParentSpanId", "SpanName", "Timestamp", "Duration", '
                              'CAST("SpanAttributes" AS VARCHAR) FROM otel_traces ORDER BY "Timestamp", "SpanId"'))
    assert rows[0] and rows[0] == rows[1]


def test_store_summary_equals_returned_summary(tmp_path):
    db = tmp_path / "runs.duckdb"
    res = run_replay(RunSpec("gen:chat", limit=10), db=db)
    from kvtrace.store import read

    stored = read.run(str(db), res.run_id)
    assert stored["status"] == "complete"
    assert stored["digest"] == res.summary["digest"]


@pytest.mark.parametrize("flag, setting", [
    ("--preset", {"preset": "dense-attention"}),
    ("--config", {"config_file": "cache.toml"}),
    ("--retention", {"retention": "0"}),
    ("--without", {"without": ("shared-prefix-pinning",)}),
    ("--external-blocks", {"external_capacity_blocks": 100}),
])
def test_cache_only_refuses_engine_settings_and_records_no_run(tmp_path, flag, setting):
    from kvtrace.errors import ConfigError

    trace = tmp_path / "t.jsonl"
    write_generated("chat", trace, seed=1, num_requests=5, fmt="mooncake")
    db = tmp_path / "runs.duckdb"
    with pytest.raises(ConfigError, match=f"^{flag}: .*applies to engine mode only"):
        run_replay(RunSpec(str(trace), mode="cache-only", capacity_blocks=64, **setting), db=db)
    assert not db.exists()  # refused before the store was even opened


def test_cache_only_without_a_capacity_is_unbounded_and_engine_mode_refuses_inf():
    import math

    from kvtrace.replay.run import parse_capacity_blocks

    assert parse_capacity_blocks("inf") == math.inf and parse_capacity_blocks("12") == 12
    with pytest.raises(ConfigError, match="--capacity-blocks: lots"):
        parse_capacity_blocks("lots")
    s = run_replay(RunSpec(str(MOONCAKE), mode="cache-only", limit=300)).summary
    bounded = run_replay(RunSpec(str(MOONCAKE), mode="cache-only", limit=300, capacity_blocks=200)).summary
    assert s["capacity_blocks"] is None and s["evictions"] == 0
    assert s["prefix_cache_hits"] > bounded["prefix_cache_hits"] and bounded["evictions"] > 0
    with pytest.raises(ConfigError, match="--capacity-blocks: inf: engine mode"):
        run_replay(RunSpec(str(MOONCAKE), capacity_blocks=math.inf, limit=5))


def test_a_block_size_that_scales_the_presets_pool_beyond_the_limit_names_the_flag():
    """kimi-hybrid's ~4.2M-token pool in 1-token blocks: refused as "CacheConfig:
    num_gpu_blocks: ...", a setting the user never gave."""
    from kvtrace.replay.run import validate

    with pytest.raises(ConfigError, match=r"^--block-size: 1: kimi-hybrid's pool in 1-token blocks is 4,195,841 "
                                          r"blocks, .*give --capacity-blocks or --capacity-tokens with it$"):
        validate(RunSpec("gen:chat", block_size=1, content=False))
    validate(RunSpec("gen:chat", block_size=1, capacity_blocks=5000, content=False))  # a pool given: accepted


def test_default_run_names_tell_apart_runs_of_other_settings(tmp_path):
    """Runs that differ in --config, --block-size, --capacity-tokens or --external-blocks all
    read `gen:mixed engine kimi-hybrid blocks=30` in `kvtrace runs`."""
    from kvtrace.replay.run import _default_name

    config = tmp_path / "tight.toml"
    specs = [RunSpec("gen:mixed", capacity_blocks=30), RunSpec("gen:mixed", capacity_blocks=30, block_size=256),
             RunSpec("gen:mixed", capacity_blocks=30, external_capacity_blocks=100),
             RunSpec("gen:mixed", capacity_blocks=30, config_file=str(config)),
             RunSpec("gen:mixed", capacity_tokens=30)]
    names = [_default_name(s, []) for s in specs]
    assert len(set(names)) == len(names), names
    assert names[0] == "gen:mixed engine kimi-hybrid blocks=30" and names[3].endswith("config=tight.toml")


@pytest.mark.parametrize("backend", ["duckdb", "chdb"])
def test_a_limit_past_the_traces_end_replays_the_same_trace(tmp_path, backend):
    """`--limit 100000` on a 3,993-request trace replays the whole trace, yet its runs and
    curves named another one (`diff` refused the pair as different traces); so did
    `--limit 3993`, the trace's length (the reader now reads one request past a limit).
    (Here the trace's first 150 requests: the length, not the size, is the subject.)"""
    from kvtrace.replay.curve import run_curve
    from kvtrace.store import read

    db = f"chdb:{tmp_path / 'ch'}" if backend == "chdb" else str(tmp_path / "s.duckdb")
    trace = tmp_path / "mooncake150.jsonl"
    with open(MOONCAKE) as f:
        trace.write_text("".join(next(f) for _ in range(150)))
    spec = RunSpec(str(trace), mode="cache-only", capacity_blocks=500)
    # (150: the trace's length; 149: one request short)
    ids = {limit: run_replay(replace(spec, limit=limit), db=db).run_id for limit in (None, 100_000, 100, 150, 149)}
    digest = {limit: read.run(db, run_id)["trace_digest"] for limit, run_id in ids.items()}
    assert digest[100_000] == digest[None] == digest[150] != digest[100]
    assert len({digest[None], digest[100], digest[149]}) == 3
    if backend == "duckdb":
        curves = [run_curve(replace(spec, capacity_blocks=None, limit=limit), "100,200", db=db) for limit in
                  (None, 100_000)]
        assert curves[0].curve_id == curves[1].curve_id
        assert set(read.curves(db)["trace_digest"].to_list()) == {digest[None]}
        from kvtrace.replay.sweep import run_sweep

        sweeps = {limit: run_sweep(replace(spec, capacity_blocks=None, limit=limit), [("capacity_blocks", [300])],
                                   workers=1).sweep_id for limit in (None, 100_000, 100)}
        assert sweeps[100_000] == sweeps[None] != sweeps[100]


def test_an_engine_curve_limited_to_its_traces_length_is_the_whole_traces(tmp_path):
    """An engine curve's runs are replayed by its workers: the curve's own id read the trace
    past the limit itself (`--limit 8` on an 8-request file named another trace)."""
    from kvtrace.replay.curve import run_curve
    from kvtrace.store import read

    trace = tmp_path / "m8.jsonl"
    trace.write_text("".join(MOONCAKE.read_text().splitlines(keepends=True)[:8]))
    spec = RunSpec(str(trace), content=False)
    ids = {limit: run_curve(replace(spec, limit=limit), "400,800", db=str(tmp_path / f"c{limit}.duckdb"),
                            workers=1).curve_id for limit in (None, 8, 7)}
    assert ids[None] == ids[8] != ids[7]
    digests = {limit: set(read.runs(str(tmp_path / f"c{limit}.duckdb"))["trace_digest"]) for limit in (None, 8)}
    assert digests[None] == digests[8] and len(digests[8]) == 1


def test_a_limit_reads_one_request_past_it_and_a_bad_one_there_is_no_error(tmp_path):
    """--limit 3 read up to 1,000 requests past the limit (the pre-read before the trace's
    digest ignored it): a bad line 6 requests later failed the replay, the sweep and the study."""
    lines = MOONCAKE.read_text().splitlines(keepends=True)
    for bad_at in (3, 6):  # (the request right after the limit, and one three requests later)
        trace = tmp_path / f"t{bad_at}.jsonl"
        trace.write_text("".join(lines[:bad_at]) + '{"timestamp": "x"}\n' + "".join(lines[bad_at:bad_at + 3]))
        res = run_replay(RunSpec(str(trace), mode="cache-only", limit=3))
        assert res.summary["requests"] == 3
        assert res.record["trace_digest"].endswith(":limit=3")  # (the file holds more: another trace)
