"""Fixes the lead made from the twenty-fifth session's probes (each named in its test)."""

from __future__ import annotations

import json

from tests.cli.support import run

TRACE = "tests/data/mooncake_synthetic_trace.jsonl"


def _ok(argv, capsys):
    code, out, err = run(argv, capsys)
    assert code == 0, err
    return out


def test_runs_lists_an_unbounded_cache_only_run_as_unbounded(tmp_path, capsys):
    """`kvtrace runs` showed "-" as the capacity of an unbounded cache-only run, as of a run
    that recorded none; curve and sweep tables call it unbounded (sweep probe)."""
    db = str(tmp_path / "s.duckdb")
    _ok(["replay", TRACE, "--mode", "cache-only", "--limit", "20", "--db", db], capsys)
    _ok(["replay", TRACE, "--mode", "cache-only", "--capacity-blocks", "50", "--limit", "20", "--db", db], capsys)
    listed = {r["capacity_blocks"]: r for r in json.loads(_ok(["runs", "--db", db, "--json"], capsys))["runs"]}
    assert listed[None]["unbounded"] is True and listed[50]["unbounded"] is False
    table = _ok(["runs", "--db", db], capsys)
    assert "unbounded×512" in table and "50×512" in table


def test_a_curve_the_store_cannot_take_is_printed_before_the_error(tmp_path, capsys, monkeypatch):
    """`kvtrace curve --db` on a store another process held waited, then exited 2 without the
    curve it had computed (sweep probe): the curve is shown first, then the store's one line."""
    from kvtrace.replay import curve
    from kvtrace.store.errors import StoreError

    def busy(db, *args):
        raise StoreError(str(db), "held by another process (timed out after 30 s)")

    monkeypatch.setattr(curve, "_record", busy)
    db = str(tmp_path / "s.duckdb")
    code, out, err = run(["curve", TRACE, "--limit", "40", "--capacities", "100,inf", "--db", db], capsys)
    assert code == 2 and "held by another process" in err
    assert "unbounded" in out and "lru hit rate" in out  # (the table, before the error)


def test_a_collected_cache_only_replays_backend_is_kvtraces_as_the_direct_runs():
    """A cache-only replay's config names no backend (it replays kvtrace's own LRU): collected,
    its run read backend None beside the direct run's kvtrace (collect probe)."""
    from kvtrace.metrics import backend_label, run_backend

    config = {"mode": "cache-only", "policy": "lru", "block_size": None, "capacity_blocks": 100}
    assert run_backend("otlp", config) == run_backend("cache-only/lru", config) == "kvtrace"
    assert backend_label("otlp", config) == "kvtrace"
    assert run_backend("otlp", {}) is None  # (a foreign sender's: unknown)


def test_conformance_names_its_eviction_count_as_vllms_removed_keys(capsys):
    """Conformance's "evictions" were vLLM's BlockRemoved entries, which leave out the moved keys
    and the external tier's evictions a replay's `evictions` counts: one word, two counts (vllm probe)."""
    code, out, err = run(["conformance", TRACE, "--limit", "12", "--capacity-blocks", "40"], capsys)
    assert code == 0, err
    assert "keys removed (vLLM's BlockRemoved entries;" in " ".join(out.split())
    assert " evictions, " not in out.split("keys removed")[0]
    code, out, err = run(["conformance", TRACE, "--limit", "12", "--capacity-blocks", "40", "--json"], capsys)
    assert code == 0, err
    (row,) = json.loads(out)["runs"]
    assert "keys_removed" in row and "evictions" not in row


def test_a_block_size_that_re_blocks_the_trace_past_memory_is_refused_up_front(capsys, tmp_path):
    """The Mooncake trace at --block-size 1 is 61M one-token blocks: the replay ran past 120 s
    and 5 GB (traces probe). It is refused before a block is made, naming the flag."""
    for i, argv in enumerate((["replay", TRACE, "--mode", "cache-only", "--block-size", "1", "--capacity-blocks",
                               "1000"], ["curve", TRACE, "--block-size", "1"])):
        db = tmp_path / f"s{i}.duckdb"
        code, out, err = run([*argv, "--db", str(db)], capsys)
        assert code == 2 and err.count("\n") == 1, err
        assert err.startswith("kvtrace: error: --block-size: 1: ") and "blocks of 1 token" in err
        # (refused before a run is created: a replay left a failed run of 0 spans, a curve an empty store)
        assert not db.exists(), argv
    code, _, err = run(["replay", TRACE, "--mode", "cache-only", "--block-size", "64", "--limit", "50"], capsys)
    assert code == 0, err  # (a size the bound allows still replays)


def test_a_collected_cache_only_replay_has_no_clock_as_its_direct_run():
    """Two collected cache-only replays' diff said "Times: as received over OTLP (the sender's own
    times ...)" where their direct runs say none (re-probe B): a collected replay's times are
    told by the mode its sender replayed in (``metrics.replayed_mode``)."""
    from kvtrace.compare.model import RunDiff
    from kvtrace.compare.render import times_note
    from kvtrace.metrics import replayed_mode

    cfg = {"mode": "cache-only", "policy": "lru", "capacity_blocks": 10}
    assert replayed_mode("otlp", cfg) == "cache-only/lru"
    assert replayed_mode("otlp", {"cache": {"groups": []}}) == "engine"
    assert replayed_mode("otlp", {}) == "otlp" and replayed_mode("engine", cfg) == "engine"
    run = {"run_id": "r1", "mode": "otlp", "replayed_mode": replayed_mode("otlp", cfg), "cost_model": None}
    note = times_note(RunDiff(run_a=run, run_b={**run, "run_id": "r2"}, metrics=[]))
    assert "no clock: cache-only" in note and "OTLP" not in note


def test_an_engine_curve_checks_its_store_before_any_replay(tmp_path, capsys, monkeypatch):
    """An engine curve on a store another process held ran every replay, then waited and
    failed, its curve neither shown nor recorded (re-probe A): the store is tried first."""
    from kvtrace.replay import sweep

    def never(*args, **kwargs):
        raise AssertionError("replayed before the store was tried")

    monkeypatch.setattr(sweep, "run_sweep", never)
    from kvtrace.store import Store
    from kvtrace.store.errors import StoreBusyError

    def held(cls, path, **kwargs):  # (as another process's hold ends after the lock timeout)
        raise StoreBusyError(str(path), "held by another process for more than 30 s")

    store = str(tmp_path / "held.duckdb")
    Store.open(store).close()  # (a store there already: one not there yet is made when the curve is recorded)
    monkeypatch.setattr(Store, "open", classmethod(held))
    code, _, err = run(["curve", TRACE, "--mode", "engine", "--capacities", "500,600", "--no-content", "--limit", "5",
                        "--workers", "1", "--db", store], capsys)
    assert code == 2 and err.count("\n") == 1 and "held by another process" in err, err


def test_a_diff_across_backends_says_publish_kinds_are_labelled_differently(tmp_path, capsys):
    """kvtrace's `boundary` publishes show as `full` under the vllm backend: a diff between the
    backends showed "boundary -15 / full +15" as a change, with no note (re-probe B)."""
    db = str(tmp_path / "s.duckdb")
    base = ["replay", "gen:mixed", "--limit", "30", "--capacity-blocks", "100", "--no-content", "--db", db]
    _ok(base, capsys)
    _ok([*base, "--backend", "vllm"], capsys)
    notes = json.loads(_ok(["diff", "r1", "r2", "--db", db, "--json"], capsys))["notes"]
    assert any("shows kvtrace's `boundary` publishes as `full`" in n for n in notes), notes


def test_a_refused_engine_curve_capacity_creates_no_store(tmp_path, capsys):
    """9625fe9 tried the store before the sweep checked each capacity: a refused --capacities 1
    left an empty store behind (re-probe C2). Each capacity is checked first, named as typed."""
    db = tmp_path / "e.duckdb"
    code, _, err = run(["curve", TRACE, "--mode", "engine", "--preset", "dense-attention", "--limit", "5",
                        "--capacities", "1", "--db", str(db)], capsys)
    assert code == 2 and err.startswith("kvtrace: error: --capacities: 1: "), err
    assert not db.exists()


def test_a_sweeps_block_size_past_the_re_blocking_bound_is_named_as_swept(tmp_path, capsys):
    """The bound named --block-size, a flag the sweep's user never typed (re-probe D)."""
    db = str(tmp_path / "s.duckdb")
    code, _, err = run(["sweep", TRACE, "--mode", "cache-only", "--param", "block_size=512,1", "--workers", "1",
                        "--db", db], capsys)
    assert code == 2 and "\nkvtrace: error: --param: block_size=1: the trace's prompts make more" in err, err
    assert "the sweep stopped at block_size=1, 1 of 2 combinations stored" in err


def test_an_engine_curve_over_a_bad_trace_leaves_no_store(tmp_path, capsys):
    """The store was tried, so made, before the replays read the trace: a bad line left an empty
    store behind (re-probe D). A store not there yet is made when the curve is recorded."""
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]}\n'
                     '{"timestamp": 1, "input_length": -1}\n')
    db = tmp_path / "c.duckdb"
    code, _, err = run(["curve", str(trace), "--mode", "engine", "--capacities", "4096", "--no-content", "--workers",
                        "1", "--db", str(db)], capsys)
    assert code == 2 and "bad.jsonl:2" in err, err
    assert not db.exists()


def test_a_collected_cache_only_replay_is_named_by_its_senders_mode_where_it_holds_no_requests(tmp_path, capsys):
    """diff said "run A (collected) records no per-request hits" of a collected cache-only replay,
    and Compare that it "recorded no finished request", where its direct twin is "cache-only"
    (re-probe D): both name it by its sender's mode."""
    from kvtrace.instrument.otlp import OTLPCollector

    collected = tmp_path / "c.duckdb"
    collector = OTLPCollector(collected, port=0, grpc_port=None).start()
    try:
        _ok(["replay", TRACE, "--mode", "cache-only", "--capacity-blocks", "100", "--limit", "30",
             "--otlp-endpoint", collector.url], capsys)
    finally:
        collector.stop()
    from kvtrace.store import read

    (sent,) = read.runs(collected)["run_id"].to_list()
    _ok(["replay", TRACE, "--preset", "dense-attention", "--no-content", "--limit", "30", "--db", str(collected)],
        capsys)
    out = _ok(["diff", sent, "r1", "--db", str(collected), "--force", "--json"], capsys)
    notes = json.loads(out)["notes"]
    assert any(n.startswith("run A (cache-only) records no per-request hits") for n in notes), notes
