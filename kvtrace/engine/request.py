"""The engine's request: the cache's ``Request`` plus arrival, status, outputs and timings."""

from __future__ import annotations

from kvtrace.cache import Request
from kvtrace.workload import TraceRequest

WAITING = "waiting"
RUNNING = "running"
PREEMPTED = "preempted"
FINISHED = "finished"


class EngineRequest(Request):
    __slots__ = (
        "arrival_ns",
        "expected_output",
        "first_scheduled_ns",
        "first_token_ns",
        "looked_up",
        "max_tokens",
        "num_computed_prompt_tokens",
        "num_divergent_tokens",
        "num_external_hit_tokens",
        "num_external_query_tokens",
        "num_local_hit_tokens",
        "num_preempted_hit_tokens",
        "num_preempted_query_tokens",
        "num_preemptions",
        "prefill_chunks",
        "session_id",
        "status",
        "token_times_ns",
    )

    def __init__(self, trace: TraceRequest):
        if trace.hash_ids is not None and trace.token_ids is None:
            super().__init__(
                trace.request_id,
                None,
                cache_salt=trace.cache_salt,
                trace_block_ids=trace.hash_ids,
                trace_block_size=trace.hash_block_size,
                namespace=trace.namespace,
                num_prompt_tokens=trace.input_length,
            )
        else:
            super().__init__(trace.request_id, trace.prompt_token_ids(), cache_salt=trace.cache_salt)
        self.arrival_ns = int(trace.arrival_ns)
        self.max_tokens = max(int(trace.output_length), 1)
        self.session_id = trace.session_id
        self.expected_output = trace.expected_output
        self.status = WAITING
        self.num_preemptions = 0
        self.first_scheduled_ns = -1
        self.first_token_ns = -1
        self.token_times_ns: list[int] = []
        self.prefill_chunks: list[tuple[int, int, int]] = []
        self.num_local_hit_tokens = -1
        self.num_external_hit_tokens = 0
        # vLLM's hit counters, recorded at admission (kvtrace.metrics.PER_REQUEST)
        self.num_external_query_tokens = 0
        self.num_preempted_query_tokens = 0
        self.num_preempted_hit_tokens = 0
        self.num_computed_prompt_tokens = 0
        self.num_divergent_tokens = 0
        self.looked_up = False

    def release_tokens(self) -> None:
        """Drop the token arrays of a finished request (memory stays bounded on long traces)."""
        self._prompt = None
        self._block_hashes = []
