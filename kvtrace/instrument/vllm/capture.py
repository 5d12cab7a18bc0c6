"""Live capture: subscribe to vLLM's KV-event publishers and record into the store.

``VllmKVCapture`` follows one publisher (one DP rank): it tracks the sequence, recovers a
gap through the replay socket (batches the server no longer holds are counted as lost),
turns batches into span rows (``VllmSpanRows``) and appends them to a store run on a
flush interval. ``run_captures`` polls several captures' SUB sockets in one loop;
``capture_vllm`` is the whole command: a run, one capture per DP rank, the summary and,
optionally, the reconstructed native trace.

Sequence rules (per publisher): a seq below the last one is a duplicate when its payload
is the one that seq carried (a re-send), else a restart of the publisher (its counter
starts again at 0): step numbers then continue past the earlier lifetime's, so they stay
unique within the run. A seq past a gap is a gap to recover, unless the replay socket
returns the last seq accepted with another payload: then the publisher restarted and its
new seq passed the old one unseen (a restart). A restart or a gap is taken
only once the next message follows it: when the next one follows the old sequence
instead, the message was a stray (a bad one), which must not re-store or lose batches;
unless it came at the last seq accepted, just after a reconnect or with the payload the
replay socket now holds there (a server restarted after its first batch, met at seq 0).
A batch that does not decode, is larger than MAX_MESSAGE_BYTES, or holds a value the
store cannot hold, is a bad message: counted, logged once per capture, and never able to
cost another batch. On first contact (and after a restart) the batches the publisher sent before the
first one seen (the slow-joiner loss of ZMQ PUB/SUB) are asked of the replay socket;
after first contact, a batch neither received nor returned by the replay socket is lost.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvtrace.errors import ConfigError, KVTraceError, check_option
from kvtrace.instrument.convert import UnstorableValue
from kvtrace.instrument.ids import SeededIdGenerator, check_id_seed
from kvtrace.instrument.vllm.endpoints import MAX_DURATION_S, capture_endpoints
from kvtrace.instrument.vllm.reconstruct import ChainTracer, native_trace, write_requests
from kvtrace.instrument.vllm.rows import ENDPOINT_KEY, VllmSpanRows
from kvtrace.instrument.vllm.wire import KVEventBatch, VllmWireError, decode_kv_batch, replay_frame
from kvtrace.names import count, shown_value
from kvtrace.process import sigterm_as_interrupt, stop_requested
from kvtrace.store.schema import SUMMARY_NOTHING_RECEIVED
from kvtrace.store.writer import Store

_log = logging.getLogger(__name__)
_RECENT = 4096  # payload fingerprints kept per capture, to tell a re-sent seq from a restart
# vLLM's publisher counts seq from 0, one a step; a seq past int64 (a step the store cannot
# hold) or a jump forward by more than MAX_SEQ_GAP (years of steps) is a bad message, not a
# gap: taken as one, every later batch would sit beyond int64 or be counted lost.
MAX_SEQ = (1 << 63) - 1
MAX_SEQ_GAP = 1 << 32
# A batch larger than this is a bad message, never decoded: a decoded batch costs ~60x its
# bytes, and a step's batch of vLLM's holds kilobytes (its token ids), so 16 MiB is far past
# any real one. (Not ZMQ's MAXMSGSIZE: past it, libzmq 4.3 drops the connection for good.)
MAX_MESSAGE_BYTES = 16 << 20
MAX_FIRST_SEQ = 1 << 62  # (a stray first message there still leaves 2^62 steps for the next lifetimes)
# A replay answer is read until its end marker, quiet for the replay timeout, or this many
# frames past those asked for: a replay socket that never stops answering cannot hold the
# capture past its --duration. vLLM answers with every batch it holds from the seq asked
# (its buffer_steps, 10,000 by default), not only those up to the gap's end: an answer cut
# short left its tail and end marker on the socket, and that stale end marker ended the next
# recovery before its batches came (counted lost, under load).
_REPLAY_SLACK_FRAMES = 10_001
# How long a stopping capture keeps receiving what is already queued on its sockets; what
# is still queued after that is taken off them undecoded and counted lost: the socket's
# whole queue (its RCVHWM at most, read at ~150k messages a second), or what DISCARD_S
# allows, whichever ends first. (DISCARD_S was 1 s, the whole bound: a backlog of 200k
# left 6,173 batches queued in no count, and the newest seq unseen.)
DRAIN_S = 5.0
DISCARD_S = 15.0
# How long the rest of a replay answer cut at the stop is read off undecoded (vLLM sends its
# whole answer at once; a replay socket that never ends its answer holds the stop no longer)
ANSWER_REST_S = 1.0


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
    # seqs before the first one received at first contact that the replay answer did not
    # bring (the publisher's buffer had dropped them, or the answer ran out of time): sent
    # before the capture joined, so not counted lost
    missed_before_contact: int = 0
    bad_messages: int = 0
    requests: int = 0  # reconstructed (when a trace is written)
    requests_cut: int = 0  # of those, cut to the prompt length kvtrace replays (``native_trace``)
    connected: int = 0  # 1 once the SUB socket reached its publisher (summed: ranks reached)

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

    @property
    def nothing_received(self) -> bool:
        return self.batches == 0 and self.bad_messages == 0 and self.duplicates == 0


# The least of the stop's replay timeout worth asking a rank's tail in (an answer takes a round trip)
_MIN_TAIL_WAIT_S = 0.05


class VllmKVCapture:
    """Subscribes to one vLLM KV event publisher and records what it sends.

    ``socket``: the SUB socket, for a caller's own poll loop (``run_captures``), which
    hands each message to ``receive``, each ``monitor`` event to ``on_monitor`` and calls
    ``flush`` when ``flush_due(now)``.
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *, store: Store | None = None,
                 run_id: str | None = None, topic: str = "", seed: int = 0, replay_timeout_s: float = 2.0,
                 tracer: ChainTracer | None = None, flush_interval_s: float = 0.5,
                 on_batch: Callable[[int, KVEventBatch], None] | None = None, dp_rank: int | None = None,
                 rcvhwm: int = 1_000_000):
        """``dp_rank``: the DP rank this endpoint serves (for batches that do not say).
        ``replay_timeout_s``: how long a replay answer may go quiet before the rest is
        counted lost. ``rcvhwm``: messages ZMQ queues here before the publisher drops.
        Raises ``ConfigError`` for an address ZMQ cannot connect to."""
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.store, self.run_id = store, run_id
        self.replay_timeout_s = replay_timeout_s
        self.flush_interval_s = flush_interval_s
        self.tracer = tracer
        self.on_batch = on_batch
        self.stats = CaptureStats(run_id=run_id)
        self.last_seq: int | None = None
        self._step_base = 0  # steps of the publisher's earlier lifetimes
        self._next_step = 0
        self._recent: OrderedDict[int, int] = OrderedDict()  # seq -> hash of its payload
        # a message whose seq went backwards (a restart if the next one follows it) or jumped
        # ahead (a gap if the next one follows it): a stray message if the next one follows
        # the old sequence instead. (seq, payload, monotonic time, jumped ahead, the SUB socket
        # connected again just before it)
        self._pending: tuple[int, bytes, float, bool, bool] | None = None
        # the SUB socket connected again since the last message: the publisher may have
        # restarted, and the next seq may be last + 1 by chance (its first batches dropped
        # before the reconnect), which only the replay socket can tell from the old sequence
        self._reconnected = False
        self._linked = False  # the SUB socket is connected to its publisher now (not since lost)
        self._rows = VllmSpanRows(SeededIdGenerator(seed), {"service.name": "vllm", ENDPOINT_KEY: endpoint}, dp_rank)
        self._ctx = zmq.Context()
        self.socket = self._ctx.socket(zmq.SUB)
        self.rcvhwm = rcvhwm
        self.socket.setsockopt(zmq.RCVHWM, rcvhwm)
        self.socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.socket.setsockopt(zmq.LINGER, 0)
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._replay: zmq.Socket | None = None
        self._connect(self.socket, endpoint, "--endpoint")
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._connect(self._replay, replay_endpoint, "--replay-endpoint")
        self._last_flush = time.monotonic()
        # when a replay answer must end, the stop being asked for (``run_captures`` sets it): None
        # while no stop was asked
        self._answer_until: Callable[[], float | None] = lambda: None

    def _connect(self, sock: zmq.Socket, address: str, option: str) -> None:
        if address.startswith("tcp://["):  # (ZMQ connects to an IPv6 address only when told: it waited forever)
            sock.setsockopt(zmq.IPV6, 1)
        try:
            sock.connect(address)
        except zmq.ZMQError as err:  # a malformed address, an unresolvable host
            self.close()
            raise ConfigError(option, address, str(err)) from None

    def close(self) -> None:
        """Flush what is pending and close the sockets (once: a second call does nothing)."""
        if self._ctx.closed:
            return
        self._settle_pending(force=True)
        self.flush()
        self.socket.disable_monitor()
        self.monitor.close(0)
        self.socket.close(0)
        if self._replay is not None:
            self._replay.close(0)
        self._ctx.term()

    # -- loop -------------------------------------------------------------------------------
    def run(self, duration: float | None = None, should_stop: Callable[[], bool] | None = None) -> CaptureStats:
        """Receive until ``duration`` seconds pass, ``should_stop()`` is true, or Ctrl-C."""
        run_captures([self], duration, should_stop)
        return self.stats

    def on_monitor(self) -> None:
        """Read the events waiting on ``monitor`` (the SUB socket reached its publisher), never
        waiting for one: ``receive`` reads them first, so a poll that found one may find none
        left (a blocking read there held the capture for good)."""
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._linked = False
            elif event["event"] == zmq.EVENT_CONNECTED:
                if self.stats.connected and self.last_seq is not None:
                    self._reconnected = True
                self.stats.connected, self._linked = 1, True

    def receive(self, frames: list[bytes]) -> None:
        """One multipart message from ``socket``: duplicates are dropped, and a seq that
        went backwards or jumped ahead is held until the next message says whether it
        began a new publisher lifetime (a restart) or followed a gap (recovered, or counted
        lost), or was a stray message (a bad one) because the old sequence goes on."""
        if len(frames) != 3 or len(frames[1]) != 8:
            got = f"{len(frames)} frames" if len(frames) != 3 else f"a {len(frames[1])}-byte seq"
            self._bad(None, f"expected [topic, seq, payload] frames with an 8-byte seq, got {got}")
            return
        _, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        self.on_monitor()  # (a reconnect is known before the message it brought)
        reconnected, self._reconnected = self._reconnected, False
        if seq > MAX_SEQ:
            self._bad(seq, "seq beyond 2^63-1 (vLLM counts steps from 0)")
            return
        if len(payload) > MAX_MESSAGE_BYTES:  # (its seq is then a gap, or lost)
            self._bad(seq, f"a batch of {len(payload):,} bytes (more than {MAX_MESSAGE_BYTES:,}): not decoded")
            return
        if self._pending is not None:  # the message after one whose seq went backwards or ahead
            (held, held_payload, _, ahead, rejoined), self._pending = self._pending, None
            last = self.last_seq
            if ahead and last is not None and last < seq < held:  # the old sequence goes on
                self._bad(held, f"seq {held} after {last}, then {seq}: a stray message, not a gap")
            elif ahead:
                self._jump(held, held_payload)
            elif last is not None and seq > last and not (held == last and self._restarted_at(held, rejoined)):
                # the old sequence goes on (a new lifetime whose first message came at the last seq
                # accepted, then went past it, is told apart by the reconnect or the replay socket:
                # taken as a stray, a server restarted after one batch lost its new first batch)
                self._bad(held, f"seq {held} after {last}, then {seq}: a stray message, not a restart")
            else:
                self._restart(held, held_payload)
        last = self.last_seq
        if last is not None and seq <= last:
            if self._recent.get(seq) == hash(payload):
                self.stats.duplicates += 1
            else:  # a restart, or a stray message: the next one tells
                self._pending = (seq, payload, time.monotonic(), False, reconnected)
            return
        if last is None and seq > 0:  # first contact: what the publisher sent before we joined
            if seq > MAX_FIRST_SEQ:  # (a stray there would leave no steps for a restart after it)
                self._bad(seq, f"seq {seq} on first contact: beyond 2^62 (vLLM counts steps from 0)")
                return
            self._recover(0, seq, lost_if_missing=False)
        elif last is not None and seq > last + 1:  # a gap, or a stray message: the next one tells
            self._pending = (seq, payload, time.monotonic(), True, reconnected)
            return
        elif reconnected and last is not None and self._replay is not None and \
                self._recover(seq, seq, lost_if_missing=True, check=last):
            # the publisher restarted and its new seq reached last + 1 unseen: its first
            # batches were lost with the old connection (stored as the old lifetime's next
            # step, they went missing, uncounted, and so did the restart)
            self._restart(seq, payload)
            return
        self._accept(seq, payload)

    def _jump(self, seq: int, payload: bytes) -> None:
        """A seq past a gap that the next message confirmed: the gap is recovered (what the
        replay socket does not return is lost), then the message is accepted. When the
        replay socket holds the last seq accepted with another payload, the publisher
        restarted while the capture missed its first batches (the new lifetime's seq already
        past the old one's): a restart, its earlier batches recovered from 0."""
        last = self.last_seq
        assert last is not None  # (a jump is ahead of a seq already seen)
        if seq - last > MAX_SEQ_GAP:
            self._bad(seq, f"seq {seq} jumps {seq - last:,} past {last} (more than {MAX_SEQ_GAP:,})")
            return
        if self._recover(last + 1, seq, lost_if_missing=True, check=last):
            self._restart(seq, payload)
            return
        self._accept(seq, payload)

    def _restarted_at(self, seq: int, rejoined: bool) -> bool:
        """Whether another payload at ``seq``, the last seq accepted, came from a restarted
        publisher: one the SUB socket connected to again just before it, or one whose replay
        socket now holds another payload at ``seq`` than the one accepted (a stray message
        leaves the publisher's buffer as it was)."""
        if rejoined:
            return True
        return self._replay is not None and self._recover(seq, seq, lost_if_missing=True, check=seq)

    def _restart(self, seq: int, payload: bytes) -> None:
        """A new publisher lifetime, its counter started again at ``seq``'s run: its steps
        follow the earlier lifetimes'. A lifetime cannot begin more than MAX_SEQ_GAP steps in
        (vLLM counts from 0): such a message is a bad one, never 2^32 batches counted lost."""
        if seq > MAX_SEQ_GAP:
            self._bad(seq, f"seq {seq} after a restart: more than {MAX_SEQ_GAP:,} steps into a new lifetime")
            return
        if self._next_step + MAX_SEQ_GAP > MAX_SEQ:  # (the earlier lifetimes' steps leave no room)
            self._bad(seq, f"seq {seq} after a restart: its steps would pass 2^63-1")
            return
        self.stats.restarts += 1
        self._step_base, self.last_seq = self._next_step, None
        self._recent.clear()
        if seq > 0:
            self._recover(0, seq, lost_if_missing=True)
        self._accept(seq, payload)

    def recover_unseen(self, tail: bool = True, budget_s: float | None = None) -> None:
        """At the stop: what the publisher's buffer holds past the last batch received,
        asked of the replay socket. A burst sent while the subscription was not yet live
        (ZMQ's slow joiner) is dropped by PUB, and no later message told of it: the capture
        said "the server published no KV events" of a server that had sent 50. So is a last
        batch that PUB dropped (its high-water mark) with none after it: the summary said
        nothing lost of a batch the replay socket held. ``tail``: also ask past the last
        batch received (False when batches queued at the stop were taken off undecoded,
        for time: they are counted lost, and asked for again they were decoded after all).
        When the answer holds the last seq received with other contents, the publisher
        restarted unseen: a restart, its new lifetime's batches asked for from 0. What an answer
        held but did not bring in time (cut at the stop, its rest read off undecoded for its seqs)
        is counted: lost of the tail, missed before contact of an answer from 0. The tail is
        asked only of a publisher still connected, and within ``budget_s`` (what the stop
        leaves it of one replay timeout for every rank: a server gone, or a replay socket that
        never answers, held the stop 2 s a DP rank)."""
        self.on_monitor()
        if self._replay is None or not self.stats.connected or self._pending is not None:
            return
        if self.last_seq is None:
            self._recover(0, None, lost_if_missing=False)
        elif tail and self._linked and (budget_s is None or budget_s >= _MIN_TAIL_WAIT_S) and \
                self._recover(self.last_seq + 1, None, lost_if_missing=True, check=self.last_seq, wait_s=budget_s):
            self.stats.restarts += 1
            self._step_base, self.last_seq = self._next_step, None
            self._recent.clear()
            self._recover(0, None, lost_if_missing=False)

    @property
    def held(self) -> int:
        """Messages received but not yet counted: a seq that went backwards or ahead, waiting
        for the next one."""
        return 0 if self._pending is None else 1

    def lost_with_discarded(self, count: int, newest: int | None) -> int:
        """Batches lost when ``count`` messages, the newest at seq ``newest``, are taken off
        the socket undecoded at the stop: every seq after the last one accepted up to the
        newest (those between were never received either: the summary said 29 lost where
        53 were), or the count where the seqs say nothing sure (none, a restart, a stray)."""
        last = self.last_seq
        if newest is not None and last is not None and 0 < newest - last <= MAX_SEQ_GAP:
            return max(count, newest - last)
        return count

    def _settle_pending(self, force: bool = False) -> None:
        """A held message that no other followed within a flush interval (or by the end):
        the publisher went quiet after a restart or a gap; the message is taken as such."""
        if self._pending is not None and (force or time.monotonic() - self._pending[2] >= self.flush_interval_s):
            (seq, payload, _, ahead, _), self._pending = self._pending, None
            if ahead:
                self._jump(seq, payload)
            else:
                self._restart(seq, payload)

    def _bad(self, seq: int | None, why: str) -> None:
        self.stats.bad_messages += 1
        if self.stats.bad_messages == 1:
            at = "" if seq is None else f" (seq {seq})"
            _log.warning("kvtrace capture %s: bad message%s: %s; later ones are counted, not logged",
                         self.endpoint, at, why)

    def _accept(self, seq: int, payload: bytes) -> bool:
        """Record one batch; False (a bad message, counted) when it cannot be."""
        self.last_seq = seq
        self._recent[seq] = hash(payload)
        if len(self._recent) > _RECENT:
            self._recent.popitem(last=False)
        step = self._step_base + seq
        self._next_step = max(self._next_step, step + 1)
        try:
            batch, unknown = decode_kv_batch(payload)
            self._rows.add(step, batch)
        except (VllmWireError, UnstorableValue) as err:
            self._bad(seq, str(err))
            return False
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        self.stats.unknown_events += unknown
        if self.tracer is not None:
            t = round(batch.ts * 1e9)
            for ev in batch.events:
                self.tracer.add(t, ev)
        if self.on_batch is not None:
            self.on_batch(seq, batch)
        return True

    def _recover(self, first: int, upto: int | None, lost_if_missing: bool, check: int | None = None,
                 wait_s: float | None = None) -> bool:
        """Fetch batches [first, upto) from the replay socket. One that is not returned, or
        does not decode, is lost when ``lost_if_missing`` (a gap after first contact).
        ``upto`` None: whatever the publisher holds from ``first`` (up to MAX_FIRST_SEQ and
        one answer's slack of frames), none counted missing, since their number is unknown.

        ``check``: a seq accepted before ``first``, asked for too (vLLM answers from the seq
        asked, in order). Returned with a payload other than the one accepted, it shows a
        restarted publisher: nothing of the answer is accepted (it is read to its end, whose
        marker would end the next answer early) and True is returned.

        Batches are accepted as they come in seq order (vLLM answers in order) and stored when
        a flush is due: first contact's answer is the publisher's whole buffer (thousands of
        batches, seconds to read), which a kill lost whole when it was stored only at its end.
        One that comes out of order is accepted after the rest. The answer has four replay
        timeouts of the capture's waiting and receiving, not counting its own decoding and
        storing of the batches; ``wait_s``, when given, bounds the whole answer instead."""
        known = upto is not None
        upto = MAX_FIRST_SEQ + 1 if upto is None else upto
        late: dict[int, bytes] = {}
        accepted: set[int] = set()
        recovered, after = 0, first  # ``after``: the seq an in-order batch is at least
        restarted = False
        # past the newest seq of [first, upto) the answer held (``upto`` unknown: what it brought,
        # and what a cut answer still held, tell how many the publisher sent); whether it ended
        reach, ended, cut = first, False, False
        if self._replay is not None:
            while self._replay.poll(0):  # late answers to an earlier, timed-out request
                self._replay.recv_multipart()
            start = first if check is None else check
            try:
                # (never blocking: a replay socket that never connected, an address nobody listens at,
                # queues each request unsent, and past ZMQ's high-water mark, 1,000 gaps on, a blocking
                # send waited for good, deaf to Ctrl-C; nothing is asked then, and no answer awaited)
                self._replay.send_multipart([b"", start.to_bytes(8, "big")], flags=zmq.NOBLOCK)
                frames_left = (upto - start) + _REPLAY_SLACK_FRAMES
            except zmq.Again:
                frames_left = 0
            quiet_s = self.replay_timeout_s if wait_s is None else min(self.replay_timeout_s, wait_s)
            timeout_ms = max(1, int(quiet_s * 1000))
            deadline = time.monotonic() + (self.replay_timeout_s * 4 if wait_s is None else wait_s)
            # until the end marker, quiet for the timeout, too many frames or too long; or, once a
            # stop is asked for, DRAIN_S after it (the stop's tail has its own ``wait_s``): read whole,
            # first contact's answer of vLLM's 10,000 batches held Ctrl-C and --duration 2 for 35 s
            quiet = False  # (the socket said nothing for the timeout: no answer cut, whatever the time)
            while frames_left > 0 and time.monotonic() < deadline:
                if not self._replay.poll(timeout_ms):
                    quiet = True
                    break
                until = self._answer_until() if wait_s is None else None
                if until is not None and time.monotonic() >= until:
                    cut = True
                    break
                frames_left -= 1
                decoded, frame = self._replay_message()
                if not decoded:
                    continue
                if frame is None:
                    ended = True
                    break
                s, payload = frame
                if restarted:  # (the rest of the answer, read away)
                    continue
                if s == check:
                    restarted = not accepted and not late and self._recent.get(s) != hash(payload)
                    continue
                if first <= s < upto:
                    reach = max(reach, s + 1)
                if not (first <= s < upto and len(payload) <= MAX_MESSAGE_BYTES):  # (a larger one is lost)
                    continue
                if s >= after:
                    began = time.monotonic()
                    ok = self._accept(s, payload)
                    recovered += ok
                    self.stats.recovered += ok  # (counted as stored: a forced stop mid-answer keeps the count)
                    accepted.add(s)
                    after = s + 1
                    if self.flush_due(began):
                        self._store_rows()
                    # the capture's own decoding and storing does not count against the answer's
                    # time: counted, it cut a first contact's answer of 10,000 eight-event batches
                    # after 8 s (2,000 batches never stored, none counted lost)
                    deadline += time.monotonic() - began
                elif s not in accepted:
                    late[s] = payload
            # (not an answer gone quiet: at the stop its quiet time is the whole budget, and a replay
            # socket that never answered was read off for ANSWER_REST_S more, "an answer cut at the stop")
            cut = cut or (not ended and not quiet and time.monotonic() >= deadline)
            if not known and cut and not restarted and frames_left > 0:
                # cut short (a stop, its time): the seqs of the rest, taken off undecoded, say how
                # many it did not bring; counted nowhere, a stop at first contact left 5,790 of
                # vLLM's 10,000 buffered batches out of every count
                reach, restarted = self._read_rest(first, check, reach, not accepted and not late, timeout_ms)
        if restarted:
            return True
        for s in sorted(late):
            ok = self._accept(s, late[s])
            recovered += ok
            self.stats.recovered += ok
        if not known:  # (whatever the answer held, up to its newest seq, that was not stored)
            missing = (reach - first) - recovered
            if lost_if_missing:
                self.stats.gaps += missing > 0
                self.stats.lost += missing
            else:
                self.stats.missed_before_contact += missing
        elif lost_if_missing:
            if upto > first:  # (an empty range only checked ``check``: no gap)
                self.stats.gaps += 1
            self.stats.lost += (upto - first) - recovered
        else:
            self.stats.missed_before_contact += (upto - first) - recovered
        return False

    def _replay_message(self) -> tuple[bool, tuple[int, bytes] | None]:
        """(decoded, frame) of the replay socket's next message: (True, None) for an answer's end
        marker; (False, None) for a message that does not decode, counted a bad one."""
        assert self._replay is not None
        try:
            return True, replay_frame(self._replay.recv_multipart())
        except VllmWireError as err:
            self._bad(None, str(err))
            return False, None

    def _read_rest(self, first: int, check: int | None, reach: int, unjudged: bool,
                   timeout_ms: int) -> tuple[int, bool]:
        """The rest of a replay answer cut short, read off the replay socket undecoded for up to
        ANSWER_REST_S (or until quiet for ``timeout_ms``): (past the newest seq at least ``first`` it
        held, whether it showed a restart: ``check`` with another payload, while ``unjudged``).
        vLLM sends its whole answer at once, so the rest is queued already; an answer that has
        not ended by then is logged (what it held past the newest seq read is in no count)."""
        assert self._replay is not None
        until = time.monotonic() + ANSWER_REST_S
        ended, taken = False, 0
        while (left := until - time.monotonic()) > 0 and self._replay.poll(max(1, min(timeout_ms, int(left * 1000)))):
            decoded, frame = self._replay_message()
            if not decoded:
                continue
            if frame is None:
                ended = True
                break
            s, payload = frame
            taken += 1
            if s == check:
                if unjudged and self._recent.get(s) != hash(payload):
                    return reach, True
            elif first <= s <= MAX_FIRST_SEQ:
                reach = max(reach, s + 1)
        if not ended:
            _log.warning("%s: a replay answer cut at the stop had not ended %.0f s later (%d more batches taken "
                         "off undecoded): any it held past seq %d are in no count", self.endpoint, ANSWER_REST_S, taken,
                         reach - 1)
        return reach, False

    def flush_due(self, now: float) -> bool:
        """True when ``flush_interval_s`` has passed since the last flush (``now``: monotonic)."""
        return now - self._last_flush >= self.flush_interval_s

    def flush(self) -> None:
        """Append the rows received since the last flush to the store and commit."""
        self._settle_pending()
        self._store_rows()

    def _store_rows(self) -> None:
        self._last_flush = time.monotonic()
        table = self._rows.take()
        self.stats.spans = self._rows.spans
        if table is not None and self.store is not None:
            self.store.append_spans(table, run_id=self.run_id)
            self.store.flush()


def run_captures(caps: list[VllmKVCapture], duration: float | None = None,
                 should_stop: Callable[[], bool] | None = None) -> None:
    """Receive on every capture's socket until ``duration`` seconds pass, ``should_stop()``
    is true, or Ctrl-C or SIGTERM (taken between batches, never halfway through one); then
    what is already queued on the sockets is received too (for up to ``DRAIN_S``; what is
    left then is counted lost), so the counts cover every batch that reached this process.
    A replay answer still being read when the stop comes is read for up to ``DRAIN_S`` more
    (what it has not brought then is counted lost, or missed before contact at first contact).
    Each capture flushes on its own interval and once at the end."""
    deadline = None if duration is None else time.monotonic() + duration
    stop_seen: list[float] = []

    def answer_until() -> float | None:
        """DRAIN_S after the stop was first seen (a replay answer read then ends there), else None."""
        if not stop_seen and (signalled.is_set() or (deadline is not None and time.monotonic() >= deadline)
                              or (should_stop is not None and should_stop())):
            stop_seen.append(time.monotonic())
        return stop_seen[0] + DRAIN_S if stop_seen else None

    for cap in caps:
        cap._answer_until = answer_until
    poller = zmq.Poller()
    for cap in caps:
        poller.register(cap.socket, zmq.POLLIN)
        poller.register(cap.monitor, zmq.POLLIN)
    by_socket = {cap.socket: cap for cap in caps}
    by_monitor = {cap.monitor: cap for cap in caps}
    with stop_requested() as signalled:
        while not signalled.is_set():
            if should_stop is not None and should_stop():
                break
            timeout = 100 if deadline is None else max(0, int(min(100.0, (deadline - time.monotonic()) * 1000)))
            for sock, _ in poller.poll(timeout):
                if sock in by_monitor:
                    by_monitor[sock].on_monitor()
                else:
                    by_socket[sock].receive(sock.recv_multipart())
            if deadline is not None and time.monotonic() >= deadline:
                break
            now = time.monotonic()
            for cap in caps:
                if cap.flush_due(now):
                    cap.flush()
        drain_until = time.monotonic() + DRAIN_S
        for cap in caps:
            while time.monotonic() < drain_until and cap.socket.poll(0):
                cap.receive(cap.socket.recv_multipart())
        discard_until = time.monotonic() + DISCARD_S
        discarded = set()
        for cap in caps:
            # (the queue holds rcvhwm messages at most: as many reads take all it held at the
            # stop, whatever a publisher still sending adds meanwhile)
            undrained, newest, most = 0, None, cap.rcvhwm or sys.maxsize  # (0: ZMQ's "no limit")
            while undrained < most and time.monotonic() < discard_until and cap.socket.poll(0):
                frames = cap.socket.recv_multipart()
                if len(frames) == 3:  # (a batch's frames: topic, seq, payload)
                    undrained += 1
                    if len(frames[1]) == 8:
                        seq = int.from_bytes(frames[1], "big")
                        newest = seq if newest is None else max(newest, seq)
            if undrained:
                discarded.add(cap)
                lost = cap.lost_with_discarded(undrained, newest)
                cap.stats.lost += lost
                _log.warning("%s: %d batches still queued %.0f s after the stop were not decoded: %d counted lost "
                             "(with the seqs between them)", cap.endpoint, undrained, DRAIN_S, lost)
            if undrained < most and cap.socket.poll(0):
                last = newest if newest is not None else cap.last_seq
                _log.warning("%s: batches were still queued %.0f s after the stop and %.0f s more: those past seq %s "
                             "are in no count", cap.endpoint, DRAIN_S, DISCARD_S, "?" if last is None else last)
        # one replay timeout for every rank's tail (the largest a capture was given), not one each
        tail_until = time.monotonic() + max(cap.replay_timeout_s for cap in caps)
        for cap in caps:
            cap.recover_unseen(tail=cap not in discarded, budget_s=tail_until - time.monotonic())
    for cap in caps:
        cap._answer_until = lambda: None  # (a message still held is settled at the close, its answer whole)
        cap.flush()


def _check_arguments(endpoint: object, replay_endpoint: object, topic: object, trace_out: object, run_name: object,
                     seed: object, replay_timeout_s: object, should_stop: object, on_ready: object) -> None:
    """An API caller's arguments the CLI's flags cannot give, refused before the run is made: each
    was a traceback once the store held a failed run for it (a topic of 5, should_stop=5), or
    was stored as its text (run_name=5 as '5', as 286320f found for replay)."""
    where = "capture_vllm"
    for name, value, optional in (("endpoint", endpoint, False), ("replay_endpoint", replay_endpoint, True),
                                  ("topic", topic, False), ("run_name", run_name, True)):
        if not (optional and value is None) and not isinstance(value, str):
            raise ConfigError(where, name, f"expected a string, got {shown_value(value)}")
    if trace_out is not None and not isinstance(trace_out, (str, os.PathLike)):
        raise ConfigError(where, "trace_out", f"expected a file's path, got {shown_value(trace_out)}")
    check_id_seed(seed, where)
    check_option("replay_timeout_s", replay_timeout_s, 0, MAX_DURATION_S)  # type: ignore[arg-type]
    for name, call in (("should_stop", should_stop), ("on_ready", on_ready)):
        if call is not None and not callable(call):
            raise ConfigError(where, name, f"expected a callable, got {shown_value(call)}")


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
    its summary holds the totals and, for several ranks, each rank's. A capture that
    received nothing says so in the summary (``nothing_received``, and ``connected``:
    how many publishers the SUB sockets reached at all) and in a warning.
    SIGTERM stops it as Ctrl-C does: flushed, summarised, finished.
    """
    _check_arguments(endpoint, replay_endpoint, topic, trace_out, run_name, seed, replay_timeout_s, should_stop,
                     on_ready)
    endpoints = capture_endpoints(endpoint, replay_endpoint, duration, dp_size)
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
            with sigterm_as_interrupt():
                run_captures(caps, duration, should_stop)
            # (within the try: a message held at the stop is settled here, its gap asked of the replay
            # socket for up to its timeout, and a second Ctrl-C then failed the run with the error
            # alone as its summary, every count gone)
            for cap in caps:
                cap.close()
            # (the trace's rebuild too: a second Ctrl-C there failed the run with the error alone)
            rebuilt = native_trace(tracers) if trace_out is not None and tracers else None
        except BaseException as exc:
            # (a second Ctrl-C, an error): the run failed, its counts kept beside the error, where
            # the store's own failure summary held the error alone (every count of what was stored gone)
            # (a store that fails here too leaves the stop or error the one told; the store's own
            # exit marks the run failed then)
            with contextlib.suppress(Exception):
                for cap in caps:
                    cap.close()
                counts = _summary_counts(CaptureStats.total([c.stats for c in caps], run_id), traced=False)
                store.finish_run(run_id, status="failed", summary={**counts, "error": f"{type(exc).__name__}: {exc}"})
            raise
        trace = None if rebuilt is None else rebuilt[:2]
        if rebuilt is not None and tracers:  # each rank's own (the summary's ranks said 0, their total N)
            for cap, tracer, cut in zip(caps, tracers, rebuilt[2]):
                cap.stats.requests, cap.stats.requests_cut = len(tracer.requests), cut
        stats = CaptureStats.total([c.stats for c in caps], run_id)
        unreached = [c.endpoint for c in caps if not c.stats.connected and c.stats.nothing_received]
        summary = _summary_counts(stats, traced=trace is not None)
        summary[SUMMARY_NOTHING_RECEIVED] = stats.nothing_received
        if dp_size > 1:
            summary["ranks"] = [{"endpoint": c.endpoint, **_summary_counts(c.stats, traced=trace is not None)}
                                for c in caps]
        store.finish_run(run_id, status="complete", summary=summary)
    if trace is not None and trace_out is not None:
        # after the run is finished: a trace that cannot be written (a full disk) is its own
        # error, where it marked the capture failed and dropped the run's summary, every count
        try:
            write_requests(trace_out, trace, source=f"vllm:{endpoint}")
        except KVTraceError as err:  # (the counts said too: the CLI's summary line is not reached)
            raise KVTraceError(f"{err} (the capture itself is stored: run {run_id}, {capture_counts(stats)})") \
                from None
    if stats.nothing_received:
        reached = (f"its SUB socket never reached {endpoint} (is vLLM running with "
                   "--kv-events-config '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\"}' there?)"
                   if not stats.connected else "connected, but the server published no KV events")
        _log.warning("kvtrace capture vllm: nothing received in run %s: %s", run_id, reached)
    elif unreached:  # (the closing line summed the ranks reached: a rank never reached went unsaid)
        _log.warning("kvtrace capture vllm: %d of %d DP ranks never reached, nothing received from them (%s): is "
                     "--dp-size %d the server's --data-parallel-size, and is every rank up?", len(unreached), dp_size,
                     ", ".join(unreached), dp_size)
    return stats


def _summary_counts(stats: CaptureStats, traced: bool) -> dict[str, Any]:
    """A capture's counts as its run's summary keeps them: ``requests`` (and ``requests_cut``) only
    when a trace was rebuilt (the runs table read the 0 of a capture without --trace-out as requests
    served: 0)."""
    counts: dict[str, Any] = stats.counts()
    if not traced:
        del counts["requests"], counts["requests_cut"]
    return counts


def capture_report(stats: CaptureStats) -> str:
    """The one-line account of a capture the CLI prints."""
    return "kvtrace capture vllm: " + capture_counts(stats)


def capture_counts(stats: CaptureStats) -> str:
    """A capture's counts, the nonzero ones beyond batches, events and spans."""
    parts = [count(stats.batches, "batch", "batches"), count(stats.events, "event"), count(stats.spans, "span")]
    # (each count its noun, singular at 1: "1 bad messages", "1 restarts" read before)
    for name, noun in (("recovered", None), ("lost", None), ("missed_before_contact", None),
                       ("duplicates", "duplicate"), ("restarts", "restart"), ("bad_messages", "bad message"),
                       ("unknown_events", "unknown event")):
        if n := getattr(stats, name):
            parts.append(count(n, noun) if noun else f"{n:,} {name.replace('_', ' ')}")
    if stats.nothing_received:
        parts.append("NOTHING RECEIVED")
    return ", ".join(parts)
