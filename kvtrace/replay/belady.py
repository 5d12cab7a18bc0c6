"""Offline-optimal (Belady MIN) bound for cache-only replay, and trace block keys.

Cache-only conventions (Mooncake paper, Dynamo ``datagen analyze``): each trace hash id
is one block, the partial last block included, and a request's hit is its
prefix-contiguous cached blocks. Belady replays the same trace knowing the future: when
a block must be evicted it takes the cached, unused block whose next use is farthest
(never used again first). Blocks of the running request cannot be evicted.

Ties (equal next use) go to the block deepest in its prefix chain: a child is never used
without its parent, so its next use is never earlier, and evicting it first keeps the
cache prefix-closed (no cached block behind a missing one), as LRU with vLLM's free order
also does. With nested reuse like this, MIN gives the best hit count any eviction policy
can reach on the trace: the headroom a user sees against LRU. A request of more blocks
than the cache holds is served uncached: its hit counts, but it refills nothing. Whether
keeping a block for such a hit pays depends on the trace, so MIN is then run both ways
(``belady_hits``) and the better schedule kept: a bound, not always the optimum, and in
rare traces below LRU (1 of 80,000 small random ones, where LRU kept a block for such a
hit by chance).

Implementation: a max-heap on (next use, depth) with lazy deletion (an entry is stale
when its block was evicted or re-used since; a version number tells).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from kvtrace.workload import TraceRequest

NEVER = 1 << 62


def chain_keys(requests: Iterable[TraceRequest]) -> tuple[list[list[int]], list[int], list[int]]:
    """Interned block keys of each request: equal key == equal (salt, namespace, id chain).

    Returns (keys per request, input lengths, block size per request). Trace ids are
    prefix-chained within a namespace; keying by the whole chain keeps a cache honest
    even for traces that reuse an id after a different parent.
    """
    index: dict[tuple, int] = {}
    all_keys: list[list[int]] = []
    lengths: list[int] = []
    sizes: list[int] = []
    for req in requests:
        if req.hash_ids is None:
            raise ValueError(f"cache-only replay needs hash ids; request {req.request_id} has token ids only")
        parent: object = (req.namespace, req.cache_salt)
        keys = []
        for h in req.hash_ids:
            k = index.get((parent, h))
            if k is None:
                k = index[(parent, h)] = len(index)
            keys.append(k)
            parent = k
        all_keys.append(keys)
        lengths.append(req.input_length)
        sizes.append(req.hash_block_size)
    return all_keys, lengths, sizes


def next_uses(keys: Sequence[Sequence[int]], capacity: int | None = None) -> list[list[int]]:
    """For each request r and block position, the next request index > r using that key.
    With ``capacity``, a request of more blocks is no use: it is served uncached, hits or
    not, so a block kept for it was kept for nothing (MIN kept one over a block a cached
    request needed next, and fell below LRU)."""
    upcoming: dict[int, int] = {}
    out: list[list[int]] = [[]] * len(keys)
    for r in range(len(keys) - 1, -1, -1):
        ks = keys[r]
        get = upcoming.get
        out[r] = [get(k, NEVER) for k in ks]
        if capacity is None or len(ks) <= capacity:
            for k in ks:
                upcoming[k] = r
    return out


def belady_hits(keys: Sequence[Sequence[int]], capacity: int) -> tuple[list[int], int, int, int]:
    """Replay with MIN eviction: (hit blocks per request, publishes, evictions, oversized).

    ``capacity`` counts usable blocks (the pool minus vLLM's null block). A request with
    more blocks than the capacity is served uncached (``oversized``), as an engine would
    never fit it either. With such requests MIN is run twice, counting them as future uses
    and not (each fell below LRU on a trace of its own: keeping a block for one's hit may
    pay or not), and the schedule with more hits is the bound: both are eviction orders a
    cache could follow.
    """
    if all(len(ks) <= capacity for ks in keys):
        return _min_replay(keys, capacity, next_uses(keys))
    runs = [_min_replay(keys, capacity, next_uses(keys, limit)) for limit in (None, capacity)]
    return max(runs, key=lambda run: sum(run[0]))  # (a tie: the first, oversized requests counted as uses)


def _min_replay(keys: Sequence[Sequence[int]], capacity: int, nxt: list[list[int]]) -> tuple[list[int], int, int, int]:
    """``belady_hits`` with the next uses ``nxt`` (``next_uses``)."""
    version: dict[int, int] = {}  # cached key -> version of its live heap entry
    heap: list[tuple[int, int, int, int]] = []  # (-next_use, -depth, key, version)
    free_slots = capacity
    hits: list[int] = []
    publishes = evictions = oversized = 0
    push, pop = heapq.heappush, heapq.heappop
    for r, ks in enumerate(keys):
        n = len(ks)
        hit = 0
        while hit < n and ks[hit] in version:
            hit += 1
        hits.append(hit)
        if n > capacity:
            oversized += 1
            # its cached blocks' next use is now a later request's: their entries still named
            # this one, the nearest of all, so MIN kept them over blocks needed sooner (below LRU)
            for d in range(n):
                k = ks[d]
                if k in version:
                    version[k] += 1
                    push(heap, (-nxt[r][d], -d, k, version[k]))
            continue
        # this request's cached blocks (the hit, and any later cached ones) are in use:
        # give them fresh entries at their new next use (old entries become stale)
        needed = 0
        use = nxt[r]
        in_use = set()
        for d in range(n):
            k = ks[d]
            if k in version:
                in_use.add(k)
            else:
                needed += 1
        while free_slots < needed:
            _, _, k, v = pop(heap)
            if version.get(k) != v or k in in_use:
                continue  # stale, or in use (it gets a fresh entry just below)
            del version[k]
            free_slots += 1
            evictions += 1
        for d in range(n):
            k = ks[d]
            v = version.get(k, -1) + 1
            if v == 0:
                free_slots -= 1
                publishes += 1
            version[k] = v
            push(heap, (-use[d], -d, k, v))
        if len(heap) > 4 * (capacity + 64):
            heap = [e for e in heap if version.get(e[2]) == e[3]]
            heapq.heapify(heap)
    return hits, publishes, evictions, oversized
