"""A ZMQ KV-event publisher that speaks vLLM's wire format (vllm/distributed/kv_events.py).

The structs mirror vLLM's msgspec definitions, so ``msgspec.msgpack`` produces exactly the
bytes a vLLM server sends: ``LEGACY`` is the array-like layout of older releases,
``CURRENT`` the tagged-map events of newer ones (with group_idx / kv_cache_spec_kind).
Replay follows an older ``ZmqEventPublisher._service_replay``: ROUTER receives
``(identity, "", start_seq)`` and answers ``(identity, "", seq, payload)`` per buffered
batch with seq >= start, then ``(identity, "", -1, "")`` (vLLM 0.33 adds the topic to each
answer; tests/instrument/test_vllm_real_publisher.py runs that real publisher).
``publish_raw`` sends bytes that are no valid batch, for the hostile-input tests.
"""

from __future__ import annotations

import threading
from typing import Any

import msgspec
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _structs(array_like: bool):
    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int | bytes]
        parent_block_hash: int | bytes | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int | bytes]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    return EventBatch, BlockStored, BlockRemoved, AllBlocksCleared


LEGACY = _structs(array_like=True)
CURRENT = _structs(array_like=False)


class VllmPublisher:
    def __init__(self, topic: str = "kv-events", port: int | None = None, replay_port: int | None = None,
                 host: str = "127.0.0.1"):
        """Binds ``host`` (an IPv6 one in brackets, ``[::1]``) at the given ports, or at free
        ones (raises zmq.ZMQError if taken)."""
        self.host = host
        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.IPV6, int(host.startswith("[")))
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        # vLLM's publisher's own high-water mark (ZmqEventPublisher(hwm=100_000)): at ZMQ's
        # default 1,000 a burst under load dropped messages here, and a burst's dropped last
        # message is a gap no later message reveals (a test waited for it in vain)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        try:
            self.endpoint = self._bind(self.pub, port)
            self.replay_endpoint = self._bind(self.router, replay_port)
        except zmq.ZMQError:
            self.pub.close(0)
            self.router.close(0)
            self.ctx.term()
            raise
        self.topic = topic.encode()
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self.replay_requests: list[int] = []
        self.endless_replay = False  # a hostile replay socket: answers forever, never the end marker
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()
        self._lock = threading.Lock()

    def _bind(self, sock, port: int | None) -> str:
        if port is None:
            port = sock.bind_to_random_port(f"tcp://{self.host}")
        else:
            sock.bind(f"tcp://{self.host}:{port}")
        return f"tcp://{self.host}:{port}"

    def publish(self, batch, send: bool = True) -> int:
        """Encode and buffer one batch; ``send=False`` drops it on the PUB side (a gap)."""
        return self.publish_raw(msgspec.msgpack.encode(batch), send)

    def publish_raw(self, payload: bytes, send: bool = True) -> int:
        """Buffer and send ``payload`` as the next seq, whatever it holds."""
        seq = self.seq
        self.seq += 1
        with self._lock:
            self.buffer.append((seq, payload))
        if send:
            self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        return seq

    def resend(self, seq: int) -> None:
        """Send an already buffered batch again (a duplicate on the wire)."""
        payload = dict(self.buffer)[seq]
        self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))

    def _serve_replay(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(20):
                continue
            frames = self.router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            self.replay_requests.append(start_seq)
            with self._lock:
                buffered = list(self.buffer)
            for seq, payload in buffered:
                if seq >= start_seq:
                    self.router.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            while self.endless_replay and not self._stop.wait(0.005):
                seq, payload = buffered[0]
                self.router.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self.router.send_multipart((client, b"", END_SEQ, b""))

    def close(self) -> None:
        if not hasattr(self, "_thread"):
            return
        self._stop.set()
        self._thread.join()
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()


def dp_publishers(n: int, topic: str = "kv-events", attempts: int = 50) -> list[VllmPublisher]:
    """Publishers for DP ranks 0..n-1 where vLLM puts them: rank r at the base port + r,
    its replay socket at the replay base port + r."""
    for _ in range(attempts):
        first = VllmPublisher(topic)
        base = int(first.endpoint.rsplit(":", 1)[1])
        rbase = int(first.replay_endpoint.rsplit(":", 1)[1])
        pubs = [first]
        try:
            for r in range(1, n):
                pubs.append(VllmPublisher(topic, port=base + r, replay_port=rbase + r))
            return pubs
        except zmq.ZMQError:  # a neighbouring port is taken: try other bases
            for p in pubs:
                p.close()
    raise RuntimeError(f"no {n} consecutive free port pairs found")
