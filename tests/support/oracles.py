"""Reference models the tests check the package against (and bench times it against).

``lru_reference``: a bare OrderedDict LRU with cache-only replay's conventions
(``kvtrace.replay.cache_only``): vLLM's free order, one block per trace id, the partial
last block included.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def lru_reference(keys: Sequence[Sequence[int]], capacity: int) -> tuple[list[int], int, int, int]:
    """Bare OrderedDict LRU with vLLM's free order: (hits per request, publishes,
    evictions, oversized). The benchmark's baseline and the tests' oracle."""
    free: OrderedDict[int, None] = OrderedDict()  # cached, unused; first = next victim
    unhashed = capacity  # never-used blocks (popped before any eviction)
    hits: list[int] = []
    publishes = evictions = oversized = 0
    for ks in keys:
        n = len(ks)
        hit = 0
        while hit < n and ks[hit] in free:
            hit += 1
        hits.append(hit)
        if n > capacity:
            oversized += 1
            continue
        for k in ks[:hit]:
            del free[k]  # touch: in use now
        need = n - hit
        take = min(need, unhashed)
        unhashed -= take
        for _ in range(need - take):
            free.popitem(last=False)
            evictions += 1
        # No key past the hit can still be cached: a child is always used with its parent
        # and freed before it, so LRU never evicts a parent before its children.
        publishes += need
        for k in reversed(ks):
            free[k] = None
    return hits, publishes, evictions, oversized
