"""Live capture of a vLLM server's KV events (ZMQ) into the kvtrace store.

Wire format (vllm/distributed/kv_events.py, ``ZmqEventPublisher``):

- PUB socket, multipart ``(topic, seq, payload)``: ``seq`` is an 8-byte big-endian
  counter from 0; ``payload`` is a msgpack ``EventBatch``: ``[ts, events, dp_rank]``
  (array-like; older versions omit ``dp_rank``) or, in versions without
  ``array_like``, the map ``{"ts", "events", "data_parallel_rank"}``.
- each event is a msgspec tagged struct, either array-like ``["BlockStored", ...fields]``
  or a map ``{"type": "BlockStored", ...}``. Field order: ``BlockStored(block_hashes,
  parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys,
  group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window, ...)``,
  ``BlockRemoved(block_hashes, medium, group_idx, ...)``, ``AllBlocksCleared()``.
  Older versions stop earlier; decoding takes what is there. Hashes are ints or bytes.
- replay: a ROUTER socket. A client sends the first missing seq as 8-byte big-endian
  (a DEALER sends ``["", seq]``); the server answers one ``("", seq, payload)`` message
  per buffered batch with seq >= start, then ``("", -1 as 8 signed bytes, "")``.

A sequence gap is recovered through the replay socket; batches the server no longer
holds are counted as lost. Events become the cache span kinds with ``source = 'vllm'``:
``BlockStored`` -> ``kvtrace.cache.publish`` (``publish_kind = 'vllm_stored'``),
``BlockRemoved`` -> ``kvtrace.cache.evict`` (``evict_reason = 'vllm_removed'``),
``AllBlocksCleared`` -> ``kvtrace.cache.evict`` (``evict_reason = 'reset'``); each batch
is a ``kvtrace.engine.step`` span (``step`` = seq) parenting its events.

Data parallelism: each vLLM DP rank runs its own publisher at ``dp_endpoint(endpoint,
rank)`` (vLLM's ``offset_endpoint_port``: tcp port + rank, ``_dp{rank}`` after an
ipc/inproc name; the replay endpoint likewise). ``capture_vllm(dp_size=N)`` subscribes to
all N, each with its own sequence tracking and gap recovery, into one run; spans carry
``kvtrace.vllm.dp_rank`` and the endpoint they came from.

The capture can also write a replayable kvtrace native trace (JSONL, format 1, see
``kvtrace.replay.readers.native``) reconstructed from the ``BlockStored`` chains.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import msgspec
import zmq

from kvtrace.errors import ConfigError, KVTraceError
from kvtrace.instrument.convert import SpanRowsBuilder
from kvtrace.instrument.ids import SeededIdGenerator
from kvtrace.store.schema import SOURCE_VLLM, SPAN_EVICT, SPAN_PUBLISH, SPAN_STEP
from kvtrace.store.writer import Store

END_SEQ = (-1).to_bytes(8, "big", signed=True)
PUBLISH_KIND_VLLM = "vllm_stored"
EVICT_REASON_VLLM = "vllm_removed"
EVICT_REASON_RESET = "reset"
_MASK64 = (1 << 64) - 1
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                  "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


class VllmWireError(KVTraceError):
    """A ZMQ message that is not a vLLM KV event batch."""


def dp_endpoint(endpoint: str | None, rank: int, option: str = "--endpoint") -> str | None:
    """Where vLLM's DP rank ``rank`` publishes when configured with ``endpoint`` (its
    ``ZmqEventPublisher.offset_endpoint_port``): a tcp port plus the rank; an ipc or
    inproc name with ``_dp{rank}`` appended. Rank 0 and None are unchanged."""
    if not endpoint:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{rank}" if rank else endpoint
    base, sep, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not sep or not port.isdigit() or base == "tcp:/":
        raise ConfigError(option, endpoint, "expected tcp://HOST:PORT, ipc://PATH or inproc://NAME")
    if rank == 0:
        return endpoint
    if int(port) + rank > 65_535:
        raise ConfigError(option, endpoint, f"port {port} + DP rank {rank} exceeds 65535")
    return f"{base}:{int(port) + rank}"


@dataclass(slots=True)
class KVEvent:
    kind: str  # BlockStored | BlockRemoved | AllBlocksCleared
    block_hashes: list[str] = field(default_factory=list)  # lowercase hex
    parent_block_hash: str | None = None
    token_ids: list[int] | None = None
    block_size: int | None = None
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


@dataclass(slots=True)
class KVEventBatch:
    ts: float
    events: list[KVEvent]
    dp_rank: int | None = None


def hash_hex(h: Any) -> str:
    """A vLLM external block hash (bytes, or an int that may be negative) as hex."""
    if isinstance(h, (bytes, bytearray)):
        return bytes(h).hex()
    if isinstance(h, int) and not isinstance(h, bool):
        return f"{h & _MASK64:016x}"  # vLLM ints are 64-bit, possibly negative
    raise VllmWireError(f"vLLM KV event: block hash must be int or bytes, got {type(h).__name__}")


def _fields(raw: Any, names: tuple[str, ...]) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    return dict(zip(names, raw[1:]))  # array-like: the tag, then fields in order


def _decode_event(raw: Any) -> KVEvent | None:
    if isinstance(raw, dict):
        tag = raw.get("type")
    elif isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        tag = raw[0]
    else:
        raise VllmWireError(f"vLLM KV event: expected a tagged array or map, got {type(raw).__name__}")
    if tag == "BlockStored":
        f = _fields(raw, _STORED_FIELDS)
        parent = f.get("parent_block_hash")
        tokens = f.get("token_ids")
        return KVEvent(
            "BlockStored", [hash_hex(h) for h in f.get("block_hashes") or ()],
            None if parent is None else hash_hex(parent),
            list(tokens) if tokens is not None else None, f.get("block_size"), f.get("lora_id"),
            f.get("medium"), f.get("lora_name"), f.get("group_idx"), f.get("kv_cache_spec_kind"),
        )
    if tag == "BlockRemoved":
        f = _fields(raw, _REMOVED_FIELDS)
        return KVEvent("BlockRemoved", [hash_hex(h) for h in f.get("block_hashes") or ()],
                       medium=f.get("medium"), group_idx=f.get("group_idx"))
    if tag == "AllBlocksCleared":
        return KVEvent("AllBlocksCleared")
    return None  # an event kind this version does not know


def decode_kv_batch(payload: bytes) -> tuple[KVEventBatch, int]:
    """Decode one payload; returns the batch and the number of unknown events skipped."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as err:
        raise VllmWireError(f"vLLM KV event batch: not msgpack ({err})") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, (list, tuple)) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    else:
        raise VllmWireError("vLLM KV event batch: expected [ts, events, dp_rank] or a map")
    if not isinstance(ts, (int, float)) or not isinstance(events, (list, tuple)):
        raise VllmWireError("vLLM KV event batch: bad ts or events")
    try:
        decoded = [_decode_event(e) for e in events]
    except (TypeError, KeyError, IndexError) as err:
        raise VllmWireError(f"vLLM KV event: malformed fields ({err})") from None
    kept = [e for e in decoded if e is not None]
    return KVEventBatch(float(ts), kept, rank), len(decoded) - len(kept)


# --- spans --------------------------------------------------------------------------------
class _SpanWriter:
    """Batches -> store rows (one step span per batch, one child span per event)."""

    def __init__(self, ids: SeededIdGenerator, resource: dict[str, str], dp_rank: int | None = None):
        self.ids = ids
        self.resource = resource
        self.dp_rank = dp_rank  # the endpoint's rank, for payloads that do not carry one
        self.rows = SpanRowsBuilder()
        self.spans = 0
        self.depth: dict[str, int] = {}  # hash -> blocks from the root (for num_tokens)

    def add(self, seq: int, batch: KVEventBatch) -> None:
        t = int(round(batch.ts * 1e9))
        trace_id, step_span = self.ids.generate_trace_id(), self.ids.generate_span_id()
        common = {"kvtrace.source": SOURCE_VLLM, "kvtrace.step": seq}
        rank = batch.dp_rank if batch.dp_rank is not None else self.dp_rank
        if rank is not None:
            common["kvtrace.vllm.dp_rank"] = rank
        self.rows.add(name=SPAN_STEP, trace_id=trace_id, span_id=step_span, start_ns=t, end_ns=t,
                      attributes=dict(common, **{"kvtrace.vllm.num_events": len(batch.events)}),
                      resource=self.resource, scope_name="kvtrace.instrument.vllm")
        self.spans += 1
        for ev in batch.events:
            attrs = dict(common)
            if ev.group_idx is not None:
                attrs["kvtrace.group"] = ev.group_idx
            if ev.medium is not None:
                attrs["kvtrace.vllm.medium"] = ev.medium
            if ev.kind == "BlockStored":
                name = SPAN_PUBLISH
                attrs["kvtrace.publish.kind"] = PUBLISH_KIND_VLLM
                attrs["kvtrace.block.hashes"] = ev.block_hashes
                if ev.parent_block_hash is not None:
                    attrs["kvtrace.vllm.parent_block_hash"] = ev.parent_block_hash
                if ev.token_ids is not None:
                    attrs["kvtrace.vllm.token_ids"] = ev.token_ids
                if ev.block_size is not None:
                    attrs["kvtrace.vllm.block_size"] = ev.block_size
                if ev.lora_id is not None:
                    attrs["kvtrace.vllm.lora_id"] = ev.lora_id
                if ev.lora_name is not None:
                    attrs["kvtrace.vllm.lora_name"] = ev.lora_name
                if ev.kv_cache_spec_kind is not None:
                    attrs["kvtrace.vllm.kv_cache_spec_kind"] = ev.kv_cache_spec_kind
                base = 0 if ev.parent_block_hash is None else self.depth.get(ev.parent_block_hash)
                if base is not None:
                    for i, h in enumerate(ev.block_hashes):
                        self.depth[h] = base + i + 1
                    if ev.block_size and ev.block_hashes:
                        attrs["kvtrace.num_tokens"] = (base + len(ev.block_hashes)) * ev.block_size
            elif ev.kind == "BlockRemoved":
                name = SPAN_EVICT
                attrs["kvtrace.evict.reason"] = EVICT_REASON_VLLM
                attrs["kvtrace.block.hashes"] = ev.block_hashes
                for h in ev.block_hashes:
                    self.depth.pop(h, None)
            else:
                name = SPAN_EVICT
                attrs["kvtrace.evict.reason"] = EVICT_REASON_RESET
                self.depth.clear()
            self.rows.add(name=name, trace_id=trace_id, span_id=self.ids.generate_span_id(), parent_span_id=step_span,
                          start_ns=t, end_ns=t, attributes=attrs, resource=self.resource,
                          scope_name="kvtrace.instrument.vllm")
            self.spans += 1

    def take(self):
        return self.rows.to_table() if self.rows.n else None


# --- native trace reconstruction ------------------------------------------------------------
class ChainTracer:
    """Rebuilds per-request prompts from BlockStored chains.

    vLLM does not say which request stored a block. A stored run of blocks starts a new
    request unless its parent is the tail of a chain extended less than
    ``merge_window_ns`` earlier (chunked prefill continuing). A request's prompt is the
    chain from the root to its last block; blocks whose parents were never seen start a
    fresh root. Limits: output lengths are unknown (written as 0), a prompt's partial
    last block is never published, and decode-time blocks stored within the window are
    counted as prompt.
    """

    def __init__(self, merge_window_ns: int = 1_000_000_000):
        self.merge_window_ns = merge_window_ns
        self.parent: dict[str, str | None] = {}
        self.requests: list[dict] = []  # {"arrival_ns", "tail", "last_ns", "block_size"}
        self._open: dict[str, int] = {}  # tail hash -> index of the request it ends

    def add(self, t_ns: int, ev: KVEvent) -> None:
        if ev.kind == "AllBlocksCleared":
            self._open.clear()
            return
        if ev.kind != "BlockStored" or not ev.block_hashes:
            return
        prev = ev.parent_block_hash
        for h in ev.block_hashes:
            self.parent.setdefault(h, prev)
            prev = h
        tail = ev.block_hashes[-1]
        idx = self._open.pop(ev.parent_block_hash, None) if ev.parent_block_hash is not None else None
        if idx is not None and t_ns - self.requests[idx]["last_ns"] <= self.merge_window_ns:
            req = self.requests[idx]
            req["tail"], req["last_ns"] = tail, t_ns
        else:
            idx = len(self.requests)
            self.requests.append({"arrival_ns": t_ns, "tail": tail, "last_ns": t_ns, "block_size": ev.block_size or 0})
        self._open[tail] = idx

    def chain(self, tail: str) -> list[str]:
        out, seen, h = [], set(), tail
        while h is not None and h not in seen:
            seen.add(h)
            out.append(h)
            h = self.parent.get(h)
        out.reverse()
        return out


def write_native_trace(path: str | Path, tracers: list[ChainTracer], source: str = "vllm-kv-events") -> int:
    """The requests of every tracer (one per DP rank) as one native JSONL trace, in arrival
    order (atomic rename); returns the count. A hash stored on two ranks is one trace id:
    the ranks share that prefix."""
    interned: dict[str, int] = {}
    lines = []
    reqs = sorted(((r, t) for t in tracers for r in t.requests), key=lambda rt: rt[0]["arrival_ns"])
    t0 = reqs[0][0]["arrival_ns"] if reqs else 0
    block_size = next((r["block_size"] for r, _ in reqs if r["block_size"]), 0)
    for i, (r, tracer) in enumerate(reqs):
        ids = [interned.setdefault(h, len(interned)) for h in tracer.chain(r["tail"])]
        bs = r["block_size"] or block_size or 1
        lines.append({"request_id": f"vllm-{i}", "arrival_ns": r["arrival_ns"] - t0,
                      "input_length": len(ids) * bs, "output_length": 0, "hash_ids": ids, "block_size": bs})
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(json.dumps({"kvtrace_trace": 1, "source": source, "block_size": block_size or 1},
                           separators=(",", ":")) + "\n")
        for line in lines:
            f.write(json.dumps(line, separators=(",", ":")) + "\n")
    os.replace(tmp, path)
    return len(lines)


# --- capture ---------------------------------------------------------------------------------
@dataclass(slots=True)
class CaptureStats:
    run_id: str | None = None
    batches: int = 0
    events: int = 0
    spans: int = 0
    unknown_events: int = 0
    gaps: int = 0
    recovered: int = 0
    lost: int = 0
    duplicates: int = 0
    restarts: int = 0
    bad_messages: int = 0
    requests: int = 0  # reconstructed (when a trace is written)

    def counts(self) -> dict[str, int]:
        return {f: getattr(self, f) for f in self.__slots__ if f != "run_id"}

    @classmethod
    def total(cls, parts: list["CaptureStats"], run_id: str | None) -> "CaptureStats":
        """The sum over several captures (the DP ranks of one run)."""
        out = cls(run_id=run_id)
        for part in parts:
            for f, v in part.counts().items():
                setattr(out, f, getattr(out, f) + v)
        return out


class VllmKVCapture:
    """Subscribes to one vLLM KV event publisher and records what it sends."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *, store: Store | None = None,
                 run_id: str | None = None, topic: str = "", seed: int = 0, replay_timeout_s: float = 2.0,
                 tracer: ChainTracer | None = None, flush_interval_s: float = 0.5,
                 on_batch: Callable[[int, KVEventBatch], None] | None = None, dp_rank: int | None = None):
        """``dp_rank``: the DP rank this endpoint serves (for batches that do not say)."""
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.store, self.run_id = store, run_id
        self.replay_timeout_s = replay_timeout_s
        self.flush_interval_s = flush_interval_s
        self.tracer = tracer
        self.on_batch = on_batch
        self.stats = CaptureStats(run_id=run_id)
        self.last_seq: int | None = None
        self._writer = _SpanWriter(SeededIdGenerator(seed), {"service.name": "vllm", "kvtrace.vllm.endpoint": endpoint},
                                   dp_rank)
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, 1_000_000)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        self._connect(self._sub, endpoint, "--endpoint")
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._connect(self._replay, replay_endpoint, "--replay-endpoint")
        self._last_flush = time.monotonic()

    def _connect(self, sock: zmq.Socket, address: str, option: str) -> None:
        try:
            sock.connect(address)
        except zmq.ZMQError as err:  # a malformed address, an unresolvable host
            self.close()
            raise ConfigError(option, address, str(err)) from None

    def close(self) -> None:
        self.flush()
        self._sub.close(0)
        if self._replay is not None:
            self._replay.close(0)
        self._ctx.term()

    # -- loop -------------------------------------------------------------------------------
    def run(self, duration: float | None = None, should_stop: Callable[[], bool] | None = None) -> CaptureStats:
        """Receive until ``duration`` seconds pass, ``should_stop()`` is true, or Ctrl-C."""
        run_captures([self], duration, should_stop)
        return self.stats

    def receive(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats.bad_messages += 1
            return
        _, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        last = self.last_seq
        if last is not None and seq <= last:
            if seq == 0 and last > 0:
                self.stats.restarts += 1  # the publisher restarted its counter
                self.last_seq = None
            else:
                self.stats.duplicates += 1
                return
        elif last is not None and seq > last + 1:
            self._recover(last + 1, seq)
        self._accept(seq, payload)

    def _accept(self, seq: int, payload: bytes) -> None:
        try:
            batch, unknown = decode_kv_batch(payload)
        except VllmWireError:
            self.stats.bad_messages += 1
            self.last_seq = seq
            return
        self.last_seq = seq
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        self.stats.unknown_events += unknown
        self._writer.add(seq, batch)
        if self.tracer is not None:
            t = int(round(batch.ts * 1e9))
            for ev in batch.events:
                self.tracer.add(t, ev)
        if self.on_batch is not None:
            self.on_batch(seq, batch)

    def _recover(self, first: int, upto: int) -> None:
        """Fetch batches [first, upto) from the replay socket; count what is not returned."""
        missing = upto - first
        self.stats.gaps += 1
        got: dict[int, bytes] = {}
        if self._replay is not None:
            while self._replay.poll(0):  # late answers to an earlier, timed-out request
                self._replay.recv_multipart()
            self._replay.send_multipart([b"", first.to_bytes(8, "big")])
            deadline = time.monotonic() + self.replay_timeout_s
            while time.monotonic() < deadline:
                if not self._replay.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                    break
                frames = self._replay.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) != 2 or frames[0] == END_SEQ or not frames[1]:
                    break
                s = int.from_bytes(frames[0], "big")
                if first <= s < upto:
                    got[s] = frames[1]
        for s in sorted(got):
            self._accept(s, got[s])
        self.stats.recovered += len(got)
        self.stats.lost += missing - len(got)

    def flush(self) -> None:
        self._last_flush = time.monotonic()
        table = self._writer.take()
        self.stats.spans = self._writer.spans
        if table is not None and self.store is not None:
            self.store.append_spans(table, run_id=self.run_id)
            self.store.flush()


def run_captures(caps: list[VllmKVCapture], duration: float | None = None,
                 should_stop: Callable[[], bool] | None = None) -> None:
    """Receive on every capture's socket until ``duration`` seconds pass, ``should_stop()``
    is true, or Ctrl-C; each flushes on its own interval and once at the end."""
    deadline = None if duration is None else time.monotonic() + duration
    poller = zmq.Poller()
    for cap in caps:
        poller.register(cap._sub, zmq.POLLIN)
    by_socket = {cap._sub: cap for cap in caps}
    try:
        while True:
            if should_stop is not None and should_stop():
                break
            timeout = 100 if deadline is None else max(0, min(100, int((deadline - time.monotonic()) * 1000)))
            for sock, _ in poller.poll(timeout):
                by_socket[sock].receive(sock.recv_multipart())
            if deadline is not None and time.monotonic() >= deadline:
                break
            now = time.monotonic()
            for cap in caps:
                if now - cap._last_flush >= cap.flush_interval_s:
                    cap.flush()
    except KeyboardInterrupt:
        pass
    for cap in caps:
        cap.flush()


def capture_vllm(endpoint: str, replay_endpoint: str | None = None, *, store_path: str | Path,
                 duration: float | None = None, topic: str = "", trace_out: str | Path | None = None,
                 run_name: str | None = None, seed: int = 0, replay_timeout_s: float = 2.0, dp_size: int = 1,
                 should_stop: Callable[[], bool] | None = None,
                 on_ready: Callable[[VllmKVCapture], None] | None = None) -> CaptureStats:
    """Record a live vLLM server's KV events into a new run of the store at ``store_path``.

    ``dp_size``: the server's data-parallel size; ranks 0..N-1 are captured at
    ``dp_endpoint(endpoint, rank)`` (and the replay endpoint likewise) into the same run.
    ``trace_out``: also write the reconstructed native trace there. Returns the stats
    (summed over ranks); the run is marked complete (or failed on an error), its summary
    holds the totals and, for several ranks, each rank's.
    """
    if dp_size < 1:
        raise ConfigError("--dp-size", str(dp_size), "must be at least 1")
    endpoints = [(dp_endpoint(endpoint, r), dp_endpoint(replay_endpoint, r, "--replay-endpoint"))
                 for r in range(dp_size)]
    with Store.open(store_path) as store:
        run_id = store.create_run(run_name or f"vllm {endpoint}", trace_source=endpoint, mode="live",
                                  config={"endpoint": endpoint, "replay_endpoint": replay_endpoint, "topic": topic,
                                          "dp_size": dp_size})
        caps: list[VllmKVCapture] = []
        try:
            for rank, (pub, replay) in enumerate(endpoints):
                # rank 0 keeps the single-endpoint seed, so its rows do not change with dp_size
                caps.append(VllmKVCapture(pub, replay, store=store, run_id=run_id, topic=topic,
                                          seed=seed + (rank << 32), replay_timeout_s=replay_timeout_s,
                                          tracer=ChainTracer() if trace_out else None,
                                          dp_rank=rank if dp_size > 1 else None))
            if on_ready is not None:
                for cap in caps:
                    on_ready(cap)
            run_captures(caps, duration, should_stop)
        finally:
            for cap in caps:
                cap.close()
        stats = CaptureStats.total([c.stats for c in caps], run_id)
        if trace_out is not None:
            stats.requests = write_native_trace(trace_out, [c.tracer for c in caps], source=f"vllm:{endpoint}")
        summary = {k: getattr(stats, k) for k in ("batches", "events", "spans", "gaps", "recovered", "lost",
                                                 "duplicates", "bad_messages", "requests")}
        if dp_size > 1:
            summary["ranks"] = [{"endpoint": c.endpoint, **c.stats.counts()} for c in caps]
        store.finish_run(run_id, status="complete", summary=summary)
    return stats
