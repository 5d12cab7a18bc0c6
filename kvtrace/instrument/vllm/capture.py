"""Live capture: subscribe to vLLM's KV-event publishers and record into the store.

``VllmKVCapture`` follows one publisher (one DP rank): it tracks the sequence, recovers a
gap through the replay socket (batches the server no longer holds are counted as lost),
turns batches into span rows (``VllmSpanRows``) and appends them to a store run on a
flush interval. ``run_captures`` polls several captures' SUB sockets in one loop;
``capture_vllm`` is the whole command: a run, one capture per DP rank, the summary and,
optionally, the reconstructed native trace.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zmq

from kvtrace.errors import ConfigError, check_option
from kvtrace.instrument.ids import SeededIdGenerator
from kvtrace.instrument.vllm.reconstruct import ChainTracer, write_native_trace
from kvtrace.instrument.vllm.rows import ENDPOINT_KEY, VllmSpanRows
from kvtrace.instrument.vllm.wire import END_SEQ, KVEventBatch, VllmWireError, decode_kv_batch, dp_endpoint
from kvtrace.store.writer import Store


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
    def total(cls, parts: list[CaptureStats], run_id: str | None) -> CaptureStats:
        """The sum over several captures (the DP ranks of one run)."""
        out = cls(run_id=run_id)
        for part in parts:
            for f, v in part.counts().items():
                setattr(out, f, getattr(out, f) + v)
        return out


class VllmKVCapture:
    """Subscribes to one vLLM KV event publisher and records what it sends.

    ``socket``: the SUB socket, for a caller's own poll loop (``run_captures``), which
    hands each message to ``receive`` and calls ``flush`` when ``flush_due(now)``.
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *, store: Store | None = None,
                 run_id: str | None = None, topic: str = "", seed: int = 0, replay_timeout_s: float = 2.0,
                 tracer: ChainTracer | None = None, flush_interval_s: float = 0.5,
                 on_batch: Callable[[int, KVEventBatch], None] | None = None, dp_rank: int | None = None):
        """``dp_rank``: the DP rank this endpoint serves (for batches that do not say).
        Raises ``ConfigError`` for an address ZMQ cannot connect to."""
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.store, self.run_id = store, run_id
        self.replay_timeout_s = replay_timeout_s
        self.flush_interval_s = flush_interval_s
        self.tracer = tracer
        self.on_batch = on_batch
        self.stats = CaptureStats(run_id=run_id)
        self.last_seq: int | None = None
        self._rows = VllmSpanRows(SeededIdGenerator(seed), {"service.name": "vllm", ENDPOINT_KEY: endpoint}, dp_rank)
        self._ctx = zmq.Context()
        self.socket = self._ctx.socket(zmq.SUB)
        self.socket.setsockopt(zmq.RCVHWM, 1_000_000)
        self.socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.socket.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None
        self._connect(self.socket, endpoint, "--endpoint")
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
        """Flush what is pending and close the sockets."""
        self.flush()
        self.socket.close(0)
        if self._replay is not None:
            self._replay.close(0)
        self._ctx.term()

    # -- loop -------------------------------------------------------------------------------
    def run(self, duration: float | None = None, should_stop: Callable[[], bool] | None = None) -> CaptureStats:
        """Receive until ``duration`` seconds pass, ``should_stop()`` is true, or Ctrl-C."""
        run_captures([self], duration, should_stop)
        return self.stats

    def receive(self, frames: list[bytes]) -> None:
        """One multipart message from ``socket``: duplicates are dropped, a gap is
        recovered (or counted lost) before the message is accepted."""
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
        self._rows.add(seq, batch)
        if self.tracer is not None:
            t = round(batch.ts * 1e9)
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

    def flush_due(self, now: float) -> bool:
        """True when ``flush_interval_s`` has passed since the last flush (``now``: monotonic)."""
        return now - self._last_flush >= self.flush_interval_s

    def flush(self) -> None:
        """Append the rows received since the last flush to the store and commit."""
        self._last_flush = time.monotonic()
        table = self._rows.take()
        self.stats.spans = self._rows.spans
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
        poller.register(cap.socket, zmq.POLLIN)
    by_socket = {cap.socket: cap for cap in caps}
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
                if cap.flush_due(now):
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
    (summed over ranks); the run is marked complete (failed on an error, by the store),
    its summary holds the totals and, for several ranks, each rank's.
    """
    check_option("--dp-size", dp_size, 1, 1024)
    if duration is not None:
        check_option("--duration", duration, 0)
    endpoints: list[tuple[str, str | None]] = []
    for r in range(dp_size):
        pub = dp_endpoint(endpoint, r)
        if not pub:
            raise ConfigError("--endpoint", str(endpoint), "expected tcp://HOST:PORT, ipc://PATH or inproc://NAME")
        endpoints.append((pub, dp_endpoint(replay_endpoint, r, "--replay-endpoint")))
    tracers = [ChainTracer() for _ in endpoints] if trace_out else None
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
                                          tracer=tracers[rank] if tracers else None,
                                          dp_rank=rank if dp_size > 1 else None))
            if on_ready is not None:
                for cap in caps:
                    on_ready(cap)
            run_captures(caps, duration, should_stop)
        finally:
            for cap in caps:
                cap.close()
        stats = CaptureStats.total([c.stats for c in caps], run_id)
        if trace_out is not None and tracers:
            stats.requests = write_native_trace(trace_out, tracers, source=f"vllm:{endpoint}")
        summary = {k: getattr(stats, k) for k in ("batches", "events", "spans", "gaps", "recovered", "lost",
                                                 "duplicates", "bad_messages", "requests")}
        if dp_size > 1:
            summary["ranks"] = [{"endpoint": c.endpoint, **c.stats.counts()} for c in caps]
        store.finish_run(run_id, status="complete", summary=summary)
    return stats
