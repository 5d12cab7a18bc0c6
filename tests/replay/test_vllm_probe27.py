"""Probe 27 of ``--backend vllm`` and ``kvtrace conformance``: what a user reads of each
backend against the other, and against vLLM's own manager driven directly."""

from __future__ import annotations

from dataclasses import replace

import duckdb
import pytest

from kvtrace.replay.run import RunSpec, run_replay

# kimi-hybrid on a small pool: lookups where the attention group alone holds more than the
# state group (the request's hit), and a few the other way round
HYBRID = RunSpec("gen:mixed", limit=60, capacity_blocks=100, content=False)


def _lookups(db: str, run_id: str) -> list[tuple]:
    with duckdb.connect(db, read_only=True) as con:
        return con.execute("SELECT request_id, step, num_hit_tokens, hit_tokens_per_group FROM lookup_spans "
                           "WHERE run_id = ? AND name = 'kvtrace.cache.lookup' ORDER BY step, seq", [run_id]).fetchall()


@pytest.fixture(scope="module")
def hybrid_runs(vllm_api, tmp_path_factory):
    db = str(tmp_path_factory.mktemp("probe27") / "both.duckdb")
    ours = run_replay(HYBRID, db=db)
    theirs = run_replay(replace(HYBRID, backend="vllm"), db=db)
    return db, ours, theirs


def test_a_lookups_per_group_hits_are_each_groups_own_on_both_backends(hybrid_runs):
    # metrics.GROUP_HIT_RATE_DOC: "hit tokens KV group g alone found". The vllm backend wrote
    # the request's (common) hit into every group: 15 of the 61 lookups here read [0, 0] or
    # [512, 512] where kvtrace's manager, on the same requests and steps, said [512, 0] or
    # [1024, 512]. vLLM's coordinator looks each group up alone too (find_longest_cache_hit_per_group).
    db, ours, theirs = hybrid_runs
    mine, vllms = _lookups(db, ours.run_id), _lookups(db, theirs.run_id)
    assert len(mine) == len(vllms) > 0
    apart = [row for row in mine if any(h != row[2] for h in row[3])]
    assert apart, "no lookup where a group alone hit other than the request: the case tests nothing"
    assert vllms == mine


def test_the_reports_counts_read_as_the_readme_quotes_them():
    # README (Conformance): "at 120 blocks it reports 4,011 keys removed"; the report printed
    # "4011 keys removed" beside "num_gpu_blocks 1,500" and the field table's "1,500 / 1,500"
    from kvtrace.cache import CacheConfig, FullAttentionSpec
    from kvtrace.replay.conformance import ConformanceResult, ConformanceRun, format_report

    run = ConformanceRun(120, CacheConfig(groups=(FullAttentionSpec(512),), num_gpu_blocks=120, hash_block_size=512),
                         requests=1600, steps=3550, preemptions=1200, refusals=1100, copies=2000, evictions=4011,
                         unschedulable=1001)
    head = format_report(ConformanceResult("t.jsonl", "dense-attention", "0.33.0", [run]))[1]
    assert head.startswith("num_gpu_blocks 120: 1,600 requests, 3,550 steps, 1,200 preemptions, 1,100 refused "
                           "allocations, 4,011 keys removed ("), head
    assert "2,000 copies, 1,001 requests larger than the pool skipped" in head
