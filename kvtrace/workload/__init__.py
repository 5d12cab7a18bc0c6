"""kvtrace.workload: the ground floor of replay.

``TraceRequest`` (what every trace reader yields and the engine consumes), the
deterministic token synthesis for traces that carry block ids instead of tokens, the
line-level checks every reader shares, and the kvtrace native trace format (reader and
writer). Imports numpy, msgspec and the stdlib, and of kvtrace only ``errors`` and
``numeric``: readers, cache-only replay and the vLLM trace reconstruction use it without
loading the engine (and torch).
"""


from typing import TYPE_CHECKING

from kvtrace.lazy import lazy_exports

# Loaded on first use: the line checks (``workload.lines``) serve the CLI's error paths,
# which must not pay for numpy.
__getattr__ = lazy_exports(__name__, {"TraceRequest": "request", "VOCAB_SIZE": "lines",
                                      "block_tokens": "tokens", "tokens_for_block_ids": "tokens"})
__all__ = ["VOCAB_SIZE", "TraceRequest", "block_tokens", "tokens_for_block_ids"]

if TYPE_CHECKING:
    from kvtrace.workload.lines import VOCAB_SIZE
    from kvtrace.workload.request import TraceRequest
    from kvtrace.workload.tokens import block_tokens, tokens_for_block_ids
