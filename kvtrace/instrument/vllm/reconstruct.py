"""A replayable native trace rebuilt from vLLM's ``BlockStored`` chains.

vLLM's KV events say which blocks were stored under which parent, not which request
stored them. ``ChainTracer`` groups stored runs of blocks into requests (see its
docstring); ``write_native_trace`` writes the requests of one or more tracers (one per
DP rank) through the one native writer, ``kvtrace.workload.native.write_native``, as
``TraceRequest``s with prefix-chained ``hash_ids``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvtrace.instrument.vllm.wire import ALL_BLOCKS_CLEARED, BLOCK_STORED, MEDIUM_GPU, MEDIUM_KEY_CHARS, KVEvent
from kvtrace.workload import TraceRequest
from kvtrace.workload.lines import MAX_TOKENS
from kvtrace.workload.native import write_native


@dataclass(slots=True)
class ChainRequest:
    """One reconstructed request: its prompt is the chain from the root to ``tail``."""

    arrival_ns: int
    tail: str
    last_ns: int  # when the chain was last extended
    block_size: int  # 0: not reported
    group: int | None = None  # the KV cache group that last extended it


class _GroupChains:
    """One KV cache group's stored chains, grouped into requests (``ChainTracer``'s rule)."""

    __slots__ = ("_open", "block_size", "kind", "merge_window_ns", "parent", "requests")

    def __init__(self, merge_window_ns: int):
        self.merge_window_ns = merge_window_ns
        self.parent: dict[str, str | None] = {}
        self.requests: list[ChainRequest] = []
        self._open: dict[str, int] = {}  # tail hash -> index of the request it ends
        self.block_size = 0  # the largest block size its events report (0: none does)
        self.kind: str | None = None  # its kv_cache_spec_kind, where vLLM says it

    def add(self, t_ns: int, ev: KVEvent) -> None:
        tail = ev.block_hashes[-1]
        prev = ev.parent_block_hash
        for h in ev.block_hashes:
            self.parent.setdefault(h, prev)
            prev = h
        idx = self._open.pop(ev.parent_block_hash, None) if ev.parent_block_hash is not None else None
        if idx is not None and t_ns - self.requests[idx].last_ns <= self.merge_window_ns:
            req = self.requests[idx]
            req.tail, req.last_ns, req.group = tail, t_ns, ev.group_idx
        else:
            idx = len(self.requests)
            self.requests.append(ChainRequest(t_ns, tail, t_ns, ev.block_size or 0, ev.group_idx))
        self._open[tail] = idx


class ChainTracer:
    """Rebuilds per-request prompts from BlockStored chains.

    vLLM does not say which request stored a block. A stored run of blocks starts a new
    request unless its parent is the tail of a chain extended less than
    ``merge_window_ns`` earlier (chunked prefill continuing). A request's prompt is the
    chain from the root to its last block; blocks whose parents were never seen start a
    fresh root. Limits: output lengths are unknown (written as 0), a prompt's partial
    last block is never published, and decode-time blocks stored within the window are
    counted as prompt.

    A hybrid model's server publishes a request's blocks once per KV cache group
    (``group_idx``), each at its own block size, a coarse group's blocks under the hashes
    of the finest group's blocks that end where they end. So each group is chained apart,
    and the trace is read from one: a full-attention group where vLLM names the kinds,
    then the finest block size (the most of each prompt), then the lowest index. (Chained
    together, each request was written once per group, and a coarse group's chain ran on
    through a finer group's parents: a 48-token prompt came out as 48 and 64 tokens.)
    At most ``MAX_GROUPS`` groups are chained; the events of others are left out.
    A group's block size is the largest its events report: vLLM 0.33 keys a prompt's tail
    inside a coarse group's block (``cache_partial_block``) with a BlockStored of one hash
    block, whose size the finest group has too. (Taken as the coarse group's, it tied the
    two, the lower index was read, and each such tail was a request of its own: a 100-token
    prompt came out as one of 64 tokens and one of 32.)

    A server that offloads blocks to a second tier publishes that tier's stores in the
    same stream, ``medium`` naming it ("CPU", "STORAGE"): copies of blocks the GPU stored
    for a request, no request's prompt. So each tier's groups are chained apart too, and the
    trace is read from the GPU's (``medium`` "GPU", or none said) where it stored any.
    (Chained together, each offload was a request more: a 32-token prompt where none came.)
    """

    MAX_GROUPS = 64

    def __init__(self, merge_window_ns: int = 1_000_000_000):
        self.merge_window_ns = merge_window_ns
        self._groups: dict[tuple[bool, str | None, int | None], _GroupChains] = {}  # (offloaded, medium, group)

    def add(self, t_ns: int, ev: KVEvent) -> None:
        if ev.kind == ALL_BLOCKS_CLEARED:
            for chains in self._groups.values():
                chains._open.clear()
            return
        if ev.kind != BLOCK_STORED or not ev.block_hashes:
            return
        offloaded = ev.medium not in (None, MEDIUM_GPU)
        key = (offloaded, ev.medium[:MEDIUM_KEY_CHARS] if ev.medium and offloaded else None, ev.group_idx)
        group = self._groups.get(key)
        if group is None:
            if len(self._groups) >= self.MAX_GROUPS:  # (a stream of distinct indexes grows nothing)
                return
            group = self._groups[key] = _GroupChains(self.merge_window_ns)
        if ev.block_size and ev.block_size > group.block_size:  # (a partial tail entry's is smaller)
            group.block_size = ev.block_size
        if ev.kv_cache_spec_kind is not None:
            group.kind = ev.kv_cache_spec_kind
        group.add(t_ns, ev)

    def _read(self) -> _GroupChains | None:
        """The group the trace is read from (None: no block stored yet): the GPU's first."""
        if not self._groups:
            return None
        tier = min(key[:2] for key in self._groups)  # ((False, None): the GPU's)
        groups = {key[2]: g for key, g in self._groups.items() if key[:2] == tier}
        named = any(g.kind is not None for g in groups.values())
        return min(groups.items(), key=lambda item: (
            named and item[1].kind != "full_attention", item[1].block_size or 1 << 62,
            -1 if item[0] is None else item[0]))[1]

    @property
    def requests(self) -> list[ChainRequest]:
        group = self._read()
        return [] if group is None else group.requests

    def chain(self, tail: str) -> list[str]:
        """The hashes from the root to ``tail`` in the group read (a cycle, which vLLM never
        sends, stops it)."""
        group = self._read()
        parent = {} if group is None else group.parent
        out, seen = [], set()
        h: str | None = tail
        while h is not None and h not in seen:
            seen.add(h)
            out.append(h)
            h = parent.get(h)
        out.reverse()
        return out


def native_requests(tracers: list[ChainTracer]) -> tuple[list[TraceRequest], int]:
    """``native_trace``'s requests and block size."""
    requests, block_size, _ = native_trace(tracers)
    return requests, block_size


def native_trace(tracers: list[ChainTracer]) -> tuple[list[TraceRequest], int, list[int]]:
    """The requests of every tracer (one per DP rank) in arrival order, arrivals relative
    to the first, the trace's block size, and how many of each tracer's requests were cut.
    A hash stored on two ranks is one hash id: the ranks share that prefix. A request whose
    block size was not reported takes the first one that was (1 when none was). A chain of
    more tokens than kvtrace replays (``MAX_TOKENS``: vLLM's blocks may report up to 2^31 - 1
    tokens each) is cut to its longest prefix of blocks within it (at least one block: a block
    size is within int32), and counted: written whole, the trace was refused by ``replay``."""
    reqs = sorted(((r, i) for i, t in enumerate(tracers) for r in t.requests), key=lambda rt: rt[0].arrival_ns)
    t0 = reqs[0][0].arrival_ns if reqs else 0
    block_size = next((r.block_size for r, _ in reqs if r.block_size), 0) or 1
    interned: dict[str, int] = {}
    out = []
    cut = [0] * len(tracers)
    for n, (r, i) in enumerate(reqs):
        bs = r.block_size or block_size
        chain = tracers[i].chain(r.tail)
        if len(chain) * bs > MAX_TOKENS:
            chain = chain[:max(1, MAX_TOKENS // bs)]
            cut[i] += 1
        ids = tuple(interned.setdefault(h, len(interned)) for h in chain)
        out.append(TraceRequest(f"vllm-{n}", r.arrival_ns - t0, len(ids) * bs, 0, hash_ids=ids, hash_block_size=bs))
    return out, block_size, cut


def write_native_trace(path: str | Path, tracers: list[ChainTracer], source: str = "vllm-kv-events") -> int:
    """Write ``native_requests(tracers)`` as a native JSONL trace (atomically, through
    ``write_native``); returns the number of requests."""
    return write_requests(path, native_requests(tracers), source)


def write_requests(path: str | Path, trace: tuple[list[TraceRequest], int], source: str = "vllm-kv-events") -> int:
    """Write ``native_requests``' answer (the requests and block size) as ``write_native_trace`` does."""
    requests, block_size = trace
    return write_native(requests, path, header={"source": source, "block_size": block_size})
