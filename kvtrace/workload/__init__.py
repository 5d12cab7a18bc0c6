"""kvtrace.workload: the ground floor of replay.

``TraceRequest`` (what every trace reader yields and the engine consumes), the
deterministic token synthesis for traces that carry block ids instead of tokens, the
line-level checks every reader shares, and the kvtrace native trace format (reader and
writer). Imports numpy, msgspec and the stdlib, and of kvtrace only ``errors`` and
``numeric``: readers, cache-only replay and the vLLM trace reconstruction use it without
loading the engine (and torch).
"""

from kvtrace.workload.request import TraceRequest
from kvtrace.workload.tokens import VOCAB_SIZE, block_tokens, tokens_for_block_ids

__all__ = ["VOCAB_SIZE", "TraceRequest", "block_tokens", "tokens_for_block_ids"]
