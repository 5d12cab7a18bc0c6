"""The cache's view of a request (vLLM's ``Request``, reduced to what the cache reads).

The engine may subclass it to add scheduling fields; the cache only uses the slots here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvtrace.workload.tokens import tokens_for_block_ids

try:
    from mypy_extensions import mypyc_attr
except ImportError:  # (mypy's: installed where mypyc compiles; without it, a no-op)
    def mypyc_attr(*attrs: str, **kwattrs: object):  # type: ignore[misc]
        return lambda cls: cls

if TYPE_CHECKING:
    from kvtrace.cache.hashing import BlockHash, BlockHasher


@mypyc_attr(allow_interpreted_subclasses=True)
class Request:
    """One request's tokens, progress and block hashes.

    ``prompt_token_ids`` may be None when ``trace_block_ids`` are given (pass
    ``num_prompt_tokens``): the tokens are then synthesised on first access, and the
    block hashes come from the per-trace-block memo without materialising tokens.

    ``num_computed_tokens`` is advanced by the engine after each step.
    ``shared_prefix_boundary`` is set by the scheduler from ``get_computed_blocks``.
    ``block_hashes`` (``hash_block_size`` units) fill in lazily as tokens grow, once the
    manager has seen the request; a caller with its own keys may pass them in (the
    request then owns that list and extends it as tokens grow).
    """

    __slots__ = (
        "_block_hashes",
        "_hasher",
        "_prompt",
        "cache_salt",
        "lora_name",
        "namespace",
        "num_computed_tokens",
        "num_prompt_tokens",
        "output_token_ids",
        "request_id",
        "shared_prefix_boundary",
        "trace_block_ids",
        "trace_block_size",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: np.ndarray | None,
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        trace_block_ids: tuple[int, ...] | None = None,
        trace_block_size: int = 0,
        namespace: int = 0,
        num_prompt_tokens: int | None = None,
        block_hashes: Sequence[BlockHash] | None = None,
    ):
        self.request_id = request_id
        self.cache_salt = cache_salt or None  # (an empty salt is none: vLLM salts only with a non-empty one)
        self.lora_name = lora_name
        self.trace_block_ids = tuple(trace_block_ids) if trace_block_ids is not None else None
        self.trace_block_size = int(trace_block_size)
        self.namespace = int(namespace)
        if prompt_token_ids is None:
            if self.trace_block_ids is None or num_prompt_tokens is None:
                raise ValueError("Request: prompt_token_ids=None needs trace_block_ids and num_prompt_tokens")
            self._prompt = None
            self.num_prompt_tokens = int(num_prompt_tokens)
        else:
            self._prompt = np.asarray(prompt_token_ids, dtype=np.int64)
            self.num_prompt_tokens = int(self._prompt.shape[0])
        self.num_computed_tokens = 0
        self.output_token_ids: list[int] = []
        self.shared_prefix_boundary = 0
        # Precomputed keys (cache-only replay keys blocks by trace id) skip the hasher. The
        # sequence is taken over, not copied (a per-request copy is measurable in that
        # replay); a tuple is fine when the request never outgrows it, as there.
        self._block_hashes: Sequence[BlockHash] = block_hashes if block_hashes is not None else []
        self._hasher: BlockHasher | None = None

    # -- tokens -------------------------------------------------------------------
    @property
    def prompt_token_ids(self) -> np.ndarray:
        if self._prompt is None:
            assert self.trace_block_ids is not None  # __init__ requires them without prompt tokens
            self._prompt = tokens_for_block_ids(
                self.trace_block_ids, self.trace_block_size, self.num_prompt_tokens, self.namespace
            )
        return self._prompt

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> np.ndarray:
        if not self.output_token_ids:
            return self.prompt_token_ids
        return np.concatenate([self.prompt_token_ids, np.asarray(self.output_token_ids, dtype=np.int64)])

    def get_token_ids(self, start: int, end: int) -> np.ndarray:
        """Tokens [start, end) of prompt + output, without copying the whole sequence."""
        p = self.num_prompt_tokens
        if end <= p:
            return self.prompt_token_ids[start:end]
        out = np.asarray(self.output_token_ids[max(start - p, 0):end - p], dtype=np.int64)
        if start >= p:
            return out
        return np.concatenate([self.prompt_token_ids[start:p], out])

    def append_output_token_ids(self, token_ids: int | list[int] | np.ndarray) -> None:
        if isinstance(token_ids, (int, np.integer)):
            self.output_token_ids.append(int(token_ids))
        else:
            self.output_token_ids.extend(int(t) for t in token_ids)

    # -- hashes -------------------------------------------------------------------
    def bind_hasher(self, hasher: BlockHasher) -> None:
        """Hash this request with ``hasher`` from now on (the first bound one stays)."""
        if self._hasher is None:
            self._hasher = hasher

    def update_block_hashes(self) -> None:
        """Hash every full unit of the tokens so far (``block_hashes`` does it lazily)."""
        h = self._hasher
        if h is not None:
            h.update(self)

    @property
    def block_hashes(self) -> Sequence[BlockHash]:
        """Chained hashes of every full ``hash_block_size`` unit (grows with tokens)."""
        h = self._hasher
        if h is not None and len(self._block_hashes) < (
            self.num_prompt_tokens + len(self.output_token_ids)
        ) // h.hash_block_size:
            h.update(self)
        return self._block_hashes

    @property
    def is_finished_prompt(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, "
            f"computed={self.num_computed_tokens}, out={len(self.output_token_ids)})"
        )
