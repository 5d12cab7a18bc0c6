"""Small builders shared by the cache tests."""

from __future__ import annotations

import numpy as np

from kvtrace.cache import CacheConfig, FullAttentionSpec, KVCacheManager, MambaSpec, Request


def make_request(request_id: str, tokens, **kw) -> Request:
    return Request(request_id, np.asarray(list(tokens), dtype=np.int64), **kw)


def full_mamba_config(hash_block_size=16, full_block_size=16, mamba_block_size=32, num_blocks=64, **kw) -> CacheConfig:
    return CacheConfig(
        groups=(FullAttentionSpec(full_block_size), MambaSpec(mamba_block_size)),
        num_gpu_blocks=num_blocks,
        hash_block_size=hash_block_size,
        **kw,
    )


def cached_block(manager: KVCacheManager, group: int, block_hash: bytes):
    """The block keyed by ``block_hash`` in ``group`` (ignores same-step deferral)."""
    return manager.pools[group].get_cached_block(block_hash, group)


def run_chunk(manager: KVCacheManager, request: Request, num_new_tokens: int, **kw):
    """Allocate one chunk, advance the request as the engine would, end the step."""
    out = manager.allocate_slots(request, num_new_tokens, **kw)
    assert out is not None
    request.num_computed_tokens += num_new_tokens + kw.get("num_new_computed_tokens", 0) + kw.get(
        "num_external_computed_tokens", 0
    )
    manager.take_block_copies()
    manager.take_state_writes()
    manager.new_step_starts()
    return out


def cache_and_free(manager: KVCacheManager, request_id: str, tokens, chunks) -> Request:
    """A request run in ``chunks`` (token counts), then freed and its step ended: its blocks
    cached and free."""
    request = make_request(request_id, tokens)
    for n in chunks:
        run_chunk(manager, request, n)
    manager.free(request)
    manager.new_step_starts()
    return request


def drop_keys(manager: KVCacheManager, dropped) -> int:
    """Evict the cached keys for which ``dropped(group, num_tokens)`` holds (as a stale hash);
    how many."""
    pool = manager.block_pool
    assert pool is not None
    gone = [bid for g, _h, bid, n in list(manager.cached_entries()) if dropped(g, n)]
    for bid in gone:
        pool.evict_block_keys(pool.blocks[bid], "stale_hash", None)
    return len(gone)
