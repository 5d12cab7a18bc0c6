"""The dashboard's query layer without Streamlit or a store: what it reads from stored run
configs (group kinds, capacity), its window rule, and the read functions it allows."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import get_args

import polars as pl
import pytest

from kvtrace.dashboard import queries, run_config
from kvtrace.store import read

ENGINE = {"preset": "kimi-hybrid", "cache": {
    "groups": [{"type": "FullAttentionSpec", "block_size": 512}, {"type": "MambaSpec", "block_size": 512,
                                                                   "num_lanes": 4}],
    "num_gpu_blocks": [8192, 2048], "hash_block_size": 64}}


def test_every_cache_spec_type_has_a_label():
    from kvtrace.cache.config import KVCacheSpec

    assert set(run_config.GROUP_KINDS) == {spec.__name__ for spec in get_args(KVCacheSpec)}


def test_group_labels_read_the_stored_type_only():
    misleading = {"name": "sliding window mamba", "cache": {"groups": [
        {"type": "FullAttentionSpec", "block_size": 16, "note": "mamba state, recurrent, linear"},
        {"type": "SlidingWindowSpec", "block_size": 16, "sliding_window": 128, "note": "full attention"},
        {"type": "MambaSpec", "block_size": 16, "note": "attention"},
        {"type": "KDASpec", "block_size": 16},
    ]}}
    assert run_config.group_labels(misleading) == {
        0: "group 0 (attention)", 1: "group 1 (sliding window)", 2: "group 2 (state)", 3: "group 3"}
    # words without a stored cache.groups list name nothing
    assert run_config.group_labels({"groups": [{"kind": "mamba"}], "kv_cache_groups": ["full_attention"]}) == {}
    assert run_config.group_labels({"mode": "cache-only", "policy": "belady", "capacity_blocks": 8}) == {}


def test_capacity_of_engine_and_cache_only_configs():
    assert run_config.capacity(ENGINE) == run_config.Capacity(8191, 512)  # less vLLM's null block
    state_first = {"cache": {"groups": ENGINE["cache"]["groups"][::-1], "num_gpu_blocks": [2048, 8192]}}
    assert run_config.capacity(state_first) == run_config.Capacity(8191, 512)  # the full-attention group's
    one_count = {"cache": {"groups": ENGINE["cache"]["groups"], "num_gpu_blocks": 100}}
    assert run_config.capacity(one_count) == run_config.Capacity(99, 512)
    cache_only = {"mode": "cache-only", "policy": "belady", "capacity_blocks": 64, "block_size": 16}
    assert run_config.capacity(cache_only) == run_config.Capacity(64, 16)
    assert str(run_config.Capacity(8191, 512)) == "8,191 blocks of 512 tokens"


@pytest.mark.parametrize("cfg", [
    {},
    {"mode": "cache-only", "policy": "belady", "capacity_blocks": 64, "block_size": None},  # trace's block size
    {"mode": "cache-only", "policy": "lru", "capacity_blocks": None, "block_size": 16},
    {"endpoint": "tcp://127.0.0.1:5557", "topic": "kv"},  # a live vLLM capture
    {"cache": {"groups": [{"type": "MambaSpec", "block_size": 512}], "num_gpu_blocks": [64]}},
    {"cache": {"groups": ENGINE["cache"]["groups"], "num_gpu_blocks": [8192]}},  # counts do not line up
    {"capacity_blocks": 64, "block_size": 16},  # no mode: not a cache-only config
])
def test_capacity_is_none_where_the_config_stores_none(cfg):
    assert run_config.capacity(cfg) is None


def test_dashboard_window_count_and_the_store_window_agree_on_large_runs():
    assert [queries.windows_for(n) for n in (0, 79, 80, 400, 799, 800, 10**6)] == [20, 20, 20, 100, 199, 200, 200]
    for end in (999, 5000, 1_234_567, 10**9, 3 * 10**11 + 7):
        # >= 800 requests: the dashboard asks for the store's default window count
        assert read.nice_window(end, queries.windows_for(10_000)) == read.nice_window(end)
        # fewer requests: fewer, longer windows, from the same rounding
        assert read.nice_window(end, queries.windows_for(100)) == read.nice_window(end, 25) >= read.nice_window(end)


def test_the_pages_call_exactly_the_read_functions_queries_allows():
    dashboard = Path(queries.__file__).parent
    sources = "".join(p.read_text() for p in sorted(dashboard.rglob("*.py")))
    assert set(re.findall(r'\bcall\("([a-z_]+)"', sources)) == set(queries._READS)
    assert all(fn is getattr(read, name) for name, fn in queries._READS.items())


def test_runs_that_name_no_trace_are_comparable_to_none(monkeypatch):
    """Equal trace digests, else equal trace sources where a digest is missing (pairing.same_trace,
    kvtrace diff's rule: e and c were comparable one way only); a run naming neither shares a
    trace with no run (not with every other run naming none), and asks polars no null question."""
    frame = pl.DataFrame({"run_id": ["a", "b", "c", "d", "e"],
                          "trace_digest": [None, None, None, None, "f00"],
                          "trace_source": [None, None, "x.jsonl", "x.jsonl", "x.jsonl"]},
                         schema={"run_id": pl.String, "trace_digest": pl.String, "trace_source": pl.String})
    monkeypatch.setattr(queries, "runs", lambda: frame)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert queries.comparable_runs("a")["run_id"].to_list() == []
        assert queries.comparable_runs("c")["run_id"].to_list() == ["d", "e"]
        assert queries.comparable_runs("e")["run_id"].to_list() == ["c", "d"]
