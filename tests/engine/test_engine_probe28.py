"""What a stored engine run says, against an independent computation over its own spans, and
the scheduler at vLLM's production seat counts.

The times: every step span lasts what the cost formula of ``kvtrace/engine/clock.py`` (and the
README) gives for the work the step did, where that work is rebuilt here from the stored
request spans alone (each request's hits, prefill chunks and token times): prefill pairs,
decode context, the knee, the external tier's KV and state loads charged to the step that
admits the request, and copies. The summary's latency statistics are recomputed from the
stored request spans with numpy as ``vllm bench serve`` computes them. Under preemption, each
step's prefill tokens are the chunks that ended with it (the recompute of a preempted
request's prompt and outputs included, once), and the preemption and re-lookup counters of
the steps, the requests and the summary add up.

The scheduler: earlier cases held ``max_num_seqs`` at 2 to 256; here 700 and 1,300 short
requests fill 512 and 1,024 seats under 16k to 64k budgets, on a roomy and a tight pool, and
every step agrees with vLLM 0.33's own ``Scheduler``.
"""

from __future__ import annotations

import json
import random
from collections import Counter, defaultdict
from itertools import accumulate, pairwise

import duckdb
import numpy as np
import pytest

from kvtrace.cache import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from kvtrace.engine import get_preset
from kvtrace.replay.run import RunSpec, run_replay
from tests.support.scheduler_conformance import SchedulerCase, run_scheduler_conformance

# A cost model of every linear term (no MoE: its fixed point is the clock's own), each
# coefficient distinct enough that a term charged to the wrong step shows.
COST = dict(step_overhead_ns=1_000_000, token_ns=7_000, token_knee=64, token_above_knee_ns=3_000, attn_pair_ps=250,
            kv_read_ps=1_900, decode_seq_ns=15_000, kv_copy_ns=2_000, state_copy_ns=50_000, kv_load_ns=170,
            state_load_ns=800_000)


def _config(path, preset: str, cache: dict, scheduler: dict | None = None) -> str:
    lines = [f'preset = "{preset}"', "[cache]", *(f"{k} = {v}" for k, v in cache.items())]
    if scheduler:
        lines += ["[scheduler]", *(f"{k} = {str(v).lower()}" for k, v in scheduler.items())]
    lines += ["[cost_model]", 'name = "probe28"', *(f"{k} = {v}" for k, v in COST.items())]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _formula(tokens: int, pairs: int, context: int, decodes: int, kv_copies: int, state_copies: int,
             kv_loads: int, state_loads: int) -> int:
    """The README's step cost, written out again (integer ns; the pair and read terms in ps)."""
    c = COST
    ns = (c["step_overhead_ns"] + c["token_ns"] * tokens + (c["attn_pair_ps"] * pairs + c["kv_read_ps"] * context)
          // 1000 + c["decode_seq_ns"] * decodes + c["kv_copy_ns"] * kv_copies + c["state_copy_ns"] * state_copies
          + c["kv_load_ns"] * kv_loads + c["state_load_ns"] * state_loads)
    return ns + c["token_above_knee_ns"] * max(0, tokens - c["token_knee"])


def _read(db: str):
    con = duckdb.connect(db, read_only=True)
    try:
        reqs = con.sql("SELECT request_id, arrival_ns, first_scheduled_ns, first_token_ns, end_ns, num_prompt_tokens, "
                       "num_hit_tokens, num_external_hit_tokens, num_output_tokens, num_computed_tokens, "
                       "num_preemptions, itl_ns, prefill_chunks, num_preempted_query_tokens, "
                       "num_preempted_hit_tokens FROM request_spans").fetchall()
        steps = con.sql("SELECT step, start_ns, end_ns, num_prefill_tokens, num_decode_seqs, num_copies, num_preempted "
                        "FROM step_spans ORDER BY step").fetchall()
    finally:
        con.close()
    return reqs, steps


def _token_times(first_token_ns: int, gaps) -> list[int]:
    return list(accumulate([first_token_ns, *(gaps or [])]))


@pytest.fixture(scope="module")
def hybrid_run(tmp_path_factory):
    """kimi-hybrid on a 60-block pool behind a 400-block external tier: hits, CoW copies of
    blocks and states, loads of KV and states, chunked prefills and decodes, no preemption."""
    tmp = tmp_path_factory.mktemp("probe28")
    config = _config(tmp / "hybrid.toml", "kimi-hybrid", {"num_gpu_blocks": 60, "external_capacity_blocks": 400})
    db = str(tmp / "hybrid.duckdb")
    summary = run_replay(RunSpec("gen:mixed", limit=40, config_file=config), db=db).summary
    return summary, *_read(db)


def test_every_step_lasts_the_cost_formula_of_the_work_its_requests_did(hybrid_run):
    summary, reqs, steps = hybrid_run
    assert summary["cost_model"] == "probe28" and summary["preemptions"] == 0
    state_groups = sum(isinstance(g, MambaSpec) for g in get_preset("kimi-hybrid").cache_config.groups)
    work: dict[int, Counter] = defaultdict(Counter)  # step end -> the work rebuilt from the request spans
    for (_, _, _, first, _, prompt, hit, ext, _, computed, _, gaps, chunks, _, _) in reqs:
        assert computed + hit + ext == prompt  # every prompt token once: hit, loaded or computed
        pos = hit + ext
        for chunk in chunks:
            w, n = work[chunk["end_ns"]], chunk["num_tokens"]
            w["tokens"] += n
            if n == 1 and pos == prompt - 1:  # the prompt's last token alone: run as a decode
                w["decodes"] += 1
                w["context"] += prompt
            else:
                w["pairs"] += n * pos + n * (n + 1) // 2
            pos += n
        if ext:  # loaded in the step that admits the request
            w = work[chunks[0]["end_ns"]]
            w["kv_loads"] += ext
            w["state_loads"] += state_groups
        for k, t in enumerate(_token_times(first, gaps)[1:], start=1):  # each later token: a decode step
            w = work[t]
            w["tokens"] += 1
            w["decodes"] += 1
            w["context"] += prompt + k
    seen: Counter = Counter()
    for step, start, end, prefill, decodes, copies, _ in steps:
        w = work[end]
        assert (prefill, decodes) == (w["tokens"] - w["decodes"], w["decodes"]), step
        base = _formula(w["tokens"], w["pairs"], w["context"], w["decodes"], 0, 0, w["kv_loads"], w["state_loads"])
        # the step span counts copies of either kind: some split of them is the rest of the time
        assert end - start in {base + _formula(0, 0, 0, 0, a, copies - a, 0, 0) - COST["step_overhead_ns"]
                               for a in range(copies + 1)}, step
        seen.update(loads=w["kv_loads"] > 0, copies=copies > 0, knee=w["tokens"] > COST["token_knee"],
                    decode_only=w["tokens"] == w["decodes"])
    assert all(seen[k] for k in ("loads", "copies", "knee", "decode_only")), seen  # each term was exercised
    # consecutive steps, or an idle gap that ends at an arrival
    arrivals = {r[1] for r in reqs}
    assert all(b[1] == a[2] or (b[1] > a[2] and b[1] in arrivals) for a, b in pairwise(steps))


def test_the_summary_latencies_are_the_stored_request_spans_statistics(hybrid_run):
    summary, reqs, steps = hybrid_run
    samples: dict[str, list[float]] = defaultdict(list)
    ends = {s[2] for s in steps}
    starts = {s[1] for s in steps}
    for (_, arrival, scheduled, first, end, _, _, _, outputs, _, _, gaps, _, _, _) in reqs:
        gaps = list(gaps or [])
        assert scheduled in starts and first in ends and end in ends and arrival <= scheduled < first <= end
        assert len(gaps) == outputs - 1 and _token_times(first, gaps)[-1] == end
        samples["ttft"].append(first - arrival)
        samples["e2el"].append(end - arrival)
        samples["queue"].append(scheduled - arrival)
        samples["itl"] += gaps
        if outputs > 1:
            samples["tpot"].append((end - first) / (outputs - 1))
    for key, values in samples.items():
        ms = np.asarray(values, dtype=np.float64) / 1e6
        mine = {"mean": ms.mean(), "std": ms.std(), "median": np.percentile(ms, 50),
                **{f"p{p}": np.percentile(ms, p) for p in (50, 90, 99)}}
        for stat, value in mine.items():
            assert summary[f"{stat}_{key}_ms"] == pytest.approx(value, rel=1e-9, abs=1e-9), (stat, key)
    assert summary["steps"] == len(steps) and summary["requests"] == len(reqs)
    assert summary["output_tokens"] == sum(r[8] for r in reqs)
    assert summary["virtual_duration_s"] == pytest.approx((steps[-1][2] - min(r[1] for r in reqs)) / 1e9, rel=1e-12)


def test_recompute_after_preemption_is_counted_once_in_steps_requests_and_summary(tmp_path):
    config = _config(tmp_path / "tight.toml", "dense-attention", {"num_gpu_blocks": 1000},
                     {"max_num_batched_tokens": 1024, "scheduler_reserve_full_isl": False})
    db = str(tmp_path / "tight.duckdb")
    summary = run_replay(RunSpec("gen:agent", limit=60, config_file=config, content=False), db=db).summary
    reqs, steps = _read(db)
    preempted = [r for r in reqs if r[10]]
    assert summary["preemptions"] >= 5 and preempted
    chunk_tokens: Counter = Counter()
    sampled: Counter = Counter()
    for (_, _, _, first, _, prompt, hit, ext, outputs, computed, preemptions, gaps, chunks, queries, hits) in reqs:
        for chunk in chunks:
            chunk_tokens[chunk["end_ns"]] += chunk["num_tokens"]
        sampled.update(_token_times(first, gaps))
        assert len(_token_times(first, gaps)) == outputs  # no token sampled twice for a recompute
        if preemptions:  # the prompt again after each preemption, less what it hit then
            assert computed >= prompt - hit - ext and queries >= preemptions and hits <= queries
        else:
            assert computed + hit + ext == prompt and queries == hits == 0
    for step, _, end, prefill, decodes, _, _ in steps:
        assert prefill == chunk_tokens[end] and decodes <= sampled[end], step
    assert summary["preemptions"] == sum(r[10] for r in reqs) == sum(s[6] for s in steps)
    assert summary["preempted_prefix_cache_queries"] == sum(r[13] for r in reqs) > 0
    assert summary["preempted_prefix_cache_hits"] == sum(r[14] for r in reqs)
    assert summary["computed_prompt_tokens"] == sum(r[9] for r in reqs) > summary[
        "prompt_tokens_by_source.local_compute"]  # the recompute is prefill work vLLM's counter leaves out
    assert sum(summary[f"prompt_tokens_by_source.{k}"] for k in ("local_compute", "local_cache_hit",
                                                                  "external_kv_transfer")) == summary["prompt_tokens"]


def _short_requests(path, n: int) -> str:
    """``n`` short prompts over eight shared prefixes, 20-63 output tokens each: seats, not
    the budget, bind."""
    rng = random.Random(3)
    prefixes = [[rng.randrange(50_000) for _ in range(rng.randrange(16, 64))] for _ in range(8)]
    lines = [{"kvtrace_trace": 1}]
    for i in range(n):
        prompt = rng.choice(prefixes) + [rng.randrange(50_000) for _ in range(rng.randrange(1, 48))]
        lines.append(dict(request_id=f"q{i}", arrival_ns=i, input_length=len(prompt),
                          output_length=rng.randrange(20, 64), token_ids=prompt))
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


@pytest.mark.parametrize("seqs, budget, requests, pool", [(512, 16_384, 700, 20_000), (1024, 65_536, 1300, 20_000),
                                                          (512, 16_384, 700, 1500), (1024, 32_768, 1300, 2600)])
def test_hundreds_of_seats_schedule_as_vllms(vllm_api, tmp_path, seqs, budget, requests, pool):
    trace = _short_requests(tmp_path / "short.jsonl", requests)
    tight = pool < 5000  # (the gate off: the pool forces preemptions instead of holding requests back)
    run = run_scheduler_conformance(SchedulerCase(trace, limit=requests, concurrency=requests, max_num_seqs=seqs,
                                                  max_num_batched_tokens=budget, capacity_blocks=pool,
                                                  max_output_tokens=64, reserve_full_isl=not tight), vllm_api)
    assert run.agree and run.finished == run.requests == requests, run.report()
    if tight:
        assert run.preemptions > 100 and run.resumed == run.preemptions, run.report()
    else:
        assert run.max_running == seqs and run.waited_for_seqs > 0, run.report()


def _allocated_bytes(value) -> int:
    """Bytes of every numpy array ``value`` holds (in lists and tuples too)."""
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, (list, tuple)):
        return sum(map(_allocated_bytes, value))
    return 0


@pytest.mark.parametrize("groups", [
    (FullAttentionSpec(16),),
    (FullAttentionSpec(16), SlidingWindowSpec(16, sliding_window=64)),
    (FullAttentionSpec(64), MambaSpec(64, num_lanes=6)),
])
@pytest.mark.parametrize("pools", ["shared", "per-group"])
def test_the_size_checked_before_a_run_is_what_the_storage_allocates(groups, pools):
    """``storage_bytes`` (what the check before a run compares with the machine's memory, and
    the GiB its refusal names) counted an attention block's slots and block sum, not its write
    stamp and remembered prefix: 17 int64s a 16-token block where the storage holds 21, so a
    pool it let through could need a quarter more memory than it said."""
    from kvtrace.cache import CacheConfig
    from kvtrace.engine.memory import storage_bytes
    from kvtrace.engine.storage import DeviceStorage

    blocks = 1000 if pools == "shared" else [1000 + 100 * i for i in range(len(groups))]
    config = CacheConfig(groups=groups, num_gpu_blocks=blocks, hash_block_size=16)
    storage = DeviceStorage(config, "cpu")
    assert storage_bytes(config) == sum(_allocated_bytes(v) for v in vars(storage).values()) > 0


@pytest.mark.parametrize(("setting", "said"), [
    ({"verify": "no"}, "engine: verify 'no'; expected True or False"),
    ({"verify": None}, "engine: verify None; expected True or False"),
    ({"audit_interval": "5"}, "engine: audit_interval '5'; expected a number of steps"),
    ({"audit_interval": 1.5}, "engine: audit_interval 1.5; expected a number of steps"),
    ({"audit_interval": -1}, "engine: audit_interval -1; expected a number of steps"),
    ({"audit_interval": True}, "engine: audit_interval True; expected a number of steps"),
    ({"cpu_threads": 0}, "engine: cpu_threads 0; expected an int >= 1"),
    ({"cpu_threads": "x"}, "engine: cpu_threads 'x'; expected an int >= 1"),
])
def test_an_engine_argument_of_the_audit_or_threads_it_cannot_use_is_one_line_before_the_run(setting, said):
    """verify="no" ran with verification (and its summary counted what that found), an
    audit interval of "5" was a TypeError traceback after the first step, 1.5 audited at
    every third step and -1 at every step: each is refused before anything runs, as
    content="no" is."""
    from kvtrace.engine import Engine
    from kvtrace.errors import KVTraceError
    from kvtrace.workload import TraceRequest

    seen: list = []
    work = [TraceRequest("a", 0, 5, 2, token_ids=np.arange(1, 6, dtype=np.int64))]
    with pytest.raises(KVTraceError) as raised:
        Engine("dense-attention", **setting).run(work, [seen.append])
    assert str(raised.value).startswith(said) and "\n" not in str(raised.value)
    assert seen == []


def test_an_audit_interval_of_0_audits_once_at_the_end():
    from kvtrace.engine import Engine
    from kvtrace.workload import TraceRequest

    work = [TraceRequest(f"r{i}", 0, 40, 3, token_ids=np.arange(7, 47, dtype=np.int64)) for i in range(3)]
    summary = Engine("dense-attention", audit_interval=0).run(work).summary
    assert summary["stale_hashes"] == 0 and summary["prefix_cache_hits"] > 0
