"""Live capture and collect, found by probing (round 21): each test names what it broke."""

from __future__ import annotations

import threading

import msgspec


def _batch(i: int) -> bytes:
    return msgspec.msgpack.encode([float(i + 1), [["BlockStored", [i + 1], None, [i] * 4, 4, None, "GPU"]], 0])


def test_a_replay_endpoint_that_never_answers_cannot_hang_the_capture_after_1000_gaps(tmp_path):
    """A --replay-endpoint nobody listens at (a typo) queued one unsent request per gap on
    the DEALER; the 1,001st gap's send blocked for good (ZMQ's default high-water mark),
    deaf to Ctrl-C, where each gap should be counted lost after the replay timeout."""
    from kvtrace.instrument.vllm.capture import VllmKVCapture

    cap = VllmKVCapture(f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay-nobody", replay_timeout_s=0.001)
    seqs = list(range(0, 2 * 1_100 + 1, 2))  # a gap before every message but the first
    done = threading.Event()

    def feed() -> None:
        for seq in seqs:
            cap.receive([b"kv", seq.to_bytes(8, "big"), _batch(seq)])
        done.set()

    t = threading.Thread(target=feed, daemon=True)  # (a hung send cannot be joined)
    t.start()
    assert done.wait(60), f"the capture hung after {cap.stats.gaps} gaps"
    cap.close()
    s = cap.stats
    assert (s.batches, s.gaps, s.lost, s.recovered) == (len(seqs), len(seqs) - 1, len(seqs) - 1, 0)
