"""A KV cache block and the intrusive free queue (vLLM's ``kv_cache_utils``).

The queue's links live on the blocks themselves (``prev_free`` / ``next_free``), so
popping, touching and freeing cost no allocation. The block pool inlines the list
surgery on its hot paths; this module owns the invariant both rely on:

* a block is in the free queue if and only if its ``ref_cnt == 0`` (the null block's
  ``ref_cnt`` stays 1, so it is never there);
* the links of a block in use are stale by design: nothing reads them until the block
  is freed again, which rewrites both. So the queue offers no ``remove``/``popleft``
  on arbitrary blocks: only the pool, which checks ``ref_cnt`` first, unlinks.
"""

from __future__ import annotations

from typing import final

from kvtrace.cache.hashing import BlockHash


@final  # the pool and managers test ``type(v) is KVCacheBlock`` (faster than isinstance)
class KVCacheBlock:
    """One block of the block pool (vLLM's ``KVCacheBlock``).

    A block carries at most one primary key (``block_hash`` for a prefix of
    ``hash_num_tokens`` tokens) and optional aliases: extra keys at hash boundaries
    inside it (partial hits). The pool is shared by every KV cache group, so a key is
    (hash, ``group_id``): all keys of a block belong to the group whose table took the
    block last (``group_id``), which is also the group it counts against in usage.
    """

    __slots__ = (
        "aliases",  # list[(hash, num_tokens)] of extra keys, or None
        "block_hash",  # primary key or None
        "block_id",
        "group_id",  # the KV cache group holding the block (and owning its keys); -1: never used
        "hash_num_tokens",  # prefix length (tokens) the primary key stands for
        "is_null",
        "last_used_step",  # last hit or free
        "next_free",
        "prev_free",
        "published_step",  # step of the latest key published here (for event ages)
        "ref_cnt",
    )

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.group_id = -1
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.hash_num_tokens = 0
        self.aliases: list[tuple[BlockHash, int]] | None = None
        # Queue links are read only while the block is queued, where both are set (None
        # before its first free, and at the sentinels' outer ends): typed for that use.
        self.prev_free: KVCacheBlock = None  # type: ignore[assignment]
        self.next_free: KVCacheBlock = None  # type: ignore[assignment]
        self.is_null = False
        self.published_step = -1
        self.last_used_step = -1

    def keys(self) -> list[tuple[BlockHash, int]]:
        """Every (hash, num_tokens) key that points at this block."""
        out = [] if self.block_hash is None else [(self.block_hash, self.hash_num_tokens)]
        if self.aliases:
            out.extend(self.aliases)
        return out

    def __repr__(self) -> str:
        h = self.block_hash
        shown = h.hex()[:8] if isinstance(h, bytes) else h
        return (f"KVCacheBlock({self.block_id}, group={self.group_id}, ref={self.ref_cnt}, "
                f"hash={shown}@{self.hash_num_tokens})")


class FreeKVCacheBlockQueue:
    """The free blocks, head (next to allocate) to tail (most recently freed), between
    two sentinel blocks. See the module docstring for the invariant; ``BlockPool`` is
    the only writer."""

    __slots__ = ("head", "num_free_blocks", "tail")

    def __init__(self, blocks: list[KVCacheBlock]):
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-2)
        self.num_free_blocks = len(blocks)
        prev = self.head
        for b in blocks:
            prev.next_free = b
            b.prev_free = prev
            prev = b
        prev.next_free = self.tail
        self.tail.prev_free = prev

    def block_ids(self) -> list[int]:
        """Free block ids in queue order (head first): for tests and introspection."""
        out = []
        b = self.head.next_free
        while b is not self.tail:
            assert b is not None
            out.append(b.block_id)
            b = b.next_free
        return out
