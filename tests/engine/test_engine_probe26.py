"""Engine mode's numbers against independent computations (the twenty-sixth probe).

A summary's throughput was rounded to three decimals: three output tokens over 10,000
modelled seconds read ``output_tok_per_s`` 0.0, a run that generated nothing, and the
duration (rounded to microseconds) was not what it divided by. The terminal table
showed any rate under 0.0005 as 0.000.

Prefix hits are checked by hand at several block sizes (``_expected`` below): a request
alone in the engine hits the longest prefix it shares with an earlier prompt, in whole
blocks of that prompt, never its own last token; it prefills the rest in one step and
decodes one token a step, each step costing the README's formula.
"""

from __future__ import annotations

import random
from itertools import accumulate

import numpy as np
import pytest

from kvtrace.cache import CacheConfig, FullAttentionSpec
from kvtrace.engine import Engine, get_preset
from kvtrace.engine.clock import CostModel
from kvtrace.engine.config import SchedulerConfig
from kvtrace.engine.presets import EnginePreset
from kvtrace.replay.report import format_value
from kvtrace.workload import TraceRequest

MS = 1_000_000
# 1,000 s a step whatever it holds: a slow model, or a cost model fitted in the wrong unit
SLOW = CostModel("slow", step_overhead_ns=10**12, token_ns=0, attn_pair_ps=0, kv_read_ps=0, decode_seq_ns=0)
FULL = CostModel("full", step_overhead_ns=MS, token_ns=10_000, attn_pair_ps=1_000, kv_read_ps=3_000,
                 decode_seq_ns=100_000)


@pytest.fixture(params=[True, False], ids=["content", "no-content"])
def content(request):
    return request.param


def test_a_slow_runs_throughput_is_its_tokens_over_its_duration_not_zero(content):
    # ten steps of one token each (a budget of 1), then the one output token: 10,000 s
    preset = get_preset("dense-attention", scheduler={"max_num_batched_tokens": 1, "max_num_seqs": 1})
    reqs = [TraceRequest("a", 5 * MS, 10, 1, token_ids=np.arange(1, 11, dtype=np.int64))]
    result = Engine(preset, cost_model=SLOW, content=content).run(reqs)
    s, (r,) = result.summary, result.requests
    assert (s["steps"], s["output_tokens"]) == (10, 1)
    assert s["virtual_duration_s"] == (r.finish_ns - r.arrival_ns) / 1e9 == 10_000.0
    assert s["output_tok_per_s"] == s["output_tokens"] / s["virtual_duration_s"] > 0


def test_the_duration_is_not_cut_to_whole_microseconds(content):
    odd = CostModel("odd", step_overhead_ns=1_000_000_401, token_ns=0, attn_pair_ps=0, kv_read_ps=0,
                    decode_seq_ns=0)
    reqs = [TraceRequest("a", 0, 4, 2, token_ids=np.arange(1, 5, dtype=np.int64))]
    result = Engine(get_preset("dense-attention"), cost_model=odd, content=content).run(reqs)
    s = result.summary
    assert s["virtual_duration_s"] == 2_000_000_802 / 1e9
    assert s["output_tok_per_s"] == 2 / (2_000_000_802 / 1e9)


def test_a_run_of_no_request_lasts_no_time():
    s = Engine("dense-attention", content=False).run([]).summary
    assert (s["requests"], s["virtual_duration_s"], s["output_tok_per_s"]) == (0, 0.0, 0.0)


@pytest.mark.parametrize(("value", "shown"), [(0.0003, "0.0003"), (0.000123456, "0.000123"), (0.0, "0.000"),
                                              (204.2234, "204.223"), (1234.5, "1,234.500")])
def test_the_table_shows_a_small_rate_as_a_number_not_zero(value, shown):
    assert format_value("output_tok_per_s", value) == shown


def _step(n: int, pairs: int, context: int, decodes: int) -> int:
    c = FULL
    return (c.step_overhead_ns + c.token_ns * n + (c.attn_pair_ps * pairs + c.kv_read_ps * context) // 1000
            + c.decode_seq_ns * decodes)


def _case(seed: int):
    """(block size, requests, {id: (hit tokens, token times, prompt tokens computed)})."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 7, 16, 32])
    t, reqs, prompts, expected = 0, [], [], {}
    for i in range(rng.randint(2, 5)):
        if prompts and rng.random() < 0.8:  # an earlier prompt's prefix, cut anywhere, and new tokens
            src = rng.choice(prompts)
            cut = rng.randint(0, len(src))
            p = src[:cut] + [rng.randrange(30_000, 40_000) for _ in range(rng.randint(0 if cut else 1, 50))]
        else:
            p = [rng.randrange(40_000, 50_000) for _ in range(rng.randint(1, 300))]
        out = rng.choice([0, 1, rng.randint(2, 6)])
        reqs.append(TraceRequest(f"r{i}", t, len(p), out, token_ids=np.array(p, dtype=np.int64)))
        shared = 0
        for q in prompts:  # in whole blocks of the earlier prompt (its tail block holds its output too)
            k = next((j for j, (x, y) in enumerate(zip(q, p)) if x != y), min(len(q), len(p)))
            shared = max(shared, k // bs * bs)
        hit = min(shared, (len(p) - 1) // bs * bs)  # never the last token: it is computed to sample
        n = len(p) - hit
        # one token left is run as a decode (one query over its context), as vLLM's kernels run it
        first = _step(1, 0, len(p), 1) if n == 1 else _step(n, n * hit + n * (n + 1) // 2, 0, 0)
        decodes = [_step(1, 0, len(p) + k, 1) for k in range(1, max(out, 1))]
        expected[f"r{i}"] = (hit, list(accumulate(decodes, initial=t + first)), n)
        prompts.append(p)
        t = expected[f"r{i}"][1][-1] + rng.randint(1, 5) * MS  # the next arrives after it finished: alone
    return bs, reqs, expected


def test_hits_and_times_of_shared_prefixes_agree_with_a_hand_computation(content):
    for seed in range(40):
        bs, reqs, expected = _case(seed)
        cache = CacheConfig(groups=(FullAttentionSpec(bs),), num_gpu_blocks=5000 // bs + 50, hash_block_size=bs,
                            retention_interval=None)
        preset = EnginePreset("by-hand", cache, SchedulerConfig(), FULL)
        result = Engine(preset, content=content).run(reqs)
        for r in result.requests:
            times = list(accumulate(r.itl_ns, initial=r.first_token_ns))
            assert (r.num_local_hit_tokens, times, r.num_computed_prompt_tokens) == expected[r.request_id], (
                seed, r.request_id)
        s = result.summary
        assert s["prefix_cache_hits"] == sum(e[0] for e in expected.values()), seed
        assert s["prompt_tokens"] == s["prefix_cache_hits"] + s["computed_prompt_tokens"], seed


def _trace(tmp_path):
    from kvtrace.workload.native import write_native

    path = tmp_path / "t.jsonl"
    write_native([TraceRequest("a", 0, 5, 2, token_ids=np.arange(1, 6, dtype=np.int64))], path)
    return path


def test_a_trace_given_as_a_path_object_replays_as_its_string_does(tmp_path):
    from kvtrace.replay.run import RunSpec, run_replay

    path = _trace(tmp_path)
    by_path = run_replay(RunSpec(path, preset="dense-attention")).summary
    by_text = run_replay(RunSpec(str(path), preset="dense-attention")).summary
    assert by_path["digest"] == by_text["digest"] and by_path["trace"] == str(path)


@pytest.mark.parametrize(("setting", "flag"), [({"content": "no"}, "--no-content"), ({"content": None}, "--no-content"),
                                               ({"name": 123}, "--name"), ({"name": ["x"]}, "--name"),
                                               ({"trace": 7}, "TRACE"), ({"without": None}, "--without"),
                                               ({"without": (5,)}, "--without")])
def test_an_api_setting_of_another_type_is_refused_at_its_flag_before_a_run_is_recorded(tmp_path, setting, flag):
    from kvtrace.errors import ConfigError
    from kvtrace.replay.run import RunSpec, run_replay

    spec = RunSpec(**{"trace": str(_trace(tmp_path)), "preset": "dense-attention", **setting})
    db = tmp_path / "s.duckdb"
    with pytest.raises(ConfigError, match=f"^{flag}: ") as raised:
        run_replay(spec, db=db)
    assert "expected" in str(raised.value)
    assert not db.exists()  # (refused before the store is opened: no run recorded)


@pytest.mark.parametrize(("setting", "said"), [
    ({"percentiles": (101,)}, "engine: percentiles: percentile 101 is outside 0..100"),
    ({"percentiles": (float("nan"),)}, "engine: percentiles: percentile nan is outside 0..100"),
    ({"percentiles": "50"}, "engine: percentiles: '50': expected a sequence of numbers"),
    ({"percentiles": ()}, "engine: percentiles: (): expected a sequence of numbers"),
    ({"content": "no"}, "engine: content 'no'; expected True or False"),
    ({"preset": 5}, "engine: preset 5; expected a preset's name or an EnginePreset"),
    ({"device": "bogus"}, "engine device: bogus: expected cpu, cuda, cuda:N or torch:cpu"),
])
def test_an_engine_argument_it_cannot_use_is_one_line_before_the_run(setting, said):
    from kvtrace.errors import KVTraceError

    seen: list = []
    kw = {"preset": "dense-attention", **setting}
    with pytest.raises(KVTraceError) as raised:
        Engine(kw.pop("preset"), **kw).run([TraceRequest("a", 0, 5, 2, token_ids=np.arange(1, 6, dtype=np.int64))],
                                           [seen.append])
    assert str(raised.value).startswith(said)
    assert seen == []  # (before any step ran)


@pytest.mark.parametrize(("field", "value", "said"), [
    ("token_ids", np.array([2**63 + 5, 2, 3], dtype=np.uint64), "token_ids that are not token ids"),
    ("token_ids", np.array([-1, 2, 3]), "token_ids that are not token ids"),
    ("token_ids", np.array([163_840, 2, 3]), "token_ids that are not token ids"),  # (--no-content's sampled id)
    ("token_ids", np.array([1.5, 2.0, 3.0]), "token_ids that are not token ids"),
    ("expected_output", ("a", "b"), "expected_output that are not token ids"),
    ("expected_output", (1.5, 2), "expected_output that are not token ids"),
    ("expected_output", (5, 6, 7, 8), "4 expected_output tokens for output_length 2; expected as many"),
    ("expected_output", (5,), "1 expected_output tokens for output_length 2; expected as many"),
])
def test_an_api_requests_token_ids_are_held_to_what_the_readers_give(content, field, value, said):
    from kvtrace.errors import KVTraceError

    kw = {"token_ids": np.arange(1, 4, dtype=np.int64), field: value}
    with pytest.raises(KVTraceError, match=f"^workload: request 'a' has {said}"):
        Engine("dense-attention", content=content).run([TraceRequest("a", 0, 3, 2, **kw)])


def test_token_ids_of_other_integer_containers_still_run_as_the_same_prompt(content):
    ids = [5, 6, 7]
    runs = [Engine("dense-attention", content=content).run(
        [TraceRequest("a", 0, 3, 2, token_ids=t, expected_output=o)]).summary
        for t, o in ((np.array(ids, dtype=np.int64), (9, 8)), (ids, [9, 8]), (np.array(ids, dtype=np.int32), None))]
    assert runs[0]["mean_e2el_ms"] == runs[1]["mean_e2el_ms"] == runs[2]["mean_e2el_ms"]
    assert runs[0]["output_tokens"] == runs[1]["output_tokens"] == 2
