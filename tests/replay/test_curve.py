"""The capacity curve: the one-pass LRU curve against real replays at each capacity."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrace.errors import ConfigError, KVTraceError
from kvtrace.replay.cache_only import as_block_requests, replay_cache_only
from kvtrace.replay.curve import auto_capacities, capacity_curve, lru_thresholds, parse_capacities, run_curve
from kvtrace.replay.readers import read_trace
from kvtrace.replay.run import RunSpec
from kvtrace.store import read
from kvtrace.workload import TraceRequest
from tests.conftest import MOONCAKE


@pytest.fixture(scope="module")
def mooncake():
    return read_trace(MOONCAKE)


def test_one_pass_equals_a_replay_at_each_of_five_capacities(mooncake):
    reqs, bs = as_block_requests(mooncake, None)
    largest = max(len(r.hash_ids) for r in reqs)
    caps = [largest, 2_000, 6_000, 20_000, 60_000]
    points = capacity_curve(reqs, caps, policies=("lru",))
    assert [p.capacity_blocks for p in points] == sorted(caps)
    for p in points:
        assert p.method == "one-pass"
        replayed = replay_cache_only(reqs, capacity_blocks=p.capacity_blocks, block_size=bs)
        assert (p.hit_blocks, p.hit_tokens, p.total_blocks, p.prompt_tokens) == (
            replayed.hit_blocks, replayed.hit_tokens, replayed.total_blocks, replayed.prompt_tokens), p
    # the curve rises with capacity and is not flat: the test would see a constant curve
    rates = [p.prefix_cache_hit_rate for p in points]
    assert rates == sorted(rates) and rates[0] < rates[-1]


def test_below_the_largest_request_the_point_is_replayed(mooncake):
    reqs, bs = as_block_requests(mooncake[:400], None)
    small = max(len(r.hash_ids) for r in reqs) - 1
    (point,) = capacity_curve(reqs, [small], policies=("lru",))
    assert point.method == "replay"
    assert point.hit_blocks == replay_cache_only(reqs, capacity_blocks=small, block_size=bs).hit_blocks


def test_the_unbounded_point_is_a_cache_that_never_evicts(mooncake):
    reqs, bs = as_block_requests(mooncake[:800], None)
    distinct = len({h for r in reqs for h in r.hash_ids})
    unbounded = capacity_curve(reqs, [None], policies=("lru", "belady"))
    assert [p.capacity_blocks for p in unbounded] == [None, None]
    everything = replay_cache_only(reqs, capacity_blocks=distinct, block_size=bs)
    assert everything.evictions == 0
    assert all(p.hit_blocks == everything.hit_blocks for p in unbounded)


def test_belady_points_are_the_belady_replay_and_bound_lru(mooncake):
    reqs, bs = as_block_requests(mooncake[:600], None)
    caps = [300, 1_200]
    points = {(p.policy, p.capacity_blocks): p for p in capacity_curve(reqs, caps)}
    for c in caps:
        bound = replay_cache_only(reqs, capacity_blocks=c, block_size=bs, policy="belady")
        assert points["belady", c].hit_blocks == bound.hit_blocks
        assert points["belady", c].hit_tokens >= points["lru", c].hit_tokens


chains = st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=6), min_size=1, max_size=25)


@settings(max_examples=150, deadline=None)
@given(chains, st.integers(1, 12))
def test_one_pass_matches_replays_on_random_prefix_trees(paths, extra):
    """Random requests over a small prefix tree (a path of branch choices names each
    block by its whole chain, so ids are prefix-chained), every capacity from the
    largest request up."""
    ids: dict[tuple, int] = {}
    reqs = []
    for i, path in enumerate(paths):
        chain = [ids.setdefault(tuple(path[: j + 1]), len(ids)) for j in range(len(path))]
        reqs.append(TraceRequest(f"r{i}", i, len(chain) * 4 - (i % 3), 1, hash_ids=tuple(chain), hash_block_size=4))
    largest = max(len(r.hash_ids) for r in reqs)
    caps = list(range(largest, largest + extra))
    for p in capacity_curve(reqs, caps, policies=("lru",)):
        assert p.hit_tokens == replay_cache_only(reqs, capacity_blocks=p.capacity_blocks).hit_tokens, p


def test_thresholds_of_a_tiny_trace_by_hand():
    # a b c | a b | d a; a never-seen block is beyond every capacity (total + 1 = 8)
    thresholds, lens = lru_thresholds([[1, 2, 3], [1, 2], [4, 1]])
    assert lens.tolist() == [3, 2, 2]
    # request 1 returns c, b, a (tail first), so a is the most recent: depths a 1, b 2
    # request 3: d unseen (8), and a behind it in the same prefix cannot hit either
    assert thresholds.tolist() == [8, 8, 8, 1, 2, 8, 8]


def test_auto_capacities_span_the_largest_request_to_every_block(mooncake):
    reqs, _ = as_block_requests(mooncake[:500], None)
    caps = auto_capacities(reqs)
    assert caps[0] == max(len(r.hash_ids) for r in reqs)
    assert caps[-1] == len({h for r in reqs for h in r.hash_ids})
    assert caps == sorted(set(caps)) and len(caps) >= 5


@pytest.mark.parametrize("text, expected", [
    ("auto", None), ("100, 200,inf", [100, 200, None]),
    # each capacity once, ascending, the unbounded cache last (a repeat was taken for "inf given")
    ("10,10,20", [10, 20]), ("inf,20,10,20,inf", [10, 20, None]),
    ("10,infinity", [10, None]), ("Unbounded,10", [10, None])])  # (replay's spellings: infinity was refused)
def test_parse_capacities(text, expected):
    assert parse_capacities(text) == expected


@pytest.mark.parametrize("text", ["", "0", "10,x", "-5", ",".join(map(str, range(1, 10_002)))])  # (10,001 points)
def test_parse_capacities_refuses(text):
    with pytest.raises(ConfigError, match="--capacities"):
        parse_capacities(text)


def test_run_curve_records_its_points_and_refuses_what_it_cannot_draw(tmp_path):
    db = tmp_path / "c.duckdb"
    spec = RunSpec(str(MOONCAKE), mode="cache-only", limit=300)
    result = run_curve(spec, "200,400,inf", db=db)
    stored = read.curves(db)
    assert stored["curve_id"].unique().to_list() == [result.curve_id]
    assert stored.height == len(result.points) == 6  # 2 policies x (2 capacities + unbounded)
    lru400 = stored.filter((stored["policy"] == "lru") & (stored["capacity_blocks"] == 400))
    (point,) = [p for p in result.points if p.policy == "lru" and p.capacity_blocks == 400]
    assert (
        lru400["hit_tokens"][0] == point.hit_tokens
        and lru400["prefix_cache_hit_rate"][0] == point.prefix_cache_hit_rate
    )
    again = run_curve(spec, "200,400,inf", db=db)  # the same curve again replaces, never duplicates
    assert again.curve_id == result.curve_id and read.curves(db).height == 6
    with pytest.raises(ConfigError, match="cache-only bound"):
        run_curve(RunSpec(str(MOONCAKE), mode="engine", limit=5), "100", policies=("lru", "belady"))
    with pytest.raises(ConfigError, match="--capacities"):
        run_curve(spec, "nope")
    with pytest.raises(ConfigError, match="sweeps the capacity"):
        run_curve(RunSpec(str(MOONCAKE), mode="cache-only", capacity_blocks=10), "auto")


def test_the_same_curve_however_written_is_one_curve():
    spec = RunSpec(str(MOONCAKE), mode="cache-only", limit=50)
    one = run_curve(spec, "10,inf", policies=("lru", "belady"))
    other = run_curve(spec, "inf,10,10", policies=("belady", "lru", "lru"))
    assert one.curve_id == other.curve_id
    assert [(p.capacity_blocks, p.policy) for p in one.points] == [(p.capacity_blocks, p.policy) for p in other.points]
    assert len(one.points) == 4
    assert [p.capacity_blocks for p in run_curve(spec, "10,10,20", policies=("lru",)).points] == [10, 20]
    with pytest.raises(ConfigError, match="--policy"):
        run_curve(spec, "10", policies=())


def test_worker_and_ray_options_are_checked_in_every_mode():
    spec = RunSpec(str(MOONCAKE), mode="cache-only", limit=20)
    with pytest.raises(ConfigError, match="--workers"):
        run_curve(spec, "10", workers=0)
    with pytest.raises(ConfigError, match="--ray: garbage: engine mode only"):
        run_curve(spec, "10", ray_address="garbage")


def test_an_engine_curves_points_carry_the_runs_block_counts(tmp_path):
    """Engine points read hit and total blocks from each run's summary, which carried only
    the rate: every point said 0 of 0 blocks and a null block hit rate, also as stored."""
    from kvtrace.replay.run import run_replay

    spec = RunSpec("gen:mixed", limit=12, content=False)
    db = tmp_path / "c.duckdb"
    result = run_curve(spec, "300,1000", policies=("lru",), db=db, workers=1)
    for point in result.points:
        # (a point's capacity is its run's usable blocks: the pool asked for less vLLM's null block)
        alone = run_replay(RunSpec("gen:mixed", limit=12, content=False,
                                   capacity_blocks=point.capacity_blocks + 1)).summary
        assert point.total_blocks == alone["total_blocks"] > 0
        assert point.hit_blocks == alone["hit_blocks"]
        assert point.block_hit_rate == pytest.approx(alone["block_hit_rate"])
    stored = read.curves(db)
    assert stored["total_blocks"].min() > 0


def test_an_engine_curve_counts_capacity_as_its_runs_do(tmp_path):
    """`kvtrace runs` and `diff` give an engine run's capacity as its usable blocks (the pool
    less vLLM's null block) and its block size; the curve drawn from those runs said 300 for
    their 299 and a null block size, so the dashboard could place no run on it."""
    db = tmp_path / "c.duckdb"
    result = run_curve(RunSpec("gen:chat", limit=8, content=False), "300,600", policies=("lru",), db=db, workers=1)
    runs = {r["run_id"]: r for r in read.runs(db).iter_rows(named=True)}
    assert [p.capacity_blocks for p in result.points] == [299, 599]
    assert result.block_size == 512
    for point in result.points:
        summary = json.loads(runs[point.run_id]["summary"])
        assert (point.capacity_blocks, result.block_size) == (summary["capacity_blocks"], summary["block_size"])
    stored = read.curves(db)
    assert stored["capacity_blocks"].to_list() == [299, 599] and stored["block_size"].unique().to_list() == [512]


def test_curves_of_other_settings_are_other_curves(tmp_path):
    """The id covered the mode, preset, block size, limit, seed and switches only: a curve at
    another retention, external tier or --config file got the same id and replaced the first
    in the store."""
    toml = tmp_path / "run.toml"
    toml.write_text("[cache]\nretention_interval = 0\n")
    db = tmp_path / "c.duckdb"
    base = RunSpec("gen:chat", limit=4, content=False)
    ids = {run_curve(replace(base, **kw), "300", policies=("lru",), db=db, workers=1).curve_id
           for kw in ({}, {"retention": "none"}, {"external_capacity_blocks": 64}, {"config_file": str(toml)})}
    assert len(ids) == 4 and read.curves(db)["curve_id"].n_unique() == 4
    same = run_curve(replace(base, name="another name", percentiles=(90.0,)), "300", policies=("lru",), workers=1)
    assert same.curve_id in ids  # (what moves no point does not make another curve)


def test_a_curve_names_the_capacity_flag_given():
    with pytest.raises(ConfigError, match=r"^--capacity-tokens: 5000: a curve sweeps the capacity"):
        run_curve(RunSpec(str(MOONCAKE), mode="cache-only", capacity_tokens=5000, block_size=16), "10")


def test_an_engine_curves_refused_capacity_is_named_at_capacities():
    """A capacity the engine refuses was named at --capacity-blocks (curve's own flag refuses
    that one); it is the --capacities value the user typed."""
    with pytest.raises(ConfigError, match=r"^--capacities: 1: expected an int >= 2"):
        run_curve(RunSpec("gen:chat", limit=3, content=False), "1,100", policies=("lru",))


def test_an_engine_curve_without_policy_draws_lru(capsys):
    """`curve --mode engine` was refused for `--policy: belady`, a default the user never
    typed; asked for, Belady is still refused there."""
    from tests.cli.support import assert_one_line, run

    argv = ["curve", "gen:chat", "--limit", "3", "--no-content", "--mode", "engine", "--capacities", "300,600",
            "--workers", "1", "--json"]
    code, out, err = run(argv, capsys)
    assert code == 0, err
    points = json.loads(out)["points"]
    assert [(p["capacity_blocks"], p["policy"], p["method"]) for p in points] == [(299, "lru", "run"),
                                                                                    (599, "lru", "run")]
    assert_one_line(*run([*argv, "--policy", "lru,belady"], capsys)[::2], "--policy: belady: the Belady bound")
    # cache-only: both, as before
    code, out, err = run(["curve", "gen:chat", "--limit", "3", "--capacities", "300", "--json"], capsys)
    assert code == 0 and {p["policy"] for p in json.loads(out)["points"]} == {"lru", "belady"}, err


@pytest.mark.parametrize(("policy", "shown"), [("lru,,belady", "lru,,belady"), ("lru,", "lru,"), ("", "''")])
def test_an_empty_policy_item_is_refused_as_an_empty_capacity_is(capsys, policy, shown):
    """`--policy lru,,belady` drew both curves (the empty item dropped), where `--capacities
    1,,2` and `--param NAME=1,,2` are refused as the typo they are."""
    from tests.cli.support import assert_one_line, run

    code, _, err = run(["curve", str(MOONCAKE), "--limit", "5", "--capacities", "100", "--policy", policy], capsys)
    assert_one_line(code, err, f"--policy: {shown}: expected some of lru, belady joined by commas (no empty item)")


def test_one_curve_however_its_retention_and_preset_are_spelt_is_one_curve(tmp_path):
    """Retention 0 and 00, none and None each had their own curve id (the store kept the same
    curve twice), and so did --preset kimi-hybrid, the preset the runs get without it; no
    --retention (the preset's 0) and --retention none (dense) are other curves."""
    db = tmp_path / "c.duckdb"
    base = RunSpec("gen:chat", limit=4, content=False)

    def curve_id(**kw):
        return run_curve(replace(base, **kw), "300", policies=("lru",), db=db, workers=1).curve_id

    assert curve_id(retention="0") == curve_id(retention="00")
    assert curve_id(retention="none") == curve_id(retention="None") != curve_id()
    assert curve_id(preset="kimi-hybrid") == curve_id()
    assert read.curves(db)["curve_id"].n_unique() == 3


def test_an_engine_curves_capacity_too_small_for_a_request_is_named_at_capacities():
    with pytest.raises(KVTraceError, match=r"^--capacities 4: engine: request \S+ .* cannot be scheduled"):
        run_curve(RunSpec("gen:chat", limit=3, content=False), "4,2000", policies=("lru",), workers=1)


def test_an_engine_curve_too_small_for_a_request_says_to_raise_the_capacities(capsys):
    """It advised --capacity-blocks or --capacity-tokens (or the file's num_gpu_blocks), which a
    curve refuses or its --capacities replace."""
    from tests.cli.support import assert_one_line, run

    code, _, err = run(["curve", "gen:chat", "--limit", "5", "--mode", "engine", "--capacities", "5,2000"], capsys)
    line = assert_one_line(code, err, "--capacities 5: engine:", "raise the --capacities")
    assert "--capacity-blocks" not in line and "num_gpu_blocks in --config" not in line
