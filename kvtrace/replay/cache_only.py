"""Cache-only replay: the fast trace analysis (Mooncake paper / Dynamo ``datagen analyze``).

Conventions:

- requests run one at a time in trace order, with no scheduler and no clock;
- each trace hash id is one block of ``block_size`` tokens, the partial last block
  included (it can hit, as in the paper's hit-rate figure);
- a request's hit is its prefix-contiguous cached blocks, and its hit tokens are
  ``min(hit_blocks * block_size, input_length)``;
- after the request, its blocks return to the LRU in vLLM's free order (reverse, so a
  request's tail is evicted before its prefix).

``policy="lru"`` runs through the real :class:`kvtrace.cache.KVCacheManager` (one full
attention group, one request per step) so its events flow to listeners (digest, spans).
Block keys are the trace ids themselves (with their scope, see :func:`block_keys`), not
hashes of synthesised tokens: in this mode ids *are* the content, and hashing tokens
would make the analysis cost grow with tokens instead of unique blocks. To let the last
id hit, the request is presented with one token beyond its last block (vLLM always
recomputes a prompt's last token); the pool holds one extra block for that token, so
the capacity seen by the trace is exactly ``capacity_blocks``.

``policy="belady"`` is the offline-optimal bound on the same trace (:mod:`.belady`).
A bare OrderedDict model of the same conventions, the tests' oracle and the benchmark's
baseline, lives outside the package (``tests/support/oracles.py``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import cast

import msgspec
import numpy as np

from kvtrace.cache.config import MAX_BLOCKS
from kvtrace.cache.events import PrefixLookup
from kvtrace.errors import ConfigError
from kvtrace.metrics import DEFAULT_PERCENTILES, LOCAL_HIT, PROMPT, block_hits, hit_summary, no_latency
from kvtrace.names import POLICIES
from kvtrace.numeric import cdiv
from kvtrace.process import collector_paused
from kvtrace.replay.belady import belady_hits, chain_keys
from kvtrace.replay.writers import BlockInterner
from kvtrace.workload import TraceRequest
from kvtrace.workload.lines import MAX_TOKENS


@dataclass(slots=True)
class CacheOnlyResult:
    policy: str
    block_size: int
    capacity_blocks: int | None  # None: unbounded
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    total_blocks: int = 0
    hit_blocks: int = 0
    publishes: int = 0
    evictions: int = 0
    oversized: int = 0  # requests with more blocks than the capacity: served uncached
    request_ids: list[str] = field(default_factory=list)
    per_request_hit_tokens: list[int] = field(default_factory=list)
    per_request_hit_blocks: list[int] = field(default_factory=list)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.total_blocks if self.total_blocks else 0.0

    def summary(self, percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict:
        """The run summary: vLLM's hit counters (``kvtrace.metrics``; every request is
        scheduled once, with no external tier), the block hit rate, and latency fields
        that are None: cache-only mode has no clock."""
        totals = {PROMPT: self.prompt_tokens, LOCAL_HIT: self.hit_tokens}  # the counters are sums
        return {
            "mode": "cache-only",
            "policy": self.policy,
            "block_size": self.block_size,
            "capacity_blocks": self.capacity_blocks,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            **hit_summary([totals]),
            **block_hits(self.hit_blocks, self.total_blocks),
            "publishes": self.publishes,
            "evictions": self.evictions,
            "oversized_requests": self.oversized,
            **no_latency(percentiles),
        }

    def _add(self, rid: str, input_length: int, n_blocks: int, hit_blocks: int) -> None:
        hit_tokens = min(hit_blocks * self.block_size, input_length)
        self.requests += 1
        self.prompt_tokens += input_length
        self.hit_tokens += hit_tokens
        self.total_blocks += n_blocks
        self.hit_blocks += hit_blocks
        self.request_ids.append(rid)
        self.per_request_hit_tokens.append(hit_tokens)
        self.per_request_hit_blocks.append(hit_blocks)

    def _add_all(self, request_ids: list[str], input_lengths: list[int], n_blocks: list[int],
                 hit_blocks: list[int]) -> None:
        """``_add`` for a whole run at once (the replay loop only collects hit blocks)."""
        bs = self.block_size
        hit_tokens = [min(h * bs, n) for h, n in zip(hit_blocks, input_lengths)]
        self.requests += len(request_ids)
        self.prompt_tokens += sum(input_lengths)
        self.hit_tokens += sum(hit_tokens)
        self.total_blocks += sum(n_blocks)
        self.hit_blocks += sum(hit_blocks)
        self.request_ids.extend(request_ids)
        self.per_request_hit_tokens.extend(hit_tokens)
        self.per_request_hit_blocks.extend(hit_blocks)


# Blocks one replay re-blocks a trace into (each interned with its tokens' hash): about 85
# bytes a block, so this bound keeps the interner under 3 GB.
MAX_REBLOCKED_BLOCKS = 1 << 25


def as_block_requests(requests: Iterable[TraceRequest], block_size: int | None) -> tuple[list[TraceRequest], int]:
    """Materialise the stream with hash ids of one block size.

    Hash-id requests keep their ids when their block size is the analysis block size;
    token-id requests (or another block size) are re-blocked by content, as a Mooncake
    writer would.
    """
    reqs = list(requests)
    if block_size is None:
        sizes = {r.hash_block_size for r in reqs if r.hash_ids is not None}
        if len(sizes) > 1:
            raise ConfigError("--block-size", None, f"not given, and the trace's hash ids are of several block sizes "
                                                    f"{sorted(sizes)}: give the one to read them at")
        block_size = sizes.pop() if sizes else 16
    if not 1 <= block_size <= MAX_TOKENS:
        raise ConfigError("cache-only", "block_size", f"expected 1 to {MAX_TOKENS:,} tokens, got {block_size}")
    reblocked = 0  # before any is made: the Mooncake trace at --block-size 1 is 61M blocks, 5 GB, no end
    for r in reqs:
        if r.hash_ids is not None and r.hash_block_size == block_size:
            # (a request no pool holds, however it is blocked: a 52-byte Azure row of 16,777,216
            # tokens at --trace-block-size 1 took curve's auto capacities past 5 GB)
            if len(r.hash_ids) > MAX_BLOCKS:
                raise ConfigError("cache-only", "block_size",
                                  f"request {r.request_id} ({r.input_length:,} tokens) is {len(r.hash_ids):,} blocks "
                                  f"of {block_size} tokens, more than a pool holds ({MAX_BLOCKS:,}); pass a larger "
                                  "--block-size")
        else:
            blocks = -(-r.input_length // block_size)
            if blocks > MAX_BLOCKS:  # (a 100-byte trace took 62 s and 4 GB)
                raise ConfigError("cache-only", "block_size",
                                  f"request {r.request_id} ({r.input_length:,} tokens) is {blocks:,} blocks of "
                                  f"{block_size} tokens, more than a pool holds ({MAX_BLOCKS:,}); pass a larger "
                                  "--block-size")
            reblocked += blocks
            if reblocked > MAX_REBLOCKED_BLOCKS:
                raise ConfigError("--block-size", str(block_size),
                                  f"the trace's prompts make more than {MAX_REBLOCKED_BLOCKS:,} blocks of {block_size} "
                                  f"token{'' if block_size == 1 else 's'} (passed at request {r.request_id}), more "
                                  "than a replay re-blocks in memory; pass a larger --block-size")
    interner: BlockInterner | None = None
    out = []
    for r in reqs:
        if r.hash_ids is not None and r.hash_block_size == block_size:
            out.append(r)
            continue
        interner = interner or BlockInterner(block_size)
        out.append(TraceRequest(
            r.request_id, r.arrival_ns, r.input_length, r.output_length,
            hash_ids=tuple(interner.block_ids(r)), hash_block_size=block_size,
            namespace=(1 << 62) + 1,  # re-blocked ids live apart from the trace's own
            session_id=r.session_id, cache_salt=None,  # the salt is inside the ids already
        ))
    return out, block_size


# -- replay ----------------------------------------------------------------------------

def _root_indices(reqs: Sequence[TraceRequest]) -> list[int]:
    """Index of each request's (namespace, salt) scope, in order of first appearance."""
    roots: dict[tuple[int, str | None], int] = {}
    return [roots.setdefault((r.namespace, r.cache_salt), len(roots)) for r in reqs]


def block_keys(reqs: Sequence[TraceRequest]) -> list[Sequence[int]]:
    """The cache key of every trace block, an int64 (as vLLM's int block hashes are).

    A trace is prefix-chained when each (scope, id) always follows the same parent id:
    the id then names its whole chain, and (scope, id) is a complete key (checked here,
    vectorised). The first scope's keys are the trace ids themselves, so a single-scope
    trace (Mooncake, Azure) reuses its ``hash_ids`` as they are, and an event's block
    hash shows its trace id. Blocks of further scopes (WEKA files with local ids, salted
    requests) get negative keys ``-1 - n``, n numbering their distinct (scope, id) pairs;
    a trace that is not chained gets negative keys for every distinct chain. Negative
    keys never meet trace ids, which are >= 0.
    """
    ids = _hash_ids(reqs)
    lengths = [len(h) for h in ids]
    total = sum(lengths)
    if total == 0:
        return ids
    try:
        flat = np.fromiter(chain.from_iterable(ids), dtype=np.int64, count=total)
    except OverflowError:
        return _interned_chain_keys(reqs)
    lens = np.asarray(lengths, dtype=np.int64)
    starts = np.zeros(len(reqs), dtype=np.int64)
    np.cumsum(lens[:-1], out=starts[1:])
    roots = _root_indices(reqs)
    single_scope = max(roots) == 0
    parent = np.empty_like(flat)
    parent[1:] = flat[:-1]
    parent[starts[lens > 0]] = -1  # a chain's first block follows its scope's root
    if single_scope and int(flat.min()) >= 0 and int(flat.max()) < 4 * total + 1024:
        # small non-negative ids (most traces number their blocks densely): index a table
        # by id instead of sorting; it holds one occurrence's parent per id
        parent_of = np.empty(int(flat.max()) + 1, dtype=np.int64)
        parent_of[flat] = parent
        return ids if np.array_equal(parent_of[flat], parent) else _interned_chain_keys(reqs)
    if single_scope:
        _, first, inverse = np.unique(flat, return_index=True, return_inverse=True)
    else:
        scope = np.repeat(np.asarray(roots, dtype=np.int64), lens)
        _, first, inverse = np.unique(np.stack([scope, flat], axis=1), axis=0, return_index=True,
                                      return_inverse=True)
    if not np.array_equal(parent[first][inverse.reshape(-1)], parent):
        return _interned_chain_keys(reqs)
    if single_scope:
        return ids
    keys = -1 - inverse.reshape(-1)  # (scope, id) pairs numbered, as negative keys
    out: list[Sequence[int]] = []
    for h, root, start, n in zip(ids, roots, starts.tolist(), lengths):
        out.append(h if root == 0 else keys[start:start + n].tolist())
    return out


def _hash_ids(reqs: Sequence[TraceRequest]) -> list[Sequence[int]]:
    """Every request's hash ids (``as_block_requests`` gives each request some)."""
    return cast("list[Sequence[int]]", [r.hash_ids for r in reqs])


def _interned_chain_keys(reqs: Sequence[TraceRequest]) -> list[Sequence[int]]:
    index: dict[tuple, int] = {}
    out: list[Sequence[int]] = []
    for ids, root in zip(_hash_ids(reqs), _root_indices(reqs)):
        parent: object = ("root", root)
        keys = []
        for h in ids:
            k = index.get((parent, h))
            if k is None:
                k = index[(parent, h)] = -1 - len(index)
            keys.append(k)
            parent = k
        out.append(keys)
    return out


def replay_cache_only(
    requests: Iterable[TraceRequest],
    *,
    # (object: mypyc checks and converts typed arguments before the body, True into 1 and "16"
    # into a TypeError; the checks below are what a caller is told)
    capacity_blocks: object = None,  # an int, or math.inf (or None with no capacity_tokens): unbounded
    capacity_tokens: object = None,  # an int
    block_size: int | None = None,
    policy: str = "lru",
    listeners: Sequence[Callable[[list], None]] = (),
    progress: Callable[[int], None] | None = None,
) -> CacheOnlyResult:
    """Replay in cache-only mode with ``capacity_blocks`` usable blocks (or
    ``capacity_tokens`` rounded up to whole blocks) of ``block_size`` tokens (default: the trace's).

    With neither (or ``capacity_blocks=math.inf``) the cache is unbounded: the "infinite
    cache" hit rate of the Mooncake paper and Dynamo's ``datagen analyze``. Nothing is
    evicted then, so the pool is sized to what the trace can fill (its distinct blocks
    plus its longest request), not preallocated to some large number; the summary's
    ``capacity_blocks`` is None.

    ``listeners`` get each step's cache events, one step per request. Belady is an
    analytical bound without a cache manager: its listeners get one ``PrefixLookup`` per
    request (the bound's hit), so its digest still pins the result. ``progress(i)`` is
    called after each request.
    """
    if policy not in POLICIES:
        raise ConfigError("cache-only", "policy", f"expected one of {POLICIES}, got {policy!r}")
    reqs, bs = as_block_requests(requests, block_size)
    if capacity_blocks is not None and capacity_tokens is not None:
        raise ConfigError("cache-only", "capacity", "give at most one of capacity_blocks / capacity_tokens")
    # each checked as given, a bool no count (True ran a 1-block cache and was stored as True;
    # a token count of 0 was blamed on capacity_blocks, 1.5 a TypeError)
    tokens = _count(capacity_tokens)
    if capacity_tokens is not None and (tokens is None or tokens < 1):
        raise ConfigError("cache-only", "capacity_tokens", f"expected an int >= 1 tokens, got {capacity_tokens!r}")
    # (a float first: compiled, a numpy int's == gave numpy.bool_ where mypyc checks for a bool)
    unbounded = capacity_tokens is None and (
        capacity_blocks is None or (isinstance(capacity_blocks, float) and capacity_blocks == math.inf))
    # rounded up, as --capacity-tokens and the engine's pools are (it rounded down here)
    blocks = cdiv(tokens, bs) if tokens is not None else _count(capacity_blocks)
    if not unbounded and (blocks is None or blocks < 1):
        raise ConfigError("cache-only", "capacity_blocks", f"expected an int >= 1 blocks, got {capacity_blocks!r}")
    bounded = None if unbounded else blocks
    result = CacheOnlyResult(policy, bs, bounded)
    if policy == "belady":
        keys, _, _ = chain_keys(reqs)
        capacity = _unbounded_capacity(keys) if bounded is None else bounded
        hits, result.publishes, result.evictions, result.oversized = belady_hits(keys, capacity)
        # the block hashes an LRU replay's lookups name (its root and first miss): the prefix
        # families and reuse gaps of a Belady run are its LRU twin's (they were absent)
        hashes = block_keys(reqs) if listeners else []
        for i, (r, ks, hit) in enumerate(zip(reqs, keys, hits)):
            result._add(r.request_id, r.input_length, len(ks), hit)
            if listeners:
                # Belady has no cache manager; its per-request lookups are the event stream
                tokens = result.per_request_hit_tokens[-1]
                hs = hashes[i]
                missed = hit < len(ks)
                lookup = [PrefixLookup(i, r.request_id, r.input_length, tokens, (tokens,), 0, 0,
                                       int(hs[0]) if len(hs) else None, int(hs[hit]) if missed else None,
                                       hit if missed else -1)]
                for listener in listeners:
                    listener(lookup)
            if progress is not None:
                progress(i + 1)
        return result
    return _replay_manager(reqs, bs, bounded, result, listeners, progress)


def _count(value: object) -> int | None:
    """``value`` as a count: an int (numpy's too), never a bool; None for anything else."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def _unbounded_capacity(keys: Sequence[Sequence]) -> int:
    """Blocks an LRU never evicts from on these per-request keys: one per distinct key
    (an unbounded cache keeps them all) plus the longest request's (its new blocks)."""
    return len(set(chain.from_iterable(keys))) + max(map(len, keys), default=0) + 1


# The pool beyond the capacity: the null block and the block of the one extra token each
# request is presented with.
_EXTRA_BLOCKS = 2
# The largest bounded capacity (a bounded pool is allocated whole).
MAX_CAPACITY_BLOCKS = MAX_BLOCKS - _EXTRA_BLOCKS


def _replay_manager(reqs, bs, capacity, result, listeners, progress) -> CacheOnlyResult:
    from kvtrace.cache import CacheConfig, FullAttentionSpec, KVCacheManager, Request

    hashes = block_keys(reqs)
    if capacity is None:
        capacity = _unbounded_capacity(hashes)
        if capacity > MAX_CAPACITY_BLOCKS:  # (CacheConfig's own error named itself, no flag)
            raise ConfigError("--capacity-blocks", "inf", f"the unbounded cache would hold {capacity:,} blocks, more "
                                                          f"than a pool of kvtrace's holds ({MAX_CAPACITY_BLOCKS:,}); "
                                                          "replay fewer requests (--limit) or larger blocks")
    # At one token a block the extra token would fill a block of its own, hashed, published
    # and held in the pool (an unbounded cache evicted, a hit was lost): there only the
    # trace's tokens are allocated (a whole hit allocates none), and no block is extra.
    extra_token = 1 if bs > 1 else 0
    config = CacheConfig(groups=(FullAttentionSpec(bs),), num_gpu_blocks=capacity + _EXTRA_BLOCKS - 1 + extra_token,
                         hash_block_size=bs)
    mgr = KVCacheManager(config)
    for listener in listeners:
        mgr.subscribe(listener)
    get_computed_blocks, allocate_slots, free = mgr.get_computed_blocks, mgr.allocate_slots, mgr.free
    sink = mgr.sink
    hit_blocks = []
    oversized = 0
    with collector_paused():  # the loop makes no cycles: the collector's passes would be pure cost
        for i, (r, hs) in enumerate(zip(reqs, hashes)):
            n = len(hs)
            num_tokens = n * bs + 1
            # the trace-id keys (see the module docstring), taken over as they are: the extra
            # token's block is partial, so the request never outgrows them, except at one token
            # a block, where that block is full and the hasher appends its key (a list then;
            # never allocated, it only lets every trace block hit)
            req = Request(r.request_id, None, trace_block_ids=r.hash_ids, trace_block_size=bs,
                          namespace=r.namespace, cache_salt=r.cache_salt, num_prompt_tokens=num_tokens,
                          block_hashes=hs if bs > 1 else list(hs))
            computed, num_hit, _ = get_computed_blocks(req)
            if listeners:
                _in_trace_terms(sink.events, r.input_length, num_hit)
            if n > capacity or allocate_slots(req, n * bs + extra_token - num_hit, num_hit, computed) is None:
                oversized += 1
            else:
                req.num_computed_tokens = n * bs + extra_token
                free(req)
            hit_blocks.append(num_hit // bs)
            mgr.new_step_starts()  # one request per step: hands its events to the listeners
            if progress is not None:
                progress(i + 1)
    result.oversized += oversized
    result._add_all([r.request_id for r in reqs], [r.input_length for r in reqs], list(map(len, hashes)), hit_blocks)
    result.publishes = mgr.stats.publishes
    result.evictions = sum(mgr.stats.evictions.values())
    for listener in listeners:
        mgr.unsubscribe(listener)
    return result


def _in_trace_terms(events: list, input_length: int, num_hit: int) -> None:
    """Restate the step's lookup (the latest event: the step's one request has just looked
    up) in the trace's terms, in place: the prompt's tokens queried and the hit capped at
    them, as the summary counts (not the one extra token presented)."""
    lookup = events[-1]
    assert type(lookup) is PrefixLookup
    hit = num_hit if num_hit < input_length else input_length
    events[-1] = msgspec.structs.replace(lookup, num_query_tokens=input_length, num_hit_tokens=hit,
                                         hit_tokens_per_group=(hit,))
