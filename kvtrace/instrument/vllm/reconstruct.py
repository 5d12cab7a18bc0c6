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

from kvtrace.instrument.vllm.wire import ALL_BLOCKS_CLEARED, BLOCK_STORED, KVEvent
from kvtrace.workload import TraceRequest
from kvtrace.workload.native import write_native


@dataclass(slots=True)
class ChainRequest:
    """One reconstructed request: its prompt is the chain from the root to ``tail``."""

    arrival_ns: int
    tail: str
    last_ns: int  # when the chain was last extended
    block_size: int  # 0: not reported
    group: int | None = None  # the KV cache group that last extended it


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
    (``group_idx``), every group with the same hashes (at its own block size): a run of
    blocks whose last block ends a request that another group extended in the same batch
    is that group's copy, not a request of its own. (Each request was written once per
    group, and a coarser group's chain ran on through a finer group's parents: a 64-token
    prompt said 192.)
    """

    def __init__(self, merge_window_ns: int = 1_000_000_000):
        self.merge_window_ns = merge_window_ns
        self.parent: dict[str, str | None] = {}
        self.requests: list[ChainRequest] = []
        self._open: dict[str, int] = {}  # tail hash -> index of the request it ends

    def add(self, t_ns: int, ev: KVEvent) -> None:
        if ev.kind == ALL_BLOCKS_CLEARED:
            self._open.clear()
            return
        if ev.kind != BLOCK_STORED or not ev.block_hashes:
            return
        tail = ev.block_hashes[-1]
        same = self._open.get(tail)
        if same is not None and self.requests[same].last_ns == t_ns and self.requests[same].group != ev.group_idx:
            return  # another KV cache group's copy of blocks stored in this batch
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

    def chain(self, tail: str) -> list[str]:
        """The hashes from the root to ``tail`` (a cycle, which vLLM never sends, stops it)."""
        out, seen = [], set()
        h: str | None = tail
        while h is not None and h not in seen:
            seen.add(h)
            out.append(h)
            h = self.parent.get(h)
        out.reverse()
        return out


def native_requests(tracers: list[ChainTracer]) -> tuple[list[TraceRequest], int]:
    """The requests of every tracer (one per DP rank) in arrival order, arrivals relative
    to the first, and the trace's block size. A hash stored on two ranks is one hash id:
    the ranks share that prefix. A request whose block size was not reported takes the
    first one that was (1 when none was)."""
    reqs = sorted(((r, t) for t in tracers for r in t.requests), key=lambda rt: rt[0].arrival_ns)
    t0 = reqs[0][0].arrival_ns if reqs else 0
    block_size = next((r.block_size for r, _ in reqs if r.block_size), 0) or 1
    interned: dict[str, int] = {}
    out = []
    for i, (r, tracer) in enumerate(reqs):
        ids = tuple(interned.setdefault(h, len(interned)) for h in tracer.chain(r.tail))
        bs = r.block_size or block_size
        out.append(TraceRequest(f"vllm-{i}", r.arrival_ns - t0, len(ids) * bs, 0, hash_ids=ids, hash_block_size=bs))
    return out, block_size


def write_native_trace(path: str | Path, tracers: list[ChainTracer], source: str = "vllm-kv-events") -> int:
    """Write ``native_requests(tracers)`` as a native JSONL trace (atomically, through
    ``write_native``); returns the number of requests."""
    return write_requests(path, native_requests(tracers), source)


def write_requests(path: str | Path, trace: tuple[list[TraceRequest], int], source: str = "vllm-kv-events") -> int:
    """Write ``native_requests``' answer (the requests and block size) as ``write_native_trace`` does."""
    requests, block_size = trace
    return write_native(requests, path, header={"source": source, "block_size": block_size})
