"""Requests a real server traced: vLLM's ``llm_request`` spans (received by ``kvtrace
collect``), with the latency breakdown vLLM puts on them (``gen_ai.latency.*``, seconds)."""

from __future__ import annotations

import polars as pl

from kvtrace.store.read._api import checked
from kvtrace.store.read._sql import DB, with_run

VLLM_REQUEST_SPAN = "llm_request"  # vllm.v1.engine.output_processor.OutputProcessor.do_tracing
# vLLM's names (vllm.tracing.utils.SpanAttributes) for what the store has no column for:
# they land in extra_attributes as text. Token counts also come under today's OTel names.
_FLOAT_ATTRIBUTES = {
    "queue_s": "gen_ai.latency.time_in_queue",
    "ttft_s": "gen_ai.latency.time_to_first_token",
    "prefill_s": "gen_ai.latency.time_in_model_prefill",
    "decode_s": "gen_ai.latency.time_in_model_decode",
    "e2e_s": "gen_ai.latency.e2e",
}
_TOKENS = {"prompt_tokens": ("num_prompt_tokens", "gen_ai.usage.prompt_tokens"),
           "completion_tokens": ("num_output_tokens", "gen_ai.usage.completion_tokens")}


@checked
def served_requests(db: DB, run_id: str) -> pl.DataFrame:
    """One row per ``llm_request`` span of the run, by arrival. Columns: span_id,
    arrival_ns (the span's start, vLLM's arrival time), prompt_tokens, completion_tokens,
    queue_s, ttft_s, prefill_s, decode_s, e2e_s (NULL where the span lacks one)."""
    floats = ", ".join(f"TRY_CAST(extra_attributes['{key}'] AS DOUBLE) AS {name}"
                       for name, key in _FLOAT_ATTRIBUTES.items())
    tokens = ", ".join(f"coalesce({col}, TRY_CAST(extra_attributes['{key}'] AS BIGINT)) AS {name}"
                       for name, (col, key) in _TOKENS.items())
    return with_run(db, run_id, f"""
        SELECT span_id, start_ns AS arrival_ns, {tokens}, {floats}
        FROM spans WHERE run_id = $run_id AND name = '{VLLM_REQUEST_SPAN}'
        ORDER BY start_ns, span_id""")
