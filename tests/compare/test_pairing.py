"""``kvtrace.compare.pairing``: how two stored runs' settings differ, and the command that
records a partner for a run (the dashboard's Compare page shows both)."""

from __future__ import annotations

import json
import shlex

from kvtrace.compare import pairing


def _cache_only(block_size, summary_block_size, capacity=None, policy="lru", trace="t.jsonl"):
    return {"run_id": f"r{block_size}", "mode": "cache-only", "trace_source": trace,
            "config": json.dumps({"block_size": block_size, "capacity_blocks": capacity, "mode": "cache-only",
                                  "policy": policy}),
            "summary": json.dumps({"requests": 5, "block_size": summary_block_size})}


def test_a_run_at_its_traces_own_block_size_differs_only_where_the_size_does():
    """A cache-only run at the trace's block size stores it in its summary, not its config:
    Compare said "block_size: A 32 → B unset" of a 512-token run, and "A 512 → B unset" of
    two runs at one size."""
    own, given, other = _cache_only(None, 512), _cache_only(512, 512), _cache_only(32, 32)
    assert pairing.differences(own, given) == []
    (d,) = pairing.differences(other, own)
    assert (d.setting, d.a, d.b) == ("block_size", 32, 512)


def test_the_partner_command_of_an_unbounded_run_is_a_bounded_one_and_pastes_whole():
    """An unbounded cache-only run was told to record ``--capacity-blocks None`` (refused:
    "expected a number of blocks"); a store path with a space broke the command."""
    db = "/tmp/my stores/s.duckdb"
    unbounded = pairing.study_command(_cache_only(None, 512, trace="my trace.jsonl"), db)
    argv = shlex.split(unbounded)
    assert "None" not in argv and argv[argv.index("--capacity-blocks") + 1] == "N"
    assert "--policy" not in argv  # (no policy differs from a cache that evicts nothing)
    assert argv[2] == "my trace.jsonl" and argv[-1] == db
    bounded = shlex.split(pairing.study_command(_cache_only(None, 512, capacity=64), db))
    assert bounded[bounded.index("--policy") + 1] == "belady"
    assert bounded[bounded.index("--capacity-blocks") + 1] == "64"
    engine = {"mode": "engine", "trace_source": "a b.jsonl", "config": {"preset": "kimi-hybrid"},
              "behaviours": ["shared-prefix-pinning"]}
    argv = shlex.split(pairing.study_command(engine, db))
    assert argv[:3] == ["kvtrace", "study", "shared-prefix-pinning"] and argv[argv.index("--trace") + 1] == "a b.jsonl"
    assert argv[-1] == db
    # a live capture's source is its ZMQ endpoint: no trace to replay (the Compare page said to)
    live = shlex.split(pairing.study_command({"mode": "live", "trace_source": "tcp://127.0.0.1:5557"}, db))
    assert live[live.index("--trace") + 1] == "TRACE"


def _cli(argv, capsys):
    from tests.cli.support import run

    code, out, err = run(argv, capsys)
    assert code == 0, err
    return out


def test_the_partner_command_records_a_run_that_pairs_with_it(tmp_path, capsys):
    """The Compare page's command for a run it found no partner for must record one. For a
    cache-only LRU run its Belady twin never paired (runs store the mode as cache-only/lru
    and cache-only/belady: mode and policy differed), and the command dropped --limit (its
    run was of another trace); for an engine run it dropped the capacity, the external tier
    and --no-content, so the study's all-on run was no twin of it either."""
    from kvtrace.store import read

    trace = "tests/data/mooncake_synthetic_trace.jsonl"
    db = str(tmp_path / "s.duckdb")
    # a Mooncake trace at 64 tokens an id (its ids counted at the default 512 are refused)
    mc64 = tmp_path / "mc64.jsonl"
    mc64.write_text("".join(f'{{"timestamp": {i}, "input_length": 100, "output_length": 2, "hash_ids": [0, {i % 3}]}}\n'
                            for i in range(8)))
    cases = [["replay", trace, "--mode", "cache-only", "--capacity-blocks", "300", "--limit", "60"],
             ["replay", "gen:chat", "--limit", "12", "--capacity-blocks", "30", "--external-blocks", "200",
              "--no-content"],
             ["replay", "gen:chat", "--limit", "12", "--retention", "1024", "--no-content"],
             # (kimi-hybrid's retention is 0: the study ran at 0, neither run the twin of this one)
             ["replay", "gen:chat", "--limit", "12", "--retention", "none", "--no-content"],
             ["replay", "gen:chat", "--limit", "12", "--without", "external-hit-running-cow", "--no-content"],
             ["replay", "gen:chat", "--limit", "12", "--no-content", *(x for b in ("external-hit-running-cow",
              "shared-prefix-pinning", "transient-checkpoint-retention") for x in ("--without", b))],
             ["replay", "gen:chat", "--limit", "12", "--preset", "dense-attention", "--block-size", "32",
              "--capacity-blocks", "400", "--no-content"],
             # a generated workload of another seed is other requests (its command left the seed out)
             ["replay", "gen:chat", "--limit", "12", "--seed", "7", "--no-content"],
             ["replay", "gen:mixed", "--limit", "30", "--seed", "3", "--mode", "cache-only", "--capacity-blocks", "40"],
             ["replay", str(mc64), "--trace-block-size", "64", "--mode", "cache-only", "--capacity-blocks", "2",
              "--limit", "7"],
             ["replay", str(mc64), "--trace-block-size", "64", "--no-content", "--limit", "7"]]
    for i, argv in enumerate(cases):
        db = str(tmp_path / f"s{i}.duckdb")  # (a store each: one case's study runs may pair with another's)
        _cli([*argv, "--db", db], capsys)
        a = read.run(db, read.runs(db)["run_id"][0])
        assert pairing.partner(a, [read.run(db, r) for r in read.runs(db)["run_id"]]) is None
        command = shlex.split(pairing.study_command(a, db))
        assert command[0] == "kvtrace" and "--limit" in command
        _cli([*command[1:], "--json"] if command[1] == "study" else command[1:], capsys)
        others = [read.run(db, r) for r in read.runs(db)["run_id"] if r != a["run_id"]]
        found = pairing.partner(a, others)
        assert found is not None, [pairing.differences(a, o) for o in others]
        (d,) = pairing.differences(a, found)
        # (the study's pair: the behaviour, nothing else; a cache-only run's: the policy)
        assert d.kind == ("behaviour" if command[1] == "study" else "setting"), d
    engine = {"mode": "engine", "trace_source": "t.jsonl", "trace_digest": "abc:limit=7",
              "config": {"preset": "kimi-hybrid", "backend": "vllm", "cache": {"num_gpu_blocks": 99}}}
    argv = shlex.split(pairing.study_command(engine, db))
    assert argv[argv.index("--backend") + 1] == "vllm" and argv[argv.index("--capacity-blocks") + 1] == "99"
    assert argv[argv.index("--limit") + 1] == "7"


def test_a_cache_only_run_sized_in_tokens_stores_its_capacity(tmp_path, capsys):
    """--capacity-tokens 20480 --block-size 512 was stored as capacity_blocks None (an
    unbounded run): `runs` showed no capacity, and it paired with a run of another capacity
    as a one-setting change (the policy)."""
    from kvtrace.store import read

    trace = "tests/data/mooncake_synthetic_trace.jsonl"
    db = str(tmp_path / "s.duckdb")
    base = ["replay", trace, "--limit", "30", "--mode", "cache-only", "--block-size", "512", "--db", db]
    _cli([*base, "--capacity-tokens", "20000"], capsys)  # (39.06 blocks: the replay rounds up, to 40)
    _cli([*base, "--capacity-tokens", "409600", "--policy", "belady"], capsys)
    _cli([*base, "--capacity-blocks", "40", "--policy", "belady"], capsys)
    _cli([*base, "--capacity-blocks", "40"], capsys)
    r1, r2, r3, r4 = (read.run(db, r) for r in ("r1", "r2", "r3", "r4"))
    assert (r1["config"]["capacity_blocks"], r2["config"]["capacity_blocks"]) == (40, 800)
    assert r1["summary"]["prefix_cache_hit_rate"] == r4["summary"]["prefix_cache_hit_rate"]  # (what it replayed)
    assert pairing.partner(r1, [r3, r2]) is r3  # the same 40 blocks, the policy the one change
    assert pairing.partner(r1, [r2]) is None


def _engine(run_id, retention, sweep=None, **extra):
    config = {"mode": "engine", "cache": {"retention_interval": retention}, **extra}
    if sweep is not None:
        config["sweep"] = {"id": "s1", "params": sweep}
    return {"run_id": run_id, "mode": "engine", "trace_source": "t.jsonl", "config": json.dumps(config),
            "behaviours": json.dumps([])}


def test_two_points_of_a_sweep_differ_in_the_swept_setting_alone():
    """The sweep's record of its point (sweep.params.*) counted as a second difference: two
    points were 'not an isolated measurement' and had no Compare partner."""
    a, b = _engine("r1", None, {"retention": "none"}), _engine("r2", 0, {"retention": 0})
    assert [d.setting for d in pairing.differences(a, b)] == ["cache.retention_interval"]


def test_the_backend_and_its_vllm_are_one_setting():
    a = _engine("r1", 0, backend="kvtrace")
    b = _engine("r2", 0, backend="vllm", vllm_version="0.33.0", vllm_commit="abcdef0123456789")
    (d,) = pairing.differences(a, b)
    assert (d.setting, d.a, d.b) == ("backend", "kvtrace", "vllm 0.33.0 @ abcdef012345")
    assert pairing.differences(a, _engine("r3", 0)) == []  # (a record from before the key: kvtrace's)


def test_a_collected_replay_pairs_with_the_direct_runs_of_its_mode():
    """A replay a collector received is stored as mode otlp, and differed from its own direct
    twin in "mode: otlp → engine" alone: never an isolated pair, never a partner. Its config
    says how its sender replayed (collect probe, session 25)."""
    engine_cfg = {"backend": "kvtrace", "cache": {"groups": [{"type": "FullAttentionSpec", "block_size": 16}],
                                                  "retention_interval": 0}, "preset": "dense-attention"}
    direct = {"run_id": "r1", "mode": "engine", "trace_source": "t.jsonl", "config": json.dumps(engine_cfg),
              "behaviours": json.dumps(["shared-prefix-pinning"])}
    collected = {**direct, "run_id": "r2", "mode": "otlp"}
    assert pairing.differences(collected, direct) == []
    other = {**direct, "run_id": "r3", "behaviours": json.dumps([])}
    assert pairing.partner(collected, [other]) is other
    lru = _cache_only(16, None, capacity=100)
    assert pairing.differences({**lru, "mode": "otlp"}, lru) == []
    # a foreign sender's run (no kvtrace config) stays mode otlp
    foreign = {"run_id": "r4", "mode": "otlp", "trace_source": None, "config": json.dumps({})}
    assert [d.setting for d in pairing.differences(foreign, direct)][:1] == ["mode"]


def test_a_collected_cache_only_replays_partner_command_is_a_cache_only_one():
    """Compare suggested an engine study for a collected cache-only replay, a run that could
    never pair with it (re-probe C2): the command follows the sender's mode."""
    lru = {**_cache_only(16, None, capacity=100), "mode": "otlp"}
    command = pairing.study_command(lru, "s.duckdb")
    assert command.startswith("kvtrace replay t.jsonl --mode cache-only --policy belady --capacity-blocks 100")


def test_diff_notes_the_modes_of_a_collected_cache_only_replay_and_an_engine_run():
    """diff's "modes differ" note read a collected cache-only replay as "collected" beside an
    engine run, and said nothing of the two hit rules (re-probe C2)."""
    from kvtrace.compare.model import diff_summaries
    from kvtrace.metrics import replayed_mode

    cfg = {"mode": "cache-only", "policy": "lru", "capacity_blocks": 10}
    a = {"run_id": "r1", "mode": "otlp", "replayed_mode": replayed_mode("otlp", cfg)}
    b = {"run_id": "r2", "mode": "engine", "replayed_mode": "engine"}
    summary = {"requests": 3, "prefix_cache_hit_rate": 0.5}
    diff = diff_summaries(summary, summary, run_a=a, run_b=b)
    assert any(n.startswith("modes differ (cache-only vs engine)") for n in diff.notes), diff.notes
    assert replayed_mode("otlp", cfg) == "cache-only/lru"  # (as its direct twin's mode is stored)
