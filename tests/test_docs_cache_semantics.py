"""docs/cache_semantics.md against the cache manager: each rule the page states, built as a small case."""

from __future__ import annotations

from pathlib import Path

from kvtrace.cache import CacheConfig, FullAttentionSpec, KVCacheManager
from tests.cache.helpers import full_mamba_config, make_request

DOC = " ".join((Path(__file__).resolve().parents[1] / "docs" / "cache_semantics.md").read_text(encoding="utf-8")
               .split())


def _admit(manager: KVCacheManager, request_id: str, tokens: list[int]):
    """Look a new request up and allocate the rest of its prompt in the current step (None: refused)."""
    request = make_request(request_id, tokens)
    blocks, hit, _ = manager.get_computed_blocks(request)
    return hit, manager.allocate_slots(request, len(tokens) - hit, hit, blocks)


def test_an_attention_key_is_hittable_in_the_step_that_published_it():
    """The page said every key published in a step is hittable from the next step only: an
    attention key is hit, and allocated, by a request scheduled later in the same step."""
    assert "An attention key is hittable at once, by a request scheduled later in the same step" in DOC
    m = KVCacheManager(CacheConfig(groups=(FullAttentionSpec(4),), num_gpu_blocks=10, hash_block_size=4))
    assert _admit(m, "a", list(range(13)))[0] == 0
    hit, allocated = _admit(m, "b", list(range(13)))  # (no new_step_starts between the two)
    assert hit == 12 and allocated is not None


def test_a_mamba_state_published_in_a_step_ends_a_hit_only_from_the_next_step():
    said = ("A Mamba state published in a step can end a hit only from the next step (the same-step rule): "
            "`get_computed_blocks` may return that hit, and `allocate_slots` refuses the request until then.")
    assert said in DOC
    m = KVCacheManager(full_mamba_config(hash_block_size=16, full_block_size=16, mamba_block_size=16))
    a = make_request("a", range(40))
    assert m.allocate_slots(a, 32) is not None  # a chunk ending on a block boundary: its state is published
    b = list(range(32)) + [999] * 10
    hit, allocated = _admit(m, "b", b)
    assert hit == 32 and allocated is None
    a.num_computed_tokens = 32
    m.take_block_copies()
    m.take_state_writes()
    m.new_step_starts()
    hit, allocated = _admit(m, "b2", b)
    assert hit == 32 and allocated is not None



def test_trace_ids_are_kvtraces_keys_where_their_synthesised_tokens_coincide():
    """The page said only cache-only replay keys on a trace's ids: engine mode does too, and
    vLLM's manager, hashing the synthesised tokens, sees a hit at block size 1 that the
    trace's distinct ids do not hold (490 and 601 are both token 111597)."""
    from kvtrace.engine import Engine, get_preset
    from kvtrace.workload.request import TraceRequest
    from kvtrace.workload.tokens import block_tokens

    assert "kvtrace's manager (cache-only and engine mode) keys its units on the ids" in DOC
    assert list(block_tokens(490, 1)) == list(block_tokens(601, 1))
    assert list(block_tokens(490, 4)) != list(block_tokens(601, 4))

    def hits(by_ids: bool) -> int:
        reqs = [TraceRequest(f"r{i}", i * 10**9, 2, 1, **({"hash_ids": (b, 7), "hash_block_size": 1} if by_ids else
                                                       {"token_ids": [*block_tokens(b, 1), *block_tokens(7, 1)]}))
                for i, b in enumerate((490, 601))]
        engine = Engine(get_preset("dense-attention", block_size=1, capacity_blocks=64), content=False)
        return engine.run(reqs).summary["prefix_cache_hits"]

    assert hits(by_ids=True) == 0  # (distinct ids: no hit, whatever their tokens)
    assert hits(by_ids=False) == 1  # (the same tokens, as vLLM's hashes see them: the first block hits)
