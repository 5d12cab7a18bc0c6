"""What the manager hands the worker each step: block lists, copies, state writes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, NamedTuple

if TYPE_CHECKING:
    from kvtrace.cache.blocks import KVCacheBlock

# StateWrite kinds
STATE_RUNNING: Final = "running"  # the state after the step's last token
STATE_CHECKPOINT: Final = "checkpoint"  # an internal prefill checkpoint inside the chunk
STATE_EXTERNAL: Final = "external"  # content loaded from the external tier before compute


class BlockCopy(NamedTuple):
    """Copy block ``src`` to ``dst`` in group ``group_id`` before this step's compute.

    ``why`` is ``partial_hit`` (a copy block swapped into the request's table) or
    ``running_tail`` (the live block stays; the cache entry moved to ``dst``).
    """

    group_id: int
    src: int
    dst: int
    request_id: str
    why: str  # events.COPY_*


class StateWrite(NamedTuple):
    """Content the worker must materialise in ``block_id`` of group ``group_id`` this step.

    kinds:
    * ``running`` (Mamba): the state after the step's last token (``num_tokens`` =
      computed tokens after the step) goes to the table's last block;
    * ``checkpoint`` (Mamba): an internal prefill checkpoint, the state after
      ``num_tokens`` (the last hash boundary before the chunk end), written into a
      slot inside the chunk;
    * ``external`` (any group): loaded from the external tier before compute. Mamba:
      the state after ``num_tokens``; attention: the block's token slots of the
      request's prefix up to ``num_tokens``.
    """

    request_id: str
    group_id: int
    block_id: int
    num_tokens: int
    kind: str  # STATE_RUNNING | STATE_CHECKPOINT | STATE_EXTERNAL


@dataclass(slots=True)
class KVCacheBlocks:
    """Per-group block lists (vLLM's ``KVCacheBlocks``)."""

    blocks: tuple[list[KVCacheBlock], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in g] for g in self.blocks)

    @staticmethod
    def empty(num_groups: int) -> KVCacheBlocks:
        return KVCacheBlocks(tuple([] for _ in range(num_groups)))
