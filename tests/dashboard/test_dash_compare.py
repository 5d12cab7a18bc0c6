"""Compare on a pair whose requests got the same cached tokens from other tiers: the
behaviour moved hits between the local cache and the external tier (as the demo's
shared-prefix-pinning does), so vLLM's prefix cache hit rate moved while each request's
local + external total did not."""

from __future__ import annotations

from apptest import render

from kvtrace.store import read


def test_a_pair_that_moved_hits_between_tiers_is_not_said_to_leave_the_prefix_cache(tmp_path, monkeypatch):
    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path / "tiers.duckdb")
    spec = dict(limit=40, capacity_blocks=40, external_capacity_blocks=4096)
    on = run_replay(RunSpec("gen:mixed", name="on", **spec), db=db)
    off = run_replay(RunSpec("gen:mixed", name="off", without=("shared-prefix-pinning",), **spec), db=db)
    assert on.run_id is not None and off.run_id is not None
    joined = read.per_request_hits(db, on.run_id).join(read.per_request_hits(db, off.run_id), on="request_id",
                                                       suffix="_b")
    assert (joined["num_cached_tokens"] == joined["num_cached_tokens_b"]).all()  # the case at hand
    shifted = int((joined["num_local_hit_tokens"] != joined["num_local_hit_tokens_b"]).sum())
    assert shifted and on.summary["prefix_cache_hit_rate"] != off.summary["prefix_cache_hit_rate"]

    at = render(db, monkeypatch, "compare", run=on.run_id, b=off.run_id)
    infos = [i.value for i in at.info]
    assert not any("does not move the prefix cache" in i for i in infos), infos
    said = [i for i in infos if i.startswith(f"All {joined.height:,} requests got the same cached tokens")]
    assert said and f"but {shifted:,} of them took a different share from the local cache" in said[0], infos


def test_compare_tells_a_run_of_older_definitions_to_be_replayed_before_its_pair(tmp_path, monkeypatch):
    """A run recorded before metric definitions were recorded pairs with no run of this kvtrace:
    Compare suggested the command of a partner that, once run, still did not pair (re-probe B)."""
    import json

    import duckdb

    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path / "old.duckdb")
    old = run_replay(RunSpec("tests/data/mooncake_synthetic_trace.jsonl", mode="cache-only", capacity_blocks=200,
                             limit=30), db=db)
    con = duckdb.connect(db)
    (config,) = con.execute("SELECT config FROM runs WHERE run_id = ?", [old.run_id]).fetchone()
    config = json.loads(config)
    del config["definitions"]
    con.execute("UPDATE runs SET config = ? WHERE run_id = ?", [json.dumps(config), old.run_id])
    con.close()
    run_replay(RunSpec("tests/data/mooncake_synthetic_trace.jsonl", mode="cache-only", capacity_blocks=200,
                       limit=30, policy="belady"), db=db)  # (the partner the page's command records)
    at = render(db, monkeypatch, "compare", run=old.run_id)
    infos = " ".join(i.value for i in at.info)
    assert "a replay of A with this kvtrace first (A's metric definitions: none recorded: before version 1; " in infos
    assert "no run of this kvtrace pairs with A), then" in infos, infos
