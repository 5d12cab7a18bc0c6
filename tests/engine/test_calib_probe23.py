"""The twenty-third session's probe of calibration, cost models, presets and TOML configs."""

from __future__ import annotations

import json

from kvtrace.engine.clock import CostModel, prefill_pairs
from kvtrace.replay.calibrate import calibrate

KNOWN = CostModel("known", 4_000_000, 15_000, 900, 30_000, 2_000)


def _bench_one_at_a_time(model: CostModel, lengths: list[int], budget: int = 8192) -> dict:
    """A ``vllm bench serve`` result of requests served one at a time by ``model``: each TTFT
    its prompt's chunks of ``budget``, each gap one decode step (no start_times)."""
    ins, outs, ttfts, itls = [], [], [], []
    for i, n in enumerate(lengths):
        o = 4 + i % 5
        ttft, start = 0, 0
        while start < n:
            chunk = min(budget, n - start)
            ttft += model.step_ns(chunk, prefill_pairs(start, chunk), 0, 0, 0, 0)
            start += chunk
        ins.append(n)
        outs.append(o)
        ttfts.append(ttft / 1e9)
        itls.append([model.step_ns(1, 0, n + j, 1, 0, 0) / 1e9 for j in range(1, o)])
    return {"max_concurrency": 1, "input_lens": ins, "output_lens": outs, "ttfts": ttfts, "itls": itls}


def test_a_bench_result_with_a_gap_more_than_its_tokens_still_fits_exactly(tmp_path):
    """vllm bench serve times every streamed chunk that has choices, an empty one too, so a
    request can have more gaps than output tokens - 1. Without start_times each gap was read as
    a decode step: one trailing gap of 2 us among 53 observations fitted every coefficient but
    the token terms to 0, median error 100% (the timeline reading, with start_times, took the
    request's gaps together, as it does those of a client that read several tokens a chunk)."""
    doc = _bench_one_at_a_time(KNOWN, [100, 300, 700, 1500, 3000, 6000, 9000, 12000, 20])
    doc["itls"][2].append(2e-6)  # request 2: one gap more than its tokens after the first
    doc["itls"][4].append(3e-6)
    doc["output_lens"].append(1)  # a request of one token, and a chunk after it: no decode step
    doc["input_lens"].append(500)
    doc["ttfts"].append(KNOWN.step_ns(500, prefill_pairs(0, 500), 0, 0, 0, 0) / 1e9)
    doc["itls"].append([2e-6])
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(doc))
    fit = calibrate([path], name="fitted", knee=0)
    assert fit.max_error < 1e-3, fit.max_error  # (the empty chunks' few microseconds, in their requests' decodes)
    for c in ("step_overhead_ns", "token_ns", "attn_pair_ps", "kv_read_ps", "decode_seq_ns"):
        assert abs(getattr(fit.model, c) - getattr(KNOWN, c)) <= max(100, 0.01 * getattr(KNOWN, c)), (c, fit.model)
