"""trace_characterisation.ipynb on a real generated trace, checked against direct replays."""

from __future__ import annotations

import re
from itertools import pairwise

import pytest

from kvtrace.numeric import percentiles
from kvtrace.replay.cache_only import as_block_requests, block_keys
from kvtrace.replay.generate import write_generated
from kvtrace.replay.readers import read_trace
from kvtrace.replay.run import RunSpec, run_replay


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "chat.jsonl"
    write_generated("chat", path, fmt="native", seed=3, num_requests=40)
    return path


def test_trace_characterisation_values(run_notebook, trace, tmp_path):
    caps = [8, 32, 128, 4096]
    result, nb = run_notebook("trace_characterisation", trace_path=str(trace), capacities=caps, seed=3)
    requests = read_trace(trace)
    assert result["requests"] == len(requests) == 40
    refs = sum(len(r.hash_ids) for r in requests)
    unique = len({(r.namespace, h) for r in requests for h in r.hash_ids})
    assert result["block_references"] == refs
    assert result["unique_blocks"] == unique
    assert result["reuse_fraction"] == pytest.approx(1 - unique / refs)
    # multi-turn chat over shared system prompts: sessions share prefixes, so reuse is real
    assert 0.3 < result["reuse_fraction"] < 1
    assert result["root_fanout"] >= 1 and result["max_fanout"] >= 2
    assert result["capacities"] == caps
    lru, belady = result["lru_prefix_cache_hit_rate"], result["belady_prefix_cache_hit_rate"]
    assert len(lru) == len(belady) == len(caps)
    # The offline-optimal bound is never below LRU, and grows with capacity.
    assert all(b >= lr - 1e-12 for lr, b in zip(lru, belady))
    assert belady == sorted(belady)
    # The notebook's sweep is the CLI's cache-only replay: same value at one capacity.
    direct = run_replay(RunSpec(trace=str(trace), mode="cache-only", policy="lru", capacity_blocks=32, seed=3))
    assert lru[1] == pytest.approx(direct.summary["prefix_cache_hit_rate"])
    # With room for everything, the block hit rate is the compulsory-miss bound.
    assert result["lru_block_hit_rate"][-1] == pytest.approx(result["reuse_fraction"])
    assert result["interarrival_cv"] is not None and result["interarrival_cv"] > 0
    # The reuse gaps' percentiles are kvtrace.numeric's, every view's (polars' linear quantile differed in
    # the last bit): the gaps between a block's consecutive references, by the cache's own block keys.
    keys = block_keys(as_block_requests(requests, None)[0])
    seen: dict[int, list[int]] = {}
    for req, ks in sorted(zip(requests, keys), key=lambda p: p[0].arrival_ns):
        for k in ks:
            seen.setdefault(int(k), []).append(req.arrival_ns)
    gaps = [(b - a) / 1e9 for times in seen.values() for a, b in pairwise(times)]
    assert gaps and result["reuse_gap_s"] == dict(zip(("p50", "p90", "p99"), percentiles(gaps, (50, 90, 99))))
    # The plots were produced (plotly outputs in the executed notebook).
    plots = [o for c in nb.cells for o in c.get("outputs", [])
             if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert len(plots) >= 4


def test_trace_characterisation_on_a_token_id_trace(run_notebook, tmp_path):
    path = tmp_path / "agent-tokens.jsonl"
    write_generated("agent", path, fmt="native", seed=1, num_requests=12, prompt="tokens")
    assert read_trace(path)[0].hash_ids is None  # blocks cut from the tokens, chained by content
    result, _ = run_notebook("trace_characterisation", trace_path=str(path), block_size=16, seed=1)
    assert result["requests"] == 12
    # The notebook reads the cache-only replay's own block keys: with room for everything,
    # the replay's block hit rate is the notebook's reuse fraction.
    assert result["lru_block_hit_rate"][-1] == pytest.approx(result["reuse_fraction"])
    assert result["reuse_fraction"] > 0.5  # agent steps re-send a growing context


def test_a_trace_without_requests_is_one_kvtrace_error(run_notebook, tmp_path):
    """A header-only trace (or limit 0) ended in a raw ``max() arg is an empty sequence``."""
    from papermill.exceptions import PapermillExecutionError

    empty = tmp_path / "hdr.jsonl"
    empty.write_text('{"kvtrace_trace":1}\n')
    with pytest.raises(PapermillExecutionError, match=r"KVTraceError.*no requests to characterise"):
        run_notebook("trace_characterisation", trace_path=str(empty))


@pytest.mark.parametrize(("given", "said"), [
    ({"capacities": []}, "capacities: expected a non-empty list"),  # (was plotly's ValueError on an empty sweep)
    ({"capacities": [8, "x"]}, "capacities: expected an int >= 1, got 'x'"),  # (int()'s ValueError)
    ({"block_size": 0}, "block_size: expected an int >= 1, got 0"),  # (range()'s ValueError)
    ({"trace_block_size": "64"}, "trace_block_size: expected an int >= 1, got '64'"),
    # (the generator's and the replay's flags were named: "--requests: 0", "--seed: x")
    ({"num_requests": 0, "trace_path": None}, "num_requests: expected an int >= 1, got 0"),
    ({"seed": "x"}, "seed: expected an int from 0 to 2^64 - 1, got 'x'"),
    ({"trace_path": ["a.jsonl"]}, "trace_path: expected a trace file path"),  # (os.path's TypeError)
])
def test_a_parameter_it_cannot_use_is_one_config_error_naming_it(run_notebook, tmp_path, given, said):
    from papermill.exceptions import PapermillExecutionError

    path = tmp_path / "agent-tokens.jsonl"
    write_generated("agent", path, fmt="native", seed=1, num_requests=3, prompt="tokens")
    with pytest.raises(PapermillExecutionError, match=re.escape(f"ConfigError: trace_characterisation: {said}")):
        run_notebook("trace_characterisation", **{"trace_path": str(path), **given})


def test_a_numeric_trace_path_from_papermill_is_read_as_a_file_name(run_notebook):
    """`papermill -p trace_path 12345` passes an int: open_trace's TypeError, not the file's name."""
    from papermill.exceptions import PapermillExecutionError

    with pytest.raises(PapermillExecutionError, match=re.escape("TraceFormatError: 12345: no such file")):
        run_notebook("trace_characterisation", trace_path=12345)


def test_a_trace_without_reuse_is_said_to_hit_nothing(run_notebook, tmp_path):
    """With every hit rate 0, 'LRU reaches 90% of its best hit rate' named the smallest capacity
    as the knee; capacities given out of order made the 'smallest' the first given."""
    path = tmp_path / "one.jsonl"
    path.write_text('{"kvtrace_trace":1,"block_size":16}\n'
                    '{"request_id":"a","arrival_ns":0,"input_length":64,"hash_ids":[1,2,3,4],"output_length":2}\n')
    result, nb = run_notebook("trace_characterisation", trace_path=str(path), capacities=[8, 2, 8])
    assert result["capacities"] == [2, 8] and result["reuse_fraction"] == 0
    assert result["lru_prefix_cache_hit_rate"] == [0.0, 0.0]
    printed = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "LRU hits nothing at any capacity swept (2 to 8 blocks): no block is referenced twice" in printed
    assert "90% of its best" not in printed
    assert "inter-arrival CV: none" in printed and result["interarrival_cv"] is None


def test_a_result_path_that_is_the_trace_is_refused_and_the_trace_kept(run_notebook, trace):
    """result_path was opened with open(..., 'w'): naming the trace there replaced it with JSON."""
    from papermill.exceptions import PapermillExecutionError

    before = trace.read_bytes()
    with pytest.raises(PapermillExecutionError, match=re.escape(f"KVTraceError: {trace}: is also {trace}")):
        run_notebook("trace_characterisation", trace_path=str(trace), result_path=str(trace))
    assert trace.read_bytes() == before


def test_a_trace_whose_ids_are_not_prefix_chained_counts_the_caches_blocks(run_notebook, tmp_path):
    """Block 2 after 1 and block 2 after 3 are other blocks to the cache (its keys chain the
    prefix); the notebook keyed blocks by their id alone, so it called 2 reused three times
    and drew a reuse bound of 0.5 over a trace an unbounded cache hits 0.25 of, and the
    prefix tree gave block 2 three parents."""
    path = tmp_path / "unchained.jsonl"
    prompts = [[1, 2], [3, 2], [5, 2], [1, 2]]
    path.write_text("".join(f'{{"timestamp": {10 * i}, "input_length": 1024, "output_length": 4, '
                            f'"hash_ids": {ids}}}\n' for i, ids in enumerate(prompts)))
    result, _ = run_notebook("trace_characterisation", trace_path=str(path), capacities=[2, 8])
    unbounded = run_replay(RunSpec(trace=str(path), mode="cache-only")).summary
    assert (result["block_references"], result["unique_blocks"]) == (8, 6)  # [1,2] twice; 3, 5 each start a chain
    assert result["reuse_fraction"] == pytest.approx(unbounded["block_hit_rate"]) == pytest.approx(0.25)
    assert result["lru_block_hit_rate"][-1] == pytest.approx(result["reuse_fraction"])
    assert (result["root_fanout"], result["max_fanout"], result["branching_nodes"]) == (3, 1, 0)


def test_a_mooncake_trace_of_other_sized_ids_is_read_at_its_trace_block_size(run_notebook, tmp_path):
    """The CLI reads a Mooncake trace of 64-token ids with --trace-block-size 64; the notebook
    had no such parameter, so it refused the trace (ids counted at 512 tokens each)."""
    path = tmp_path / "mooncake64.jsonl"
    rows = [(0, 100, [1, 2]), (5, 128, [1, 2]), (9, 200, [1, 2, 3, 4]), (12, 64, [9])]
    path.write_text("".join(f'{{"timestamp": {t}, "input_length": {n}, "output_length": 1, "hash_ids": {ids}}}\n'
                            for t, n, ids in rows))
    result, _ = run_notebook("trace_characterisation", trace_path=str(path), trace_block_size=64, capacities=[2, 8])
    assert (result["format"], result["requests"], result["block_references"], result["unique_blocks"]) == (
        "mooncake", 4, 9, 5)
    for i, capacity in enumerate((2, 8)):
        direct = run_replay(RunSpec(trace=str(path), mode="cache-only", capacity_blocks=capacity, trace_block_size=64))
        assert result["lru_prefix_cache_hit_rate"][i] == pytest.approx(direct.summary["prefix_cache_hit_rate"])
