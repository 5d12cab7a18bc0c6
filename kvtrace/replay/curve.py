"""``kvtrace curve``: hit rate against capacity, LRU and the Belady bound.

For cache-only LRU the whole curve comes from one pass (Mattson's stack algorithm): LRU
keeps, at every capacity C, the C most recently used blocks, so a block of a request hits
at capacity C exactly when its depth in the recency stack, taken before the request, is
at most C. A request's hit is the run of leading blocks that hit; its j-th block hits iff
``max(depth_1..depth_j) <= C`` (the prefix-max threshold, as tair-kvcache's LiteHit).
After the request its blocks return to the stack tail first (vLLM's free order), so its
first block is the most recent.

This is exact, not an estimate, when the stream of touches does not depend on the
capacity: cache-only replay, every request's blocks fitting the cache. A request with
more blocks than C is served uncached at C and touches nothing there, so the one pass is
exact for every C at or above the largest request; below that, and for Belady (not a
recency order), the points come from a replay at each capacity. Below the largest request
LRU is no stack algorithm (a cache of C blocks need not hold what one of C - 1 holds: a
request that fits the larger one evicts for it, and passes the smaller one by), so the
curve there can fall as the capacity grows; the note under the table says so. Engine mode (admission,
preemption and timing all depend on capacity) runs one engine replay per capacity, on the
sweep's workers; its Belady bound is not drawn, because the engine's pool counts blocks
of every KV cache group, a unit the cache-only bound does not have.

The depths are computed offline with numpy (no per-block Python): number the touches in
time order; a lookup of a block whose previous touch is at time p, in a request whose
touches start at time q, has depth (q - p) - #{touches s >= p whose key is touched again
before q}: the distinct blocks touched since p. That count is a 2-D dominance count,
answered for all lookups at once by a merge-sort tree (one sorted array per level).
"""

from __future__ import annotations

import hashlib
import json
import numbers
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvtrace.errors import ConfigError, check_seed
from kvtrace.metrics import percent_text
from kvtrace.names import shown_value
from kvtrace.replay.belady import belady_hits, chain_keys
from kvtrace.replay.cache_only import MAX_CAPACITY_BLOCKS, as_block_requests, block_keys
from kvtrace.workload import TraceRequest

CURVE_POLICIES = ("lru", "belady")


def lru_thresholds(keys: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(thresholds, blocks per request): for every block, in request order, the capacity
    at which it hits under LRU (the running maximum of its request's stack depths), and
    each request's block count. A block never seen before gets ``total blocks + 1``:
    compare capacities clamped to the total (a cache of that size already holds every
    block), so it never hits."""
    lens = np.fromiter((len(k) for k in keys), dtype=np.int64, count=len(keys))
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64), lens
    flat = np.fromiter((x for k in keys for x in k), dtype=np.int64, count=total)
    starts = np.zeros(len(keys), dtype=np.int64)
    np.cumsum(lens[:-1], out=starts[1:])
    request = np.repeat(np.arange(len(keys), dtype=np.int64), lens)
    start = starts[request]  # q: the time of the request's first touch
    touch = start + (lens[request] - 1 - (np.arange(total) - start))  # tail first
    _, rank = np.unique(flat, return_inverse=True)
    rank = rank.astype(np.int64)
    width = total + 1
    by_key = np.sort(rank * width + touch)  # touches grouped by key, in time order
    key_of, time_of = np.divmod(by_key, width)
    # next touch of the same key after each touch (width: never)
    next_touch = np.full(total, width, dtype=np.int64)
    again = key_of[1:] == key_of[:-1]
    next_touch[time_of[:-1][again]] = time_of[1:][again]
    # p: the key's last touch before the request
    pos = np.searchsorted(by_key, rank * width + start) - 1
    clamped = np.maximum(pos, 0)
    seen = (pos >= 0) & (key_of[clamped] == rank)
    lookups = np.flatnonzero(seen)
    p, q = time_of[clamped[lookups]], start[lookups]
    # touches s >= p re-touched before q = (all re-touched before q) - (those with s < p)
    retouched = np.searchsorted(np.sort(next_touch), q)
    times = np.arange(total, dtype=np.int64)
    stride = width + 1
    level = 0
    while (1 << level) <= total:
        inside = ((p >> level) & 1) == 1  # [0, p) holds the level's block (p >> level) - 1
        if inside.any():
            tree = np.sort((times >> level) * stride + next_touch, kind="stable")  # runs merge cheaply
            block = (p[inside] >> level) - 1
            retouched[inside] -= np.searchsorted(tree, block * stride + q[inside]) - (block << level)
        level += 1
    depth = np.full(total, total + 1, dtype=np.int64)
    depth[lookups] = (q - p) - retouched
    offset = request * (total + 2)  # a segmented running max: each request starts above the last
    return np.maximum.accumulate(depth + offset) - offset, lens


@dataclass(slots=True, frozen=True)
class CurvePoint:
    capacity_blocks: int | None  # None: the unbounded cache
    policy: str  # lru | belady
    hit_tokens: int
    prompt_tokens: int
    hit_blocks: int
    total_blocks: int
    method: str  # one-pass | replay | run
    run_id: str | None = None
    # an engine run's with an external tier: vLLM's external_prefix_cache_hit_rate, as its summary has it
    external_prefix_cache_hit_rate: float | None = None

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else None

    @property
    def block_hit_rate(self) -> float | None:
        return self.hit_blocks / self.total_blocks if self.total_blocks else None


def _hit_tokens(hit_blocks: np.ndarray, lengths: np.ndarray, block_size: int) -> int:
    return int(np.minimum(hit_blocks * block_size, lengths).sum())


def capacity_curve(
    requests: Sequence[TraceRequest],
    capacities: Sequence[int | None],
    *,
    policies: Sequence[str] = CURVE_POLICIES,
    block_size: int | None = None,
) -> list[CurvePoint]:
    """Cache-only hit rates at each capacity in blocks (None: unbounded), LRU and/or
    Belady, in the conventions of ``kvtrace.replay.cache_only``."""
    from kvtrace.replay.cache_only import replay_cache_only

    # (a bool or a float was taken as a count, a string a TypeError; numpy's ints are counts)
    if any(c is not None and (isinstance(c, bool) or not isinstance(c, numbers.Integral) or c < 1)
           for c in capacities):
        raise ConfigError("--capacities", ",".join(map(str, capacities)), "expected block counts >= 1")
    bounded = sorted({int(c) for c in capacities if c is not None})
    reqs, bs = as_block_requests(requests, block_size)
    lengths = np.fromiter((r.input_length for r in reqs), dtype=np.int64, count=len(reqs))
    keys = block_keys(reqs)
    thresholds, blocks = lru_thresholds(keys)
    largest = int(blocks.max(initial=0))
    total = int(blocks.sum())
    prompt = int(lengths.sum())
    firsts = np.zeros(len(reqs), dtype=np.int64)
    np.cumsum(blocks[:-1], out=firsts[1:])
    nonempty = blocks > 0

    def one_pass(c: int) -> np.ndarray:  # leading blocks that hit, per request
        hit = np.zeros(len(reqs), dtype=np.int64)
        if total:
            hit[nonempty] = np.add.reduceat((thresholds <= c).astype(np.int64), firsts[nonempty])
        return hit

    out: list[CurvePoint] = []
    points = [*bounded, *((None,) if None in capacities else ())]
    for policy in policies:
        belady_keys = chain_keys(reqs)[0] if policy == "belady" and bounded else []
        for c in points:
            if c is None or (policy == "lru" and c >= largest):  # unbounded: LRU and MIN agree
                hit = one_pass(total if c is None else min(c, total))  # never-seen blocks sit at total + 1
                out.append(CurvePoint(c, policy, _hit_tokens(hit, lengths, bs), prompt, int(hit.sum()), total,
                                      "one-pass"))
            elif policy == "lru":  # requests larger than the cache change what is touched
                res = replay_cache_only(reqs, capacity_blocks=c, block_size=bs)
                out.append(CurvePoint(c, policy, res.hit_tokens, res.prompt_tokens, res.hit_blocks,
                                      res.total_blocks, "replay"))
            else:
                hit = np.asarray(belady_hits(belady_keys, c)[0], dtype=np.int64)
                out.append(CurvePoint(c, policy, _hit_tokens(hit, lengths, bs), prompt, int(hit.sum()), total,
                                      "replay"))
    return out


def auto_capacities(requests: Sequence[TraceRequest], block_size: int | None = None, points: int = 10) -> list[int]:
    """Capacities from the largest request up to the trace's distinct blocks (where LRU
    stops missing for lack of room), spaced geometrically."""
    reqs, _ = as_block_requests(requests, block_size)
    keys = block_keys(reqs)
    largest = max((len(k) for k in keys), default=1) or 1
    distinct = len(np.unique(np.fromiter((x for k in keys for x in k), dtype=np.int64))) or 1
    # (at most the largest bounded pool, as --capacities is: a point past it was a replay of a
    # pool kvtrace refuses elsewhere; the unbounded cache's point is the one pass's)
    top = min(max(distinct, largest + 1), MAX_CAPACITY_BLOCKS)
    low = min(largest, top)
    return [int(c) for c in np.unique(np.geomspace(low, top, points).round().astype(np.int64))]


MAX_CURVE_POINTS = 10_000  # capacities of one curve (as a sweep's combinations)


def parse_capacities(text: str, engine: bool = False) -> list[int | None] | None:
    """``auto`` -> None; ``C1,C2,...`` (``inf`` for the unbounded cache) -> the list.
    ``engine``: an engine curve's, whose capacities the engine bounds (each is validated as
    replay's --capacity-blocks is): cache-only's bound and its advice (inf) are not its."""
    from kvtrace.replay.run import is_unbounded

    if not isinstance(text, str):  # (None, 5 or a list: an AttributeError)
        raise ConfigError("--capacities", shown_value(text), "expected auto or C1,C2,..., a string")
    if text.strip().lower() == "auto":
        return None
    out: list[int | None] = []
    for part in (p.strip() for p in text.split(",")):
        if is_unbounded(part):
            out.append(None)
            continue
        digits = part.lstrip("0")  # (int() of past 4,300 digits raised: a ValueError traceback)
        if not (part.isascii() and part.isdigit()) or not digits:  # ('²'.isdigit() holds)
            raise ConfigError("--capacities", text, "expected auto, or block counts >= 1 (and inf) joined by commas")
        if engine:
            if len(digits) > 40:  # (a smaller one is the engine's to bound, as replay's --capacity-blocks is)
                from kvtrace.cache.config import MAX_BLOCKS

                raise ConfigError("--capacities", part, f"beyond what kvtrace can hold (at most {MAX_BLOCKS:,} "
                                                        "blocks)")
        elif len(digits) > 40 or int(digits) > MAX_CAPACITY_BLOCKS:  # one bound with replay's --capacity-blocks
            raise ConfigError("--capacities", part, f"at most {MAX_CAPACITY_BLOCKS:,} blocks (a bounded pool's "
                                                    "limit); say inf for the unbounded cache")
        out.append(int(digits))
    if not out:
        raise ConfigError("--capacities", text, "no capacities given")
    if len(set(out)) > MAX_CURVE_POINTS:  # (each a replay in engine mode, or for the Belady bound)
        raise ConfigError("--capacities", f"{len(set(out)):,} capacities", f"a curve draws at most "
                                                                           f"{MAX_CURVE_POINTS:,} points")
    # each once, ascending, the unbounded cache last: the same curve (and id) however written
    return sorted(set(out), key=lambda c: (c is None, c or 0))


@dataclass(slots=True)
class CurveResult:
    curve_id: str
    trace: str
    mode: str
    block_size: int | None
    points: list[CurvePoint] = field(default_factory=list)
    external_tier: bool = False  # engine mode: its runs had an external (connector) tier

    def to_json(self) -> dict[str, Any]:
        tier = ({"external_prefix_cache_hit_rate": p.external_prefix_cache_hit_rate} if self.external_tier else {}
                for p in self.points)
        return {"curve_id": self.curve_id, "trace": self.trace, "mode": self.mode, "block_size": self.block_size,
                "external_tier": self.external_tier,
                "points": [{"capacity_blocks": p.capacity_blocks, "policy": p.policy, "method": p.method,
                            "prefix_cache_hit_rate": p.prefix_cache_hit_rate, "block_hit_rate": p.block_hit_rate,
                            "hit_tokens": p.hit_tokens, "prompt_tokens": p.prompt_tokens,
                            "hit_blocks": p.hit_blocks, "total_blocks": p.total_blocks, "run_id": p.run_id, **t}
                           for p, t in zip(self.points, tier, strict=True)]}

    def table(self) -> list[list[str]]:
        """capacity x policy: the token hit rate (and how each point was obtained)."""
        policies = list(dict.fromkeys(p.policy for p in self.points))
        caps = list(dict.fromkeys(p.capacity_blocks for p in self.points))
        caps.sort(key=lambda c: (c is None, c or 0))
        at = {(p.capacity_blocks, p.policy): p for p in self.points}
        tier = ["external tier hit rate"] if self.external_tier else []  # (an engine curve's runs': their own)
        rows = [["capacity (blocks)", *(f"{pol} hit rate" for pol in policies), *tier, "method"]]
        for c in caps:
            rates = [at[c, pol].prefix_cache_hit_rate if (c, pol) in at else None for pol in policies]
            cells = [percent_text(r) if r is not None else "-" for r in rates]
            if tier:
                ext = next((at[c, pol].external_prefix_cache_hit_rate for pol in policies if (c, pol) in at), None)
                cells.append(percent_text(ext) if ext is not None else "-")
            methods = sorted({at[c, pol].method for pol in policies if (c, pol) in at})
            rows.append(["unbounded" if c is None else f"{c:,}", *cells, "/".join(methods)])
        return rows

    def method_note(self) -> str:
        if self.mode == "engine":
            # (with a tier, most hit tokens can be the tier's: a curve of the local hits alone read as all of them)
            tier = ("; the hit rate is the local cache's (prefix_cache_hit_rate): the external tier's hits are not in "
                    "it, but in its own column (external_prefix_cache_hit_rate)" if self.external_tier else "")
            return ("engine mode: one engine replay per capacity (capacity: the full-attention group's usable blocks, "
                    f"its pool less vLLM's null block, as `kvtrace runs` shows them){tier}")
        # (each curve drawn, only: `--policy lru` was told how a Belady bound it did not draw was made)
        drawn = {p.policy for p in self.points}
        # (its unbounded point is the one pass's: there MIN and LRU agree, and the table said one-pass)
        unbounded = (" (the unbounded cache's from the one pass: nothing is evicted there)"
                     if any(p.policy == "belady" and p.capacity_blocks is None for p in self.points) else "")
        told = [*(["LRU from one exact pass (Mattson's stack algorithm) at every capacity that holds the largest "
                   "request, a replay below that"] if "lru" in drawn else []),
                *([f"Belady from a replay at each capacity{unbounded}"] if "belady" in drawn else [])]
        note = "cache-only: " + "; ".join(told)
        if any(p.policy == "lru" and p.method == "replay" for p in self.points):
            # (no stack algorithm there: a curve that fell with more room read as a wrong one)
            note += ("; below the largest request the LRU curve can fall as the capacity grows (a request larger "
                     "than the cache is served uncached and evicts nothing, one that fits evicts what it needs)")
        return note


def _check_callers(policies: object, computed: object) -> None:
    """A ConfigError for an API caller's policies that are no sequence of names (a TypeError,
    a numpy truth ValueError; one string's letters taken as names) or ``computed`` that is no
    callable (a TypeError once the whole curve was computed, the curve lost)."""
    if policies is not None and (isinstance(policies, str) or not isinstance(policies, (list, tuple))
                                 or not all(isinstance(p, str) for p in policies)):
        raise ConfigError("--policy", shown_value(policies), f"expected a sequence of policy names "
                                                             f"({', '.join(CURVE_POLICIES)})")
    if computed is not None and not callable(computed):
        raise ConfigError("computed", shown_value(computed), "expected a callable taking the CurveResult, or None")


def run_curve(spec, capacities: str, *, policies: Sequence[str] | None = None, db: str | Path | None = None,
              workers: int | None = None, ray_address: str | None = None,
              computed: Callable[[CurveResult], None] | None = None) -> CurveResult:
    """The curve of ``spec``'s trace (its mode and settings, capacity swept), recorded in
    ``db`` when given. Engine mode replays each capacity on the sweep's workers (local
    processes, or Ray tasks with ``ray_address``). ``policies``: default both, LRU alone
    in engine mode (asked for there, Belady is refused). ``computed`` is called with the
    curve before it is recorded (a store that cannot take it then loses no computed curve)."""
    from kvtrace.replay.run import check_spec, open_workload, validate

    check_spec(spec)
    _check_callers(policies, computed)
    if policies is None:  # (`curve --mode engine` was refused for a --policy belady never typed)
        policies = ("lru",) if spec.mode == "engine" else CURVE_POLICIES
    if not policies or "" in policies:  # (an empty item, as in lru,,belady, is a typo: refused as --capacities does)
        raise ConfigError("--policy", ",".join(policies) or "''", f"expected some of {', '.join(CURVE_POLICIES)} "
                                                                  "joined by commas (no empty item)")
    unknown = sorted(set(policies) - set(CURVE_POLICIES))
    if unknown:
        raise ConfigError("--policy", ",".join(unknown), f"expected some of {', '.join(CURVE_POLICIES)}")
    policies = [p for p in CURVE_POLICIES if p in policies]  # each once, in one order: one curve, one id
    for flag, given in (("--capacity-blocks", spec.capacity_blocks), ("--capacity-tokens", spec.capacity_tokens)):
        if given is not None:
            raise ConfigError(flag, str(given), "a curve sweeps the capacity itself; give --capacities instead")
    wanted = parse_capacities(capacities, engine=spec.mode == "engine")
    from kvtrace.replay.sweep import check_workers

    check_workers(workers, ray_address)
    # (each refused outside engine mode: --workers was taken and did nothing, where --ray was refused)
    for flag, given in (("--ray", ray_address), ("--workers", workers)):
        if given is not None and spec.mode != "engine":
            raise ConfigError(flag, given if isinstance(given, str) else shown_value(given),
                              "engine mode only (a cache-only curve is one pass in this process)")
    if spec.mode != "engine":
        _refuse_unused_settings(spec)
    if spec.mode == "engine":
        if "belady" in policies:
            raise ConfigError("--policy", "belady", "the Belady bound is a cache-only bound; in engine mode use "
                                                    "--policy lru (or --mode cache-only for both)")
        if wanted is None or None in wanted:
            raise ConfigError("--capacities", capacities, "engine mode needs explicit block counts (the engine pool "
                                                          "is preallocated): e.g. --capacities 4096,8192,16384")
        from kvtrace.replay.sweep import at_swept_value

        for c in wanted:  # (a refused setting creates no store; a capacity named at --capacities, as the sweep does)
            try:
                validate(replace(spec, capacity_blocks=c))
            except ConfigError as err:
                raise at_swept_value(err, {"capacity_blocks": c}, "--capacities") from None
        _check_store(db)
        return _engine_curve(spec, [c for c in wanted if c is not None], db, workers, ray_address, computed)
    validate(replace(spec, capacity_blocks=1))
    workload = open_workload(spec)
    # at one block size before the store is tried: a refused --block-size leaves no store
    requests, bs = as_block_requests(workload.requests, spec.block_size)
    _check_store(db)
    caps = wanted if wanted is not None else [*auto_capacities(requests, bs), None]
    points = capacity_curve(requests, caps, policies=policies, block_size=bs)
    trace_id = workload.identity(len(requests))  # (a --limit past the trace's end: the whole trace)
    result = CurveResult(_curve_id(trace_id, spec, caps, policies), spec.trace, spec.mode, bs, points)
    if computed is not None:
        computed(result)
    if db is not None:
        _record(db, result, workload.source, trace_id)
    return result


def _refuse_unused_settings(spec) -> None:
    """A run setting a cache-only curve has no use for, refused at its flag as --workers is:
    the curve is one pass in this process, with no run stored, no span and no clock. Each was
    taken and did nothing: --name named no run, --percentiles no latency, and --seed of a
    trace file (it seeds generated workloads and span ids) gave the same points under
    another curve id, a second recording of one curve in a store."""
    from kvtrace.metrics import DEFAULT_PERCENTILES
    from kvtrace.replay.run import GENERATED_PREFIX, check_percentiles

    if spec.name is not None:
        raise ConfigError("--name", spec.name or "''", "names the runs of an engine-mode curve; a cache-only curve "
                                                       "stores no run, only its points")
    percentiles = check_percentiles(spec.percentiles)
    if sorted(set(percentiles)) != sorted(set(DEFAULT_PERCENTILES)):  # (the default in any order: no change asked)
        raise ConfigError("--percentiles", ",".join(f"{p:g}" for p in percentiles),
                          "latency percentiles of engine-mode runs; a cache-only curve has no clock")
    if check_seed(spec.seed) and not str(spec.trace).startswith(GENERATED_PREFIX):
        raise ConfigError("--seed", str(spec.seed), "seeds generated workloads (gen:NAME) and span ids; a cache-only "
                                                    "curve of a trace file has neither")


def _check_store(db) -> None:
    """A store there already that cannot be written (held by another process, read-only)
    fails now, not after the whole pass or every replay. One not there yet is made when the
    curve is recorded (made here, an error after, a bad line, left it empty behind)."""
    if db is None:
        return
    from kvtrace.store import Store
    from kvtrace.store.backend import clickhouse_target, is_clickhouse

    where = clickhouse_target(db).path if is_clickhouse(db) else str(db)  # (None: a server, there already)
    if where is None or os.path.exists(where):
        with Store.open(db):
            pass


def _engine_curve(spec, capacities: list[int], db, workers: int | None, ray_address: str | None,
                  computed: Callable[[CurveResult], None] | None) -> CurveResult:
    from kvtrace.replay.run import open_workload
    from kvtrace.replay.sweep import run_sweep

    # (its runs named as the curve's, "curve capacity_blocks=4096": they were stored as "sweep ...", runs
    # of a `kvtrace sweep` never typed, as `kvtrace runs` and the dashboard listed them)
    sweep = run_sweep(replace(spec, name=spec.name or "curve"), [("capacity_blocks", capacities)], db=db,
                      workers=workers, ray_address=ray_address,
                      values_flag="--capacities")
    # each point at its run's capacity_blocks and block_size (the full-attention pool less vLLM's
    # null block), the numbers `kvtrace runs` and `diff` show and the dashboard marks runs at
    points = [CurvePoint(r.summary.get("capacity_blocks") or r.combo["capacity_blocks"], "lru",
                         int(r.summary.get("prefix_cache_hits") or 0),
                         int(r.summary.get("prompt_tokens") or 0), int(r.summary.get("hit_blocks") or 0),
                         int(r.summary.get("total_blocks") or 0), "run", r.run_id,
                         r.summary.get("external_prefix_cache_hit_rate")) for r in sweep.runs]
    workload = open_workload(spec)
    trace_id = workload.identity(int(sweep.runs[0].summary.get("requests") or 0))  # (as its runs name it)
    result = CurveResult(_curve_id(trace_id, spec, capacities, ("lru",)), spec.trace, "engine",
                         sweep.runs[0].summary.get("block_size") or spec.block_size, points,
                         external_tier=spec.external_capacity_blocks is not None
                         or any(r.summary.get("external_prefix_cache_queries") for r in sweep.runs))
    if computed is not None:
        computed(result)
    if db is not None:
        _record(db, result, workload.source, trace_id)
    return result


def _curve_id(source_id: str, spec, caps, policies) -> str:
    """A content id over every setting that can move a point (a --config file by its content,
    as a sweep's id): a store keeps one recording per id, so another curve of the trace
    (another retention, tier, config...) must not replace this one."""
    from kvtrace.replay.sweep import id_settings
    from kvtrace.workload.lines import file_sha256

    settings = id_settings(spec)  # (as a sweep's: retention's spellings were other curves, stored twice)
    config = file_sha256(spec.config_file) if spec.config_file else None
    text = json.dumps([source_id, config, settings, list(caps), list(policies)], sort_keys=True, default=str)
    return "curve-" + hashlib.sha256(text.encode()).hexdigest()[:12]


def _record(db, result: CurveResult, source: str, source_id: str) -> None:
    from kvtrace.store import Store
    from kvtrace.store.schema import created_now

    created = created_now()  # metadata, never in a result
    rows = [{"curve_id": result.curve_id, "created": created, "trace_source": source, "trace_digest": source_id,
             "mode": result.mode, "block_size": result.block_size, "policy": p.policy,
             "capacity_blocks": p.capacity_blocks, "hit_tokens": p.hit_tokens, "prompt_tokens": p.prompt_tokens,
             "hit_blocks": p.hit_blocks, "total_blocks": p.total_blocks, "method": p.method, "run_id": p.run_id}
            for p in result.points]
    with Store.open(db) as store:
        store.record_curve(result.curve_id, rows)
