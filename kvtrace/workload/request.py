"""The replayable request stream: what trace readers produce and the engine consumes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # readers build requests without numpy; only the tokens need it
    import numpy as np


@dataclass(slots=True)
class TraceRequest:
    request_id: str
    arrival_ns: int
    input_length: int
    output_length: int
    # Exactly one of token_ids / hash_ids describes the prompt.
    token_ids: np.ndarray | None = None  # int64, len == input_length
    hash_ids: tuple[int, ...] | None = None  # prefix-chained block ids
    hash_block_size: int = 0  # tokens per hash id
    namespace: int = 0  # scope of hash ids (WEKA "local" ids are per file)
    session_id: str | None = None
    cache_salt: str | None = None
    expected_output: tuple[int, ...] | None = None

    def prompt_token_ids(self) -> np.ndarray:
        if self.token_ids is not None:
            return self.token_ids
        assert self.hash_ids is not None
        from kvtrace.workload.tokens import tokens_for_block_ids

        return tokens_for_block_ids(self.hash_ids, self.hash_block_size, self.input_length, self.namespace)
