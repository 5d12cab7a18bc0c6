"""Budget: the cache manager vs a bare OrderedDict LRU loop on the Mooncake trace.

Both consume the shared synthetic trace as sequential requests (lookup, allocate,
cache, free) with full attention, 512-token blocks equal to the trace's hash ids and
5,859 GPU blocks. The manager runs with events on (a listener that keeps every batch).

As in vLLM, a request's block hashes are computed when the request is created (its
``block_hasher``), not by the cache manager; that cost is timed and printed
separately. The budget compares the manager's operations with the bare loop: within
6x. Times are CPU time of this process (``time.process_time``: the machine is shared);
each side runs ``--repeat`` times, interleaved, and the best time counts.

    .venv/bin/python bench/cache_ops.py [TRACE] [--limit N] [--repeat R]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import OrderedDict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvtrace.cache import CacheConfig, FullAttentionSpec, KVCacheManager, Request

DEFAULT_TRACE = ROOT / "tests" / "data" / "mooncake_synthetic_trace.jsonl"
BLOCK = 512
NUM_BLOCKS = 5859
BUDGET = 6.0


def load(path: Path, limit: int | None) -> list[tuple[int, tuple[int, ...]]]:
    out = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            out.append((int(rec["input_length"]), tuple(rec["hash_ids"])))
            if limit and len(out) >= limit:
                break
    return out


def bare_lru(trace) -> tuple[int, float]:
    """Prefix hit, then refresh/insert every full block (tail first, as vLLM frees), evict LRU.

    The pool has NUM_BLOCKS - 1 usable blocks (block 0 is vLLM's null block). A prompt
    that ends mid-block also holds a block for its partial tail; freed without a hash, it
    goes to the front of the free queue and is reused first, so from the first such prompt
    on one usable block holds no key (``spare``). Not modelled: a prompt of whole blocks
    recomputes its last block (the hit stops at num_tokens - 1) into a second block with
    the same hash, which the manager keeps as a duplicate, as vLLM does.
    """
    lru: OrderedDict[int, None] = OrderedDict()
    cap = NUM_BLOCKS - 1
    spare = 0  # freed blocks without a key: 0, or 1 once a partial tail has been freed
    hit_tokens = 0
    t0 = time.process_time()
    for input_length, ids in trace:
        n_full = input_length // BLOCK
        limit = (input_length - 1) // BLOCK  # at least one token is recomputed
        hit = 0
        for h in ids[:limit]:
            if h not in lru:
                break
            hit += 1
        hit_tokens += hit * BLOCK
        for h in reversed(ids[:n_full]):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                if len(lru) + spare > cap:  # take the keyless block first, else evict
                    if spare:
                        spare = 0
                    else:
                        lru.popitem(last=False)
        if input_length % BLOCK and not spare:
            spare = 1
            if len(lru) + spare > cap:
                lru.popitem(last=False)
    return hit_tokens, time.process_time() - t0


def make_config() -> CacheConfig:
    return CacheConfig(groups=(FullAttentionSpec(BLOCK),), num_gpu_blocks=NUM_BLOCKS, hash_block_size=BLOCK)


def make_requests(trace, manager: KVCacheManager) -> tuple[list[Request], float]:
    t0 = time.process_time()
    reqs = []
    for i, (input_length, ids) in enumerate(trace):
        req = Request(str(i), None, trace_block_ids=ids, trace_block_size=BLOCK, num_prompt_tokens=input_length)
        manager.attach(req)  # hashes at creation, like vLLM's block_hasher
        reqs.append(req)
    return reqs, time.process_time() - t0


def manager_ops(manager: KVCacheManager, reqs: list[Request]) -> float:
    t0 = time.process_time()
    get_computed_blocks, allocate_slots = manager.get_computed_blocks, manager.allocate_slots
    free, new_step_starts = manager.free, manager.new_step_starts
    for req in reqs:
        n = req.num_prompt_tokens
        blocks, hit, _ = get_computed_blocks(req)
        if allocate_slots(req, n - hit, hit, blocks) is None:
            raise SystemExit(f"request {req.request_id}: {n} tokens do not fit in {NUM_BLOCKS} blocks")
        req.num_computed_tokens = n
        free(req)
        new_step_starts()
    return time.process_time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", nargs="?", default=str(DEFAULT_TRACE))
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    trace = load(Path(args.trace), args.limit)
    bare_best = mgr_best = hash_best = float("inf")
    for _ in range(args.repeat):
        bare_hits, t = bare_lru(trace)
        bare_best = min(bare_best, t)
        manager = KVCacheManager(make_config())
        events = [0]
        manager.subscribe(lambda batch, events=events: events.__setitem__(0, events[0] + len(batch)))
        reqs, t_hash = make_requests(trace, manager)
        hash_best = min(hash_best, t_hash)
        mgr_best = min(mgr_best, manager_ops(manager, reqs))
    ratio = mgr_best / bare_best
    s = manager.stats
    assert bare_hits == s.hit_tokens, f"the manager ({s.hit_tokens}) and the bare loop ({bare_hits}) disagree"
    print(f"requests                 {len(trace)}")
    print(f"bare OrderedDict loop    {bare_best:8.3f} s   hit tokens {bare_hits}")
    print(f"KVCacheManager ops       {mgr_best:8.3f} s   hit tokens {s.hit_tokens}   events {events[0]}"
          f"   evictions {s.evictions}")
    print(f"request hashing          {hash_best:8.3f} s   (block hashes at request creation, sha256_cbor)")
    print(f"ratio (ops / bare)       {ratio:8.2f}x   budget {BUDGET:.0f}x: {'OK' if ratio <= BUDGET else 'OVER'}")
    print(f"ratio incl. hashing      {(mgr_best + hash_best) / bare_best:8.2f}x")


if __name__ == "__main__":
    main()
