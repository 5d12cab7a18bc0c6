"""Hand-built event batches (real event objects) and store helpers for the instrument tests."""

from __future__ import annotations

import hashlib
from pathlib import Path

import duckdb

from kvtrace.cache.events import (
    COPY_PARTIAL_HIT,
    EVICT_LRU,
    PUBLISH_FULL,
    BlockCopied,
    BlockEvicted,
    BlockPublished,
    BlocksFreed,
    CacheEvent,
    PrefixLookup,
    StaleHashLeft,
)
from kvtrace.engine.events import (
    DivergentOutput,
    EngineEvent,
    RequestFinished,
    StaleHashFound,
    StepBatch,
    StepExecuted,
)


def h(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(4, "big")).digest()


def one_of_each_step(step: int = 3, start_ns: int = 1_000, end_ns: int = 2_200) -> StepBatch:
    """One step holding one event of every kind, in this order (6 cache, 3 engine)."""
    cache: list[CacheEvent] = [
        PrefixLookup(step, "r1", 100, 64, (64, 48), 48, 16, h(1), h(5), 4),
        BlockEvicted(step, 0, EVICT_LRU, (5, 6), (h(50), h(60)), (10, 11), (2, 3), "r1"),
        BlockPublished(step, "r1", 0, PUBLISH_FULL, (1, 2, 3), (h(1), h(2), h(3)), 48),
        BlockCopied(step, "r1", 1, 4, 9, COPY_PARTIAL_HIT),
        BlocksFreed(step, "r0", 0, (7, 8)),
        StaleHashLeft(step, "r1", 1, 9, h(9), 32),
    ]
    engine: list[EngineEvent] = [
        StaleHashFound(step, start_ns + 800, 1, 9, h(9), 32, 123, 2**64 - 5, "r1"),
        DivergentOutput(step, start_ns + 900, "r1", 1, 42, 43),
        RequestFinished("r1", "sess", 100, 900, 1_500, 3_000, 100, 3, 64, 16, 20, 1, 1,
                        (700, 800), ((1_000, 1_500, 20),), num_external_query_tokens=36),  # (its 16 hits asked)
    ]
    return StepBatch(StepExecuted(step, start_ns, end_ns, 20, 1, 1, 0, 1, 0, (0.5, 0.25)), cache, engine)


def store_rows(path: str | Path, run_id: str, columns: str = "*") -> list[dict]:
    """All span rows of a run in append order, as dicts (run_id and seq dropped)."""
    con = duckdb.connect(str(path), read_only=True)
    try:
        cur = con.execute(f"SELECT {columns} FROM spans WHERE run_id = ? ORDER BY seq", [run_id])
        names = [d[0] for d in cur.description]
        rows = [dict(zip(names, r)) for r in cur.fetchall()]
    finally:
        con.close()
    for r in rows:
        r.pop("run_id", None)
        r.pop("seq", None)
    return rows


def count_spans(path: str | Path, run_id: str) -> int:
    con = duckdb.connect(str(path), read_only=True)
    try:
        (count,) = con.execute("SELECT count(*) FROM spans WHERE run_id = ?", [run_id]).fetchall()[0]
        return count
    finally:
        con.close()


def post_otlp_json(url: str, doc: dict) -> tuple[int, str]:
    """POST an OTLP/JSON request: (200, body), or (the error status, the Status message)."""
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(doc).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())["message"]


def capture_batches(pub, pub_ep: str, replay_ep: str, sent: list, tmp_path: Path, **kwargs):
    """``capture_vllm`` of ``pub_ep`` (a thread; store ``s.duckdb`` and trace ``t.jsonl`` in
    ``tmp_path``; ``kwargs`` its other settings) while vLLM's own publisher ``pub`` sends the
    batches ``sent`` once the capture reached it; stopped once every batch is in, or none came
    for 2 s: the subscription can go live after the burst (ZMQ's slow joiner: PUB drops what
    it sends before), and no later batch tells of it; the stop asks the replay socket for it,
    as a capture stopped after a burst does. (It waited 60 s for them, then failed, under load.)
    Its stats; ``pub`` shut down."""
    import threading
    import time

    from kvtrace.instrument.vllm import capture_vllm

    caps: list = []
    done = threading.Event()
    result: dict = {}

    def capture() -> None:
        result["stats"] = capture_vllm(pub_ep, replay_ep, store_path=tmp_path / "s.duckdb",
                                       trace_out=tmp_path / "t.jsonl", should_stop=done.is_set,
                                       on_ready=caps.append, **kwargs)

    thread = threading.Thread(target=capture)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not caps or not caps[0].stats.connected:
            assert time.monotonic() < deadline, "the capture never reached the publisher"
            time.sleep(0.02)
        for batch in sent:
            pub.publish(batch)
        seen, since = -1, time.monotonic()
        while caps[0].stats.batches < len(sent) and time.monotonic() - since < 2:
            if caps[0].stats.batches != seen:
                seen, since = caps[0].stats.batches, time.monotonic()
            assert time.monotonic() < deadline, repr(caps[0].stats)
            time.sleep(0.02)
    finally:
        done.set()
        thread.join(60)
        pub.shutdown()
    return result["stats"]
