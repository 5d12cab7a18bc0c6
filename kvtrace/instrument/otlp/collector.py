"""The OTLP collector: ``POST /v1/traces`` (and, with ``grpc_port``, OTLP/gRPC) into the store.

Accepts ``application/x-protobuf`` (``ExportTraceServiceRequest``) and ``application/json``
(the OTLP JSON mapping), optionally ``Content-Encoding: gzip`` or ``deflate``; both go through the
decoders in ``kvtrace.instrument.otlp.decode``. The gRPC transport
(``kvtrace.instrument.otlp.grpc``, the SDKs' default protocol) is handed ``ingest``: the
same decoder, the same rows, the same runs. This is how a vLLM started with
``--otlp-traces-endpoint`` (or any OTel SDK) is recorded.

Safety: binds 127.0.0.1 by default; a body over ``max_body_bytes`` (before or after
gzip) is refused with 413; a malformed request gets 400 and is never partly stored
(a request is parsed whole before anything is appended); each accepted request is
committed before the response, so what was acknowledged survives a crash.

Runs: spans whose resource carries ``kvtrace.run.id`` go to that run (created with mode
``otlp`` if the store lacks it); all other spans go to one run created on first use.
A kvtrace export's times are shifted by the offset its resource names
(``kvtrace.run.time_offset_ns``): they are stored unshifted, virtual again; its
``kvtrace.run`` span finishes a run created here with the producer's status, digest,
summary and trace digest (what it replayed: ``diff`` pairs it with that trace's other runs).
Attributes with a typed column (``kvtrace.*``, ``gen_ai.usage.*_tokens``) land there;
everything else is kept in ``extra_attributes``.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import json
import logging
import socket
import sys
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pyarrow as pa
from google.rpc import status_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from kvtrace import __version__
from kvtrace.errors import KVTraceError
from kvtrace.instrument.convert import (
    RUN_ID_RESOURCE_KEY,
    SpanRowsBuilder,
    UnstorableValue,
    run_id_text,
    time_offset,
    unshift,
)
from kvtrace.instrument.otlp.decode import DecodedSpans, PayloadError, decode_json, decode_protobuf
from kvtrace.instrument.otlp.guard import ConnectionGuard
from kvtrace.instrument.otlp.limits import (
    BUFFERED_BODIES,
    DECODE_SLOTS,
    DEFAULT_MAX_BODY_BYTES,
    GRPC_GRACE_S,
    LATE_REFRESH_S,
    MAX_CONNECTIONS,
    MAX_GZIP_MEMBERS,
    MAX_SPANS_PER_REQUEST,
    MIN_BODY_BYTES_PER_S,
    MIN_BUFFERED_BYTES,
    READ_TIMEOUT_S,
    RECENT_SPANS,
    REPLY_GRACE_S,
    check_collector_options,
)
from kvtrace.metrics import SPANS_MISSING
from kvtrace.process import bracketed, is_ipv6, port_in_use, sigterm_as_interrupt, unbracketed
from kvtrace.store.clickhouse.run_rules import (
    RecordRefused,
    is_opening,
    run_record,
    sent_span_count,
    short_summary,
    summary_object,
)
from kvtrace.store.schema import (
    MAX_SENT_SEQ,
    RECORDED_RUNS_TABLE,
    RUN_RECORD_PREFIX,
    SEQ_ATTRIBUTE,
    SOURCE_OTLP,
    SPAN_RUN,
    TIME_OFFSET_RESOURCE_KEY,
    named_run_name,
    run_id_problem,
)
from kvtrace.store.writer import Store

TRACES_PATH = "/v1/traces"
# How often the HTTP server's loop looks for a stop (socketserver's default, 0.5 s, was the
# wait of every stop: Ctrl-C, SIGTERM, a test's collector).
SERVE_POLL_S = 0.05
_log = logging.getLogger(__name__)


# --- the collector ---------------------------------------------------------------------------
def _gunzip(body: bytes, limit: int) -> bytes:
    """Every member of a gzip body (RFC 1952: members concatenated are one stream, as
    ``gzip.decompress`` reads them), at most ``limit`` bytes (OverflowError past it); bytes
    after the last member that are no gzip member are a PayloadError, never ignored."""
    parts: list[bytes] = []
    size = 0
    rest = body
    while True:
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            out = d.decompress(rest, limit - size + 1)
        except zlib.error as err:
            raise PayloadError(f"bad gzip body (member {len(parts) + 1}): {err}") from None
        size += len(out)
        if size > limit or d.unconsumed_tail:
            raise OverflowError
        if not d.eof:
            raise PayloadError("truncated gzip body")
        parts.append(out)
        rest = d.unused_data
        if not rest:
            return b"".join(parts)
        if len(parts) == MAX_GZIP_MEMBERS:
            raise PayloadError(f"gzip body of more than {MAX_GZIP_MEMBERS} members")


def _inflate(body: bytes, limit: int) -> bytes:
    """A ``deflate`` body: the zlib format (RFC 9110's deflate, what the OTel SDK's
    exporters send), or a bare deflate stream as some clients send; at most ``limit``
    bytes (OverflowError past it); a cut body or bytes after its end are a PayloadError."""
    zlib_header = len(body) >= 2 and body[0] & 0x0F == 8 and int.from_bytes(body[:2], "big") % 31 == 0
    d = zlib.decompressobj(zlib.MAX_WBITS if zlib_header else -zlib.MAX_WBITS)
    try:
        out = d.decompress(body, limit + 1)
    except zlib.error as err:
        raise PayloadError(f"bad deflate body: {err}") from None
    if len(out) > limit or d.unconsumed_tail:
        raise OverflowError
    if not d.eof:
        raise PayloadError("truncated deflate body")
    if d.unused_data:
        raise PayloadError(f"{len(d.unused_data)} bytes after the end of the deflate body")
    return out


class _RecentSpans:
    """The ids (trace id, span id) of the spans stored last in each run, at most ``limit``
    in all, oldest forgotten first: a span sent again, as an exporter retries a request
    whose answer it never got, is told from a new one. (A span is its ids, in OTLP.)"""

    def __init__(self, limit: int):
        self._limit = limit
        self._by_run: dict[str, set[int]] = {}
        self._order: deque[tuple[str, int]] = deque()

    @staticmethod
    def key(trace_id: int, span_id: int) -> int:
        return trace_id << 64 | span_id

    def seen(self, run: str, key: int) -> bool:
        return key in self._by_run.get(run, ())

    def add(self, run: str, key: int) -> None:
        keys = self._by_run.setdefault(run, set())
        if key in keys:
            return
        keys.add(key)
        self._order.append((run, key))
        while len(self._order) > self._limit:
            old_run, old = self._order.popleft()
            old_keys = self._by_run[old_run]
            old_keys.discard(old)
            if not old_keys:
                del self._by_run[old_run]


class _HeldSeqs:
    """The seq numbers a named run holds, as sorted disjoint [start, end) ranges: a kvtrace
    sender's spans are numbered from 0 in its run (``kvtrace.seq``) and exported in
    contiguous chunks, so a run's numbers are a few ranges however many spans it holds."""

    def __init__(self, ranges: list[tuple[int, int]] | None = None):
        self._starts: list[int] = []
        self._ends: list[int] = []
        for start, end in sorted(ranges or ()):
            self.add_range(start, end)

    @property
    def end(self) -> int:
        """One past the largest number held (0 when none)."""
        return self._ends[-1] if self._ends else 0

    @property
    def count(self) -> int:
        """How many numbers are held."""
        return sum(end - start for start, end in zip(self._starts, self._ends))

    def count_below(self, count: int) -> int:
        """How many numbers from 0 to ``count`` - 1 are held."""
        return sum(min(end, count) - start for start, end in zip(self._starts, self._ends) if start < count)

    def covers(self, count: int) -> bool:
        """Whether every number from 0 to ``count`` - 1 is held (a sender's whole run)."""
        return count <= 0 or (bool(self._starts) and self._starts[0] == 0 and self._ends[0] >= count)

    def holds(self, seq: int) -> bool:
        i = bisect.bisect_right(self._starts, seq) - 1
        return i >= 0 and seq < self._ends[i]

    def add_range(self, start: int, end: int) -> None:
        i = bisect.bisect_left(self._ends, start)  # the first range that ends at or after start
        j = bisect.bisect_right(self._starts, end)  # past the last range that starts at or before end
        if i < j:
            start, end = min(start, self._starts[i]), max(end, self._ends[j - 1])
        self._starts[i:j], self._ends[i:j] = [start], [end]

    def add(self, numbers: list[int]) -> None:
        numbers = sorted(numbers)
        k = 0
        while k < len(numbers):  # (each run of consecutive numbers as one range)
            start = end = numbers[k]
            while k + 1 < len(numbers) and numbers[k + 1] <= end + 1:
                k += 1
                end = numbers[k]
            self.add_range(start, end + 1)
            k += 1


MAX_SEQ = MAX_SENT_SEQ  # a sender's kvtrace.seq at most: the store numbers on past it in int64


def _sent_seq(attributes: dict | None, where: str) -> int | None:
    """A span's ``kvtrace.seq`` (its place in its kvtrace run), None when it has none; read as the
    exporter's text of it, as the ClickHouse path reads it and both read a count (README: a whole
    number, "7" or 7.0): "5" and 5.0 were a 400 here and seq 5 there."""
    value = (attributes or {}).get(SEQ_ATTRIBUTE)
    if value is None:
        return None
    text = run_id_text(value)
    if text.isascii() and text.isdigit() and len(text) <= 19 and int(text) <= MAX_SEQ:
        return int(text)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEQ:
        raise PayloadError(f"{where}: {SEQ_ATTRIBUTE}: expected an integer from 0 to 2^62 - 1 (the span's place "
                           f"in its run), got {value!r}"[:300])
    return value


_BUSY = json.dumps({"code": 14, "message": "busy: as many connections open as it serves; retry"}).encode()


class _Server(ThreadingHTTPServer):
    """A thread per connection, at most ``guard``'s connections at once: one more is
    answered 503 (retryable for an OTLP exporter) without a thread."""

    daemon_threads = True
    # the listen backlog: socketserver's 5 let a burst of clients meet a reset before the
    # accept loop could answer them 503 (80 clients: 8 of 187 requests reset)
    request_queue_size = 1024

    def __init__(self, address, handler, guard: ConnectionGuard, on_refused: Callable[[], None]):
        self.guard, self.on_refused = guard, on_refused
        if is_ipv6(address[0]):  # (socketserver binds IPv4 only: "::1" was "Address family ... not supported")
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        if not self.guard.admit():
            self.on_refused()
            with contextlib.suppress(OSError):
                request.settimeout(0.1)
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                                % (len(_BUSY), _BUSY))
                request.shutdown(socket.SHUT_WR)
                # what the client already sent, read away briefly (at most 0.4 s of this
                # accepting thread): closed unread, it would reset the connection before the
                # client read the answer (a broken pipe)
                for _ in range(4):
                    if not request.recv(1 << 16):
                        break
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.guard.leave(request)

    def handle_error(self, request, client_address) -> None:
        """A connection that failed outside a request's own handling (the client reset
        it, say): one log line, not a traceback on the server's stderr."""
        _log.warning("OTLP/HTTP connection from %s:%s failed: %s", *client_address[:2], sys.exc_info()[1])


class OTLPCollector:
    """The receiver as an object: ``start()`` serves on a thread, ``stop()`` flushes and closes."""

    def __init__(self, store_path: str | Path, host: str = "127.0.0.1", port: int = 4318,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, run_name: str | None = None,
                 grpc_port: int | None = None, read_timeout_s: float = READ_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS, late_refresh_s: float = LATE_REFRESH_S):
        """``port``/``grpc_port`` 0: any free port; ``grpc_port`` None: no gRPC;
        ``read_timeout_s``: how long a client may take to send a request's head (and its
        body, plus its length at MIN_BODY_BYTES_PER_S); ``late_refresh_s``: how soon a
        finished run's derived tables take spans that came after its record. Raises
        KVTraceError when an address cannot be bound or an option is out of range."""
        check_collector_options(port, grpc_port, max_body_bytes, host)
        host = unbracketed(host)
        self.store_path = str(store_path)
        self.max_body_bytes = max_body_bytes
        self.read_timeout_s = read_timeout_s
        self.guard = ConnectionGuard(max_connections, max(BUFFERED_BODIES * max_body_bytes, MIN_BUFFERED_BYTES),
                                     watch_interval_s=min(1.0, read_timeout_s / 4))
        self.run_name = run_name
        self._lock = threading.Lock()
        self._closed = False  # (under _lock) the store is closed: a late request is refused, not stored
        self._default_run: str | None = None
        self._default_spans = 0  # spans stored in the default run (the collector's own: none before it)
        self._known_runs: set[str] = set()
        self._created_runs: list[str] = []
        # created runs a kvtrace export fills (its resource names a time offset): its producer
        # ends it with a kvtrace.run record, so one still without it at close was cut short
        self._awaiting_record: set[str] = set()
        # runs an earlier collector on this store made and left without a record (stopped, or
        # killed: incomplete), which their producer's record still finishes
        self._unrecorded_runs: set[str] = set()
        # runs an opening record (or a record's fields, before a restart) described already: a second
        # opening record, or one after the finishing record, changes nothing
        self._opened: set[str] = set()
        # runs whose record said complete while some of the spans its sender numbered (its summary's
        # ``spans``) had not come: finished incomplete, and complete once the rest come (a lost
        # export request read complete, its summary's counts beside a store short of them)
        # run id -> (spans its sender numbered, its sender's summary: what the run is finished with)
        self._short_runs: dict[str, tuple[int, dict]] = {}
        # runs given spans once finished: their derived tables rebuilt by a timer (_refresh_late)
        # soon after, and at close
        self._late_runs: dict[str, None] = {}  # (in the order they became late: one a turn, none starved)
        self._late_failed: set[str] = set()  # late runs whose rebuild failed: tried again at close only
        self._late_done = threading.Condition(self._lock)  # (notified when _late_runs empties)
        self._late_timer: threading.Timer | None = None
        self.late_refresh_s = late_refresh_s
        self._late_cost_s = 0.0  # how long the last rebuild of one late run took
        self._recent = _RecentSpans(RECENT_SPANS)
        self._looked_up: set[str] = set()  # named runs whose store state was read (see _look_up)
        self._held_seqs: dict[str, _HeldSeqs] = {}  # named runs: the seq numbers each holds (see _numbers)
        self._refused_writes_told: set[str] = set()  # (_tell_refused_write: each reason once)
        self._not_collected: dict[str, str] = {}  # named runs the store holds of another mode: run id -> mode
        self.spans_received = 0  # spans stored (a kvtrace.run record is no span: runs_recorded)
        self.duplicate_spans = 0  # spans already stored in their run, sent again: not stored twice
        self.runs_recorded = 0  # runs finished by their sender's kvtrace.run record
        self.requests_rejected = 0
        self.decode_slots = threading.BoundedSemaphore(DECODE_SLOTS)  # (both transports)
        self._replying = 0  # HTTP requests between their store and their reply (under _replies)
        self._replies = threading.Condition()
        # The ports are bound before the store is opened: a collect that cannot listen (a busy
        # port) left a new, empty store behind it.
        try:
            self._server = _Server((host, port), _make_handler(self), self.guard, self.count_rejected)
        except OSError as err:
            self.guard.close()
            hint = port_in_use("--port") if err.errno == errno.EADDRINUSE else ""
            raise KVTraceError(f"cannot listen on {bracketed(host)}:{port} (OTLP/HTTP): {err.strerror or err}{hint}"
                               ) from None
        self._thread: threading.Thread | None = None
        self._grpc = None
        self.grpc_port: int | None = None
        try:
            if grpc_port is not None:
                from kvtrace.instrument.otlp.grpc import grpc_server  # grpcio is loaded only when served

                try:
                    self._grpc, self.grpc_port = grpc_server(
                        self.ingest, host, grpc_port, max_body_bytes, on_reject=self.count_rejected,
                        read_timeout_s=read_timeout_s, decode_slots=self.decode_slots, deadlines=self.guard.deadlines)
                except OSError as err:
                    raise KVTraceError(str(err)) from None
            self.store = Store.open(self.store_path)  # (a store it could not make or open: none left behind)
            self._queue_unrebuilt_runs()
        except BaseException:
            if self._grpc is not None:
                self._closed = True  # (a call in the moment it serves is refused, never stored)
                self._grpc.start()  # (a gRPC server never started keeps its port bound for good)
                self._grpc.stop(grace=None)
            self._server.server_close()
            self.guard.close()
            raise

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{bracketed(host)}:{port}{TRACES_PATH}"

    @property
    def grpc_target(self) -> str | None:
        """``host:port`` of the OTLP/gRPC endpoint (``[::1]:port`` for an IPv6 address), or
        None when not served."""
        return None if self.grpc_port is None else f"{bracketed(self.address[0])}:{self.grpc_port}"

    def start(self) -> OTLPCollector:
        if self._grpc is not None:
            self._grpc.start()
        self._thread = threading.Thread(target=self._server.serve_forever, args=(SERVE_POLL_S,), name="kvtrace-otlp",
                                        daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        if self._grpc is not None:
            self._grpc.start()
        self._server.serve_forever(SERVE_POLL_S)

    def _close_servers(self) -> None:
        if self._grpc is not None:
            # new exports are refused at once; one in flight has GRPC_GRACE_S to finish, then is
            # cancelled (its handler, still running, finds the store closed: nothing stored)
            self._grpc.stop(grace=GRPC_GRACE_S)
        self._server.server_close()
        self.guard.close()

    def stop(self) -> None:
        self._server.shutdown()
        self._close_servers()
        if self._thread is not None:
            self._thread.join()
        self.close_store()

    @contextlib.contextmanager
    def replying(self) -> Iterator[None]:
        """Around an HTTP request's store and its reply: ``close_store`` waits for these, so
        a request stored as the collector stops is answered before the process ends (its
        handler threads are daemons: an exporter saw a reply cut short and sent the stored
        spans again)."""
        with self._replies:
            self._replying += 1
        try:
            yield
        finally:
            with self._replies:
                self._replying -= 1
                self._replies.notify_all()

    def close_store(self) -> None:
        """Commit, mark the runs this collector created complete (a kvtrace export's without
        its record: incomplete), and close the store."""
        with self._lock:
            self._closed = True
            timer, self._late_timer = self._late_timer, None
            if timer is not None:
                timer.cancel()
            try:
                for run_id in self._created_runs:
                    # (a killed replay's export was marked complete, its spans a part of the run)
                    self._finish(run_id, status="incomplete" if run_id in self._awaiting_record else "complete")
                self._created_runs = []
                self._late_runs.update(dict.fromkeys(sorted(self._late_failed)))
                self._late_runs = {run_id: None for run_id in self._late_runs if not self._refresh(run_id)}
                self._late_done.notify_all()
            finally:
                self.store.close()
        if timer is not None:  # (ended: cancelled, or it found the collector closed; no thread left behind)
            timer.join()
        # requests stored before: answered (those after it find the store closed: a quick 503)
        with self._replies:
            self._replies.wait_for(lambda: self._replying == 0, timeout=REPLY_GRACE_S)

    # -- ingest ------------------------------------------------------------------------------
    def count_rejected(self) -> None:
        """Count a refused request (either transport)."""
        with self._lock:
            self.requests_rejected += 1

    def ingest(self, spans: DecodedSpans, wanted: Callable[[], bool] | None = None) -> int:
        """``_ingest``; a store that refuses the request (its reads or its commit: a full disk,
        another process holding the file) is also told on stderr, once per reason."""
        try:
            return self._ingest(spans, wanted)
        except (PayloadError, CollectorClosed, ExportAbandoned):
            raise
        except KVTraceError as err:
            self._tell_refused_write(err)
            raise

    def _ingest(self, spans: DecodedSpans, wanted: Callable[[], bool] | None = None) -> int:
        """Append decoded spans (grouped by run) and commit; returns the count stored.

        All or nothing: a value the store cannot hold is a PayloadError naming the span
        (nothing of the request is appended), and a commit that fails (KVTraceError, the
        store busy) leaves nothing of it buffered for the next request to commit.
        ``wanted``: whether the sender still waits for the answer (a gRPC call not
        cancelled, its deadline not passed), asked just before the commit: an export its
        client gave up on is not stored, since the exporter sends it again. A request that
        comes after ``close_store`` is a CollectorClosed, nothing stored.
        A span its run already holds (the same trace and span id among the RECENT_SPANS
        stored last, or in the request) is not stored again: a retried export."""
        # by the run id its resource names ("": the collector's own run), made only once the
        # whole request is found storable: a refused request leaves no run behind either
        by_run: dict[str, SpanRowsBuilder] = {}
        sent: dict[str, list[int | None]] = {}  # named runs: each stored span's kvtrace.seq (None: it sent none)
        numbered: dict[tuple[str, int], str] = {}  # (run key, kvtrace.seq) -> where in the request
        records: list[tuple[str, dict]] = []
        record_order: list[tuple[int, int, int]] = []  # each record's (start, trace id, span id)
        fresh: list[tuple[str, int]] = []  # (run key, span key) of the spans to store
        taken: set[tuple[str, int]] = set()
        exports: set[str] = set()  # runs of kvtrace exports among them (see _awaiting_record)
        with self._lock:
            if self._closed:
                raise CollectorClosed("kvtrace collect is shutting down: not stored (send it again to a running "
                                      "collector)")
            try:
                stored_at = self._stored_at_held_seqs(spans)
                for resource, kwargs, where in spans:
                    key = _named_run(resource, where)
                    if kwargs["name"] == SPAN_RUN:  # a kvtrace export's run record, not a span
                        if not key:  # (it finished the collector's own run, of every sender's spans)
                            raise PayloadError(f"{where}: a {SPAN_RUN} record whose resource names no "
                                               f"{RUN_ID_RESOURCE_KEY}: it finishes no run")
                        self._check_collected(key, where)
                        try:
                            records.append((key, run_record(as_exported(kwargs["attributes"]))))
                            record_order.append((kwargs["start_ns"], kwargs["trace_id"], kwargs["span_id"]))
                            if is_opening(records[-1][1]):  # (a run of it alone is cut short at the close)
                                exports.add(key)
                        except RecordRefused as err:
                            raise PayloadError(f"{where}: {err}") from None
                        continue
                    seq = None
                    if key:
                        self._check_collected(key, where)
                        if TIME_OFFSET_RESOURCE_KEY in resource:
                            exports.add(key)
                        seq = _sent_seq(kwargs["attributes"], where)
                    span_key = _RecentSpans.key(kwargs["trace_id"], kwargs["span_id"])
                    if self._recent.seen(key, span_key) or (key, span_key) in taken:
                        continue
                    if seq is not None:
                        if self._held(key).holds(seq):
                            if stored_at.get((key, seq)) == span_key:  # sent again, past the recent window
                                continue
                            raise PayloadError(f"{where}: {SEQ_ATTRIBUTE}: run {key} holds another span numbered "
                                               f"{seq} already (a span sent again keeps its trace and span ids)")
                        if (key, seq) in numbered:
                            raise PayloadError(f"{where}: {SEQ_ATTRIBUTE}: {seq} is {numbered[key, seq]}'s too; "
                                               "a run numbers each span once")
                        numbered[key, seq] = where
                    taken.add((key, span_key))
                    fresh.append((key, span_key))
                    rows = by_run.get(key)
                    if rows is None:
                        # a kvtrace run (named) keeps the resource its direct write keeps, not the SDK's
                        # self-description or its random service.instance.id: two collections of one
                        # replay differed there, as the ClickHouse path's did not
                        rows = by_run[key] = SpanRowsBuilder(full_resource=not key)
                    try:
                        rows.add(default_source=SOURCE_OTLP, **unshift(kwargs, time_offset(resource)))
                    except UnstorableValue as err:
                        raise PayloadError(f"{where}: {err}") from None
                    if key:
                        sent.setdefault(key, []).append(seq)
                tables: list[tuple[str, pa.Table, list[int] | None]] = [
                    (r, b.to_table(), self._numbers(r, sent[r]) if r else None) for r, b in by_run.items()]
            except UnstorableValue as err:
                raise PayloadError(str(err)) from None
            for key, _ in records:  # (before anything is stored: the request is refused whole)
                if key and key == self._default_run:
                    raise PayloadError(f"resource {RUN_ID_RESOURCE_KEY}: {key} is this collector's own run (of the "
                                       f"spans that name none), which a {SPAN_RUN} record does not finish")
            if wanted is not None and not wanted():
                raise ExportAbandoned("the client cancelled the export or its deadline passed: not stored")
            made = len(self._created_runs)
            try:
                late = []
                for key, table, numbers in tables:
                    run_id = self._run_for(key)
                    # a named run's spans at the seq its sender gave them (kvtrace.seq), so requests a
                    # forwarding collector reordered store the run its direct write stores; others
                    # numbered on from its last (the collector's own run: by arrival)
                    self.store.append_spans(table, run_id=run_id,
                                            seq=None if numbers is None else pa.array(numbers, pa.int64()))
                    if run_id not in self._created_runs:  # finished, by a record or before this collector
                        late.append(run_id)
                self.store.flush()
            except BaseException:
                self.store.discard_buffer()
                self._take_back_runs(made)
                raise
            # (a run record is no span: counted apart, where "2,432 spans stored" stood beside a run of 2,431)
            self.spans_received += len(fresh)
            self._default_spans += sum(1 for key, _ in fresh if not key)
            self.duplicate_spans += len(spans) - len(records) - len(fresh)
            for key, span_key in fresh:
                self._recent.add(key, span_key)
            for key, _, numbers in tables:
                if numbers is not None:
                    self._held(key).add(numbers)
            self._late_runs.update(dict.fromkeys(sorted(late)))
            self._late_failed.difference_update(late)  # (spans again: worth another try)
            if self._late_runs:
                self._schedule_late(self.late_refresh_s)
            self._awaiting_record.update(exports)
            # (after the commit: a failure here is logged, the spans stay). Two records of a run in one
            # request: the earlier one (its start, then its ids) finishes it, as the ClickHouse path,
            # which has no arrival order, takes the first by time (the one sent first was taken here)
            ordered = [records[i] for i in sorted(range(len(records)), key=record_order.__getitem__)]
            for key, record in ordered:
                if is_opening(record):
                    self._open_recorded(self._run_for(key), record)
                else:
                    self.runs_recorded += self._finish_recorded(self._run_for(key), record)
        return len(fresh)

    def _tell_refused_write(self, err: KVTraceError) -> None:
        """A request the store refused (its disk full, the file held or removed) is answered
        503, which an exporter retries for ever; said once per reason on the collector's
        stderr, where it was counted among the requests rejected and told nowhere."""
        reason = str(err)
        with self._lock:
            told = reason in self._refused_writes_told or len(self._refused_writes_told) >= 64
            if not told:
                self._refused_writes_told.add(reason)
        if not told:
            _log.warning("a request's spans were not stored (answered 503: its sender sends them again): %s", reason)

    def _held(self, run_key: str) -> _HeldSeqs:
        """(under _lock) The seq numbers a named run holds (read from the store by ``_look_up``)."""
        held = self._held_seqs.get(run_key)
        if held is None:
            held = self._held_seqs[run_key] = _HeldSeqs()
        return held

    def _numbers(self, run_key: str, sent: list[int | None]) -> list[int]:
        """(under _lock) The seq of each span of a named run in a request: the one its sender
        gave (kvtrace.seq), else the next past every number the run holds, from 2^62 up: past
        every number a sender may give (MAX_SEQ), so none it sends later is found taken (a
        span without one took 2, and the sender's next chunk, 2 and 3, was refused)."""
        following = max(self._held(run_key).end, MAX_SEQ + 1)
        out = []
        for s in sent:
            if s is None:
                s, following = following, following + 1
            out.append(s)
        return out

    def _stored_at_held_seqs(self, spans: DecodedSpans) -> dict[tuple[str, int], int]:
        """(under _lock) (run key, seq) -> the span key (trace and span id) stored at that seq,
        for each span of the request whose kvtrace.seq its named run holds already: a span
        sent again past the RECENT_SPANS window (skipped as a duplicate), or another span
        given a number that is taken (refused). Errors are left to ``ingest``'s own pass."""
        clashes: dict[str, set[int]] = {}
        for resource, kwargs, where in spans:
            try:
                key = _named_run(resource, where) if kwargs["name"] != SPAN_RUN else ""
                if not key:
                    continue
                self._check_collected(key, where)
                seq = _sent_seq(kwargs["attributes"], where)
            except PayloadError:
                continue
            if self._recent.seen(key, _RecentSpans.key(kwargs["trace_id"], kwargs["span_id"])):
                continue  # (a duplicate the recent window tells: no look-up)
            if seq is not None and self._held(key).holds(seq):
                clashes.setdefault(key, set()).add(seq)
        if not clashes:
            return {}
        from kvtrace.store.read._sql import connect, query

        found: dict[tuple[str, int], int] = {}
        self.store.release()
        with connect(self.store_path) as con:
            for key, seqs in clashes.items():
                rows = query(con, "SELECT seq, trace_id, span_id FROM spans WHERE run_id = $run_id "
                                  "AND seq BETWEEN $lo AND $hi", {"run_id": key, "lo": min(seqs), "hi": max(seqs)})
                found.update(((key, seq), _RecentSpans.key(int(t, 16), int(sp, 16)))
                             for seq, t, sp in rows.rows() if seq in seqs and t and sp)
        return found

    def _queue_unrebuilt_runs(self) -> None:
        """Queue for the late rebuild the finished collected runs of this store whose derived
        tables count fewer spans than they hold: a collector killed between storing a finished
        run's late spans and rebuilding its tables left its counts short for good (``runs``
        said 0 spans of a complete run holding 3)."""
        from kvtrace.store.read._sql import connect, query  # (polars: loaded only here and in _look_up)

        finished = "SELECT run_id FROM runs WHERE mode = 'otlp' AND status <> 'running'"
        self.store.release()
        with connect(self.store_path) as con:
            held = query(con, f"SELECT run_id, count(*) AS n FROM spans WHERE run_id IN ({finished}) GROUP BY run_id")
            counted = query(con, "SELECT run_id, CAST(sum(spans) AS BIGINT) AS n FROM span_stats "
                                 f"WHERE run_id IN ({finished}) GROUP BY run_id")
        derived = dict(counted.rows())
        short = sorted(run_id for run_id, n in held.rows() if derived.get(run_id, 0) != n)
        if short:
            _log.info("rebuilding the derived tables of %d collected run(s) left short by an earlier collector",
                      len(short))
            self._late_runs.update(dict.fromkeys(short))
            self._schedule_late(self.late_refresh_s)

    def _schedule_late(self, delay_s: float) -> None:
        """(under _lock) The timer of ``_refresh_late``, unless one is set: at least 4x the
        last rebuild's time away, so rebuilds hold the store at most a fifth of the time."""
        if self._late_timer is None and not self._closed:
            self._late_timer = threading.Timer(max(delay_s, 4 * self._late_cost_s), self._refresh_late)
            self._late_timer.daemon = True
            self._late_timer.start()

    def _refresh_late(self) -> None:
        """(the timer's thread) Rebuild the derived tables of one finished run given spans
        since (``_late_runs``), then set the timer for the next: ``runs``, ``diff`` and the
        dashboard read a run whose record came before some of its spans with them while the
        collector serves, not only once it stops. One run a turn, under the lock every
        request takes: all of them at once (0.15 s a run) held every export 16 s behind 120
        runs, past an SDK's 10 s timeout. A run whose rebuild fails waits for the close (or
        for spans of its own), so a store that fails is not retried, and logged, every turn."""
        with self._lock:
            self._late_timer = None
            if self._closed or not self._late_runs:
                return
            run_id = next(iter(self._late_runs))
            del self._late_runs[run_id]
            started = time.monotonic()
            if not self._refresh(run_id):
                self._late_failed.add(run_id)
            self._late_cost_s = time.monotonic() - started
            if self._late_runs:
                self._schedule_late(0.0)
            self._late_done.notify_all()

    def wait_late_refreshed(self, timeout: float | None = None) -> bool:
        """Wait until no finished run holds spans its derived tables lack (but those whose
        rebuild failed, tried again at the close); False on timeout."""
        with self._late_done:
            return self._late_done.wait_for(lambda: not self._late_runs, timeout)

    def _finish_recorded(self, run_id: str, record: dict) -> bool:
        """A run this collector created, finished with the status, digest, summary and trace
        digest its producer sent (``kvtrace.run`` span), or one an earlier collector on this store made
        and left without one (its producer's record came after a restart: the status, digest
        and summary were dropped with a 200); other runs keep what the store says (False)."""
        if run_id in self._created_runs:
            self._created_runs.remove(run_id)
        elif run_id in self._unrecorded_runs:
            self._unrecorded_runs.discard(run_id)
        else:
            return False
        record = dict(record)
        described = record.pop("described")
        sent = sent_span_count(record["summary"])
        held = self._held(run_id)
        if record["status"] == "complete" and sent is not None and not held.covers(sent):
            sender = json.loads(record["summary"])
            self._short_runs[run_id] = (sent, sender)
            # the collector's finding, kept in the summary beside its sender's numbers: what tells the
            # run it finished short from one its sender called incomplete, after a restart too
            record["summary"] = short_summary(sender, sent, held.count_below(sent))
            record["status"] = "incomplete"
            _log.warning("run %s: its sender numbered %d spans, %d of them stored: incomplete until the rest come",
                         run_id, sent, held.count_below(sent))
        # (one that failed is not counted as finished by its record; one that did is marked so in the store)
        if not self._finish(run_id, recorded=True, **record):
            return False
        # its name, trace, config and behaviours, as a ClickHouse collector's runs keep them: once it is finished
        # (described before a finish that failed, a restarted collector took the record's name in its row for a
        # record's finish, and the record sent again finished nothing)
        try:
            self.store.describe_run(run_id, **described)
        except Exception as err:
            _log.warning("run %s: record fields not kept (%s: %s)", run_id, type(err).__name__, err)
        return True

    def _open_recorded(self, run_id: str, record: dict) -> None:
        """An opening record (``run_rules.is_opening``): the run's name, trace, config, behaviours and
        created time its sender knew at its start, set where no record set them (a run still
        running, or one an earlier collector left without a record), so a run whose sender was
        killed keeps its settings. It finishes nothing and marks nothing (the run's record still
        finishes it); a second one, or one after the finishing record, changes nothing."""
        if run_id in self._opened or (run_id not in self._created_runs and run_id not in self._unrecorded_runs):
            return
        self._opened.add(run_id)
        try:
            self.store.describe_run(run_id, **record["described"])
        except Exception as err:
            _log.warning("run %s: opening record's fields not kept (%s: %s)", run_id, type(err).__name__, err)

    def _finish(self, run_id: str, **record) -> bool:
        """Finish a run (False where it failed); a failure (its derived tables, the store) is one
        log line, and the run keeps the status the store gives it, so other runs and the answer go on."""
        try:
            self.store.finish_run(run_id, **record)
        except Exception as err:
            _log.warning("run %s: not finished (%s: %s); %s", run_id, type(err).__name__, err,
                         self._what_it_holds(run_id))
            return False
        return True

    def _what_it_holds(self, run_id: str) -> str:
        """(under _lock) What the store holds of a run ``_finish`` failed on (one this collector made,
        or one it looked up: ``_held`` knows its numbers), in words true of it: "its spans are
        stored" was said of a run of its record alone, which holds none."""
        held = self._default_spans if run_id == self._default_run else self._held(run_id).count
        return "its spans are stored" if held else "it holds no span"

    def _refresh(self, run_id: str) -> bool:
        """A finished run given spans since: its derived tables (what ``runs`` counts)
        rebuilt, and, once it holds every span its sender numbered, complete where its record
        found it short (``_short_runs``); a failure is one log line, as for ``_finish`` (False)."""
        short = self._short_runs.get(run_id)
        try:
            if short is not None and self._held(run_id).covers(short[0]):  # (the rest of its spans came)
                self.store.finish_run(run_id, status="complete", summary=short[1])
                del self._short_runs[run_id]
            elif short is not None:  # (some of the rest: the count it lacks kept true, not the first one's)
                missing = short[0] - self._held(run_id).count_below(short[0])
                self.store.finish_run(run_id, status="incomplete", summary={**short[1], SPANS_MISSING: missing})
            else:
                self.store.refresh_run(run_id)
        except Exception as err:
            # (a run given spans since its finish, or one an earlier collector left short: it holds some)
            _log.warning("run %s: derived tables not rebuilt (%s: %s); its spans are stored", run_id,
                         type(err).__name__, err)
            return False
        return True

    def _check_collected(self, run_id: str, where: str) -> None:
        """A named run is one this store's collectors made (mode ``otlp``), or new: spans naming
        a replay's or a capture's run (``r1``) were added to it, its spans and derived counts no
        longer its replay's, with a 200."""
        self._look_up(run_id)
        mode = self._not_collected.get(run_id)
        if mode is not None:
            raise PayloadError(f"{where}: resource {RUN_ID_RESOURCE_KEY}: {run_id} is a run of this store that no "
                               f"collector made (mode {mode}): nothing is added to it")

    def _look_up(self, run_id: str) -> None:
        """Once per named run: a run the store holds already (an earlier collector's, or this
        one's before a restart) has the ids of its last spans remembered, so a request
        retried across a restart is not stored twice, and, when it is a collected run no
        record has finished, its producer's record may still finish it."""
        if run_id in self._looked_up:
            return
        from kvtrace.store.read._sql import connect, query  # (polars: loaded only when a run is met)

        self.store.release()
        with connect(self.store_path) as con:
            found = query(con, "SELECT mode, status, digest, summary, trace_digest, name, trace_source, config, "
                               f"behaviours, run_id IN (SELECT run_id FROM {RECORDED_RUNS_TABLE}) AS marked "
                               "FROM runs WHERE run_id = $run_id", {"run_id": run_id})
            last = query(con, "SELECT trace_id, span_id FROM spans WHERE run_id = $run_id ORDER BY seq DESC "
                              f"LIMIT {MAX_SPANS_PER_REQUEST}", {"run_id": run_id}) if found.height else None
            # the numbers it holds, as ranges of consecutive seq (a few: its sender's export chunks)
            ranges = query(con, "SELECT min(seq) AS lo, max(seq) + 1 AS hi FROM (SELECT seq, seq - CAST(row_number() "
                                "OVER (ORDER BY seq) AS BIGINT) AS g FROM spans WHERE run_id = $run_id) GROUP BY g",
                           {"run_id": run_id}) if found.height else None
        self._looked_up.add(run_id)
        if found.height == 0:
            return
        mode, status, digest, summary, *recorded, marked = found.row(0)
        if ranges is not None:
            self._held_seqs[run_id] = _HeldSeqs([(int(lo), int(hi)) for lo, hi in ranges.rows()])
        if mode != "otlp":
            self._not_collected[run_id] = str(mode)
            return
        if mode == "otlp" and status != "running" and not marked and not _finished_by_record(
                status, digest, summary, recorded[0]):
            self._unrecorded_runs.add(run_id)
        name, trace_source, config, behaviours = recorded[1:]
        if any(v is not None for v in (trace_source, config, behaviours)) or (
                name is not None and name != named_run_name(run_id)):
            self._opened.add(run_id)  # (described by a record before this collector: an opening one changes nothing)
        stored = summary_object(summary) if status == "incomplete" else None
        sent = sent_span_count(summary) if stored is not None and SPANS_MISSING in stored else None
        if sent is not None and stored is not None and not self._held(run_id).covers(sent):
            # (finished short by an earlier collector, which said so in its summary: the rest of its
            # spans, sent again to this one, complete it; it stayed incomplete for good, its list of
            # short runs gone with that process. A run its sender called incomplete stays so.)
            self._short_runs[run_id] = (sent, {k: v for k, v in stored.items() if k != SPANS_MISSING})
        if last is not None:
            for trace_hex, span_hex in reversed(last.rows()):  # (oldest first: the newest are forgotten last)
                if trace_hex and span_hex:
                    self._recent.add(run_id, _RecentSpans.key(int(trace_hex, 16), int(span_hex, 16)))

    def _take_back_runs(self, first: int) -> None:
        """The runs a refused request made (``_created_runs`` from ``first``), taken back where
        they hold no span: a commit that failed after its run was made left the run, finished
        ``complete`` with no span when the collector stopped. Where the store refuses that
        too, the run stays, as it was."""
        for run_id in self._created_runs[first:]:
            try:
                dropped = self.store.drop_empty_run(run_id)
            except Exception:  # (best effort: the request's own failure is the one to answer with)
                continue
            if dropped:
                self._created_runs.remove(run_id)
                self._known_runs.discard(run_id)
                if run_id == self._default_run:
                    self._default_run = None

    def _run_for(self, run_id: str) -> str:
        """The run of spans whose resource names ``run_id`` ("": none, see ``_named_run``),
        made on first use."""
        if not run_id:
            if self._default_run is None:
                host, port = self.address
                self._default_run = self.store.create_run(self.run_name or f"otlp collector {host}:{port}", mode="otlp")
                self._created_runs.append(self._default_run)
            return self._default_run
        if run_id not in self._known_runs:
            if not self.store.has_run(run_id):
                self.store.create_run(named_run_name(run_id), run_id=run_id, mode="otlp")
                self._created_runs.append(run_id)
            self._known_runs.add(run_id)
        return run_id


def _finished_by_record(status: str, digest: str | None, summary: str | None, trace_digest: str | None) -> bool:
    """Whether a finished collected run's stored row shows a ``kvtrace.run`` record finished it, as
    one collector keeps it in memory, in a store whose ``RECORDED_RUNS_TABLE`` does not say so (one
    recorded before that table): what a finishing record alone sets (a digest, a summary, a trace
    digest) or ``failed``, which no collector gives a run it closes. Not its name, trace source,
    config or behaviours: an opening record (``run_rules.is_opening``) sets those on a run it does
    not finish, which its finishing record, after a restart, still finishes. Its first record
    stands: a second one, after a restart, finished the run again. (A record of its status alone
    leaves its row as a collector's close leaves it: only the mark tells them apart.)"""
    return status == "failed" or any(v is not None for v in (digest, summary, trace_digest))


def as_exported(attributes: dict | None) -> dict[str, str]:
    """A ``kvtrace.run`` record's attributes as the ClickHouse exporter's table holds them, each
    value its text (``run_id_text``, pdata's AsString), so ``run_record`` reads one record alike on
    both collector paths: an int digest 7 is the digest "7" here too (it was a 400 here, "7"
    there), a config sent as an OTLP map its JSON (a 400 here, the run's config there), an empty
    value "", which no field takes (it was read as absent here and refused there)."""
    return {k: run_id_text(v) for k, v in (attributes or {}).items() if k.startswith(RUN_RECORD_PREFIX)}


def _named_run(resource: dict, where: str) -> str:
    """The run id a span's resource names (``kvtrace.run.id``), or "" for the collector's own
    run (no such key); one that cannot name a run (``run_id_problem``) refuses the request.

    A value of another type is read as the ClickHouse exporter's text of it (``run_id_text``):
    an int 7 names run "7" on both collector paths, and an empty one is refused on both (the
    exporter stores it as "", which cannot be told from a string sent empty)."""
    if RUN_ID_RESOURCE_KEY not in resource:
        return ""
    run_id = run_id_text(resource[RUN_ID_RESOURCE_KEY])
    problem = run_id_problem(run_id)
    if problem is not None:
        raise PayloadError(f"{where}: resource {RUN_ID_RESOURCE_KEY}: {problem}")
    return run_id


class CollectorClosed(KVTraceError):
    """A request that came while the collector was shutting down (the store closed)."""


class ExportAbandoned(KVTraceError):
    """An export whose client stopped waiting before it was committed."""


class _BodyTooLarge(Exception):
    pass


_MAX_CHUNK_LINE = 1024  # a size line (hex size and extensions) or a trailer line


def _read_chunked(rfile, limit: int) -> bytes:
    """A ``Transfer-Encoding: chunked`` body (RFC 9112 section 7.1), at most ``limit`` bytes;
    ValueError when it is malformed or ends early, _BodyTooLarge past the limit."""
    parts, total = [], 0
    while True:
        line = rfile.readline(_MAX_CHUNK_LINE + 1)
        if not line.endswith(b"\n") or len(line) > _MAX_CHUNK_LINE:
            raise ValueError("a chunk size line is cut or too long")
        size_text = line.split(b";", 1)[0].strip()
        if not size_text or any(c not in b"0123456789abcdefABCDEF" for c in size_text):
            raise ValueError(f"chunk size {size_text[:20].decode('latin-1')!r} is not hexadecimal")
        size = int(size_text, 16)
        if size == 0:
            break
        total += size
        if total > limit:
            raise _BodyTooLarge
        data = rfile.read(size)
        if len(data) < size or rfile.read(2) != b"\r\n":
            raise ValueError(f"ended inside a chunk, after {total - size + len(data)} bytes")
        parts.append(data)
    for _ in range(64):  # trailer fields, ignored, up to the blank line
        line = rfile.readline(_MAX_CHUNK_LINE + 1)
        if not line.endswith(b"\n"):
            raise ValueError("ended before the blank line after the last chunk")
        if line in (b"\r\n", b"\n"):
            return b"".join(parts)
    raise ValueError("too many trailer lines")


def _make_handler(collector: OTLPCollector) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = f"kvtrace-otlp/{__version__}"
        timeout = collector.read_timeout_s  # socket timeout: a stalled read ends, it does not hold a thread
        _outcome: str | None = None  # of the POST being handled: "stored", or "refused" (counted), once it is either

        def handle_one_request(self):
            # the request line and headers, however slowly they trickle, within the timeout
            collector.guard.deadline(self.connection, collector.read_timeout_s)
            super().handle_one_request()

        def log_message(self, fmt, *args):  # quiet: the CLI reports counts instead
            pass

        def _reply(self, code: int, body: bytes, content_type: str, close: bool = False) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(body)

        def _error(self, code: int, message: str, as_json: bool, close: bool = False) -> None:
            collector.count_rejected()
            self._outcome = "refused"
            # the Status's gRPC code: a 503 is UNAVAILABLE, as the gRPC transport and the
            # connection cap's 503 say it (it said UNKNOWN)
            grpc_code = {400: 3, 413: 8, 503: 14}.get(code, 2)
            if as_json:
                body = json.dumps({"code": grpc_code, "message": message}).encode()
                self._reply(code, body, "application/json", close)
            else:
                body = status_pb2.Status(code=grpc_code, message=message).SerializeToString()
                self._reply(code, body, "application/x-protobuf", close)

        def do_GET(self):
            # the body, if any, is not read: the reply closes the connection (else its bytes
            # would be read as the next request)
            self._error(HTTPStatus.METHOD_NOT_ALLOWED, "use POST /v1/traces", True, close=True)

        do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_GET

        def do_HEAD(self):  # the same answer without a body, as HEAD's must be
            collector.count_rejected()
            self.send_response(HTTPStatus.METHOD_NOT_ALLOWED)
            self.send_header("Content-Length", "0")
            self.send_header("Connection", "close")
            self.close_connection = True
            self.end_headers()

        def send_error(self, code, message=None, explain=None):
            """http.server's own refusals (an unknown method, a malformed request line or
            header): the OTLP Status as JSON, as ours are, not its HTML page."""
            self.close_connection = True
            if getattr(self, "command", None) == "HEAD" or code < 400:
                return super().send_error(code, message, explain)
            self._error(code, message or HTTPStatus(code).phrase, True, close=True)

        def do_POST(self):
            self._outcome = None
            try:
                self._post()
            except (TimeoutError, ConnectionError) as err:  # the client went quiet or away
                self.close_connection = True
                peer = self.client_address[0]
                if self._outcome == "stored":  # (it said "dropped" of spans it had stored)
                    _log.warning("OTLP/HTTP request from %s stored, but its reply was not delivered: %s", peer, err)
                elif self._outcome == "refused":
                    _log.warning("OTLP/HTTP request from %s refused, and its reply was not delivered: %s", peer, err)
                else:  # nothing stored: counted as refused, as a gRPC call not sent by its deadline is
                    collector.count_rejected()
                    _log.warning("OTLP/HTTP request from %s dropped, nothing stored: %s", peer, err)
            except Exception as err:  # never a traceback; the client learns it was not stored
                _log.exception("OTLP/HTTP request failed")
                self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"not stored: {type(err).__name__}: {err}"[:300],
                            self._as_json(), True)

        def _as_json(self) -> bool:
            return (self.headers.get("Content-Type") or "").split(";")[0].strip().lower() == "application/json"

        def _post(self):
            ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
            as_json = ctype == "application/json"
            # (an absolute-form target, http://host/v1/traces, names the same path: RFC 9112 3.2.2)
            try:
                path = urlsplit(self.path).path
            except ValueError:  # no URL at all (http://[::1/v1/traces): a 400, not a traceback and a 500
                return self._error(HTTPStatus.BAD_REQUEST, f"request target {self.path[:80]!r} is not a URL", as_json,
                                   True)
            if path != TRACES_PATH:
                # the body is not read: the reply closes the connection
                return self._error(HTTPStatus.NOT_FOUND, f"only {TRACES_PATH} is served here", as_json, True)
            lengths = self.headers.get_all("Content-Length") or []
            if len({v.strip() for v in lengths}) > 1:  # which one frames the body? refused (RFC 9112 6.3)
                return self._error(HTTPStatus.BAD_REQUEST, "Content-Length given twice, with different values",
                                   as_json, True)
            length = lengths[0] if lengths else None
            limit = collector.max_body_bytes
            codings = [c.strip().lower() for v in self.headers.get_all("Transfer-Encoding") or [] for c in v.split(",")]
            if codings not in ([], ["chunked"]):  # (RFC 9112 6.1: a coding not understood is a 501)
                return self._error(HTTPStatus.NOT_IMPLEMENTED, "Transfer-Encoding: only chunked is accepted", as_json,
                                   True)
            chunked = codings == ["chunked"]
            if chunked and length is not None:  # two framings: refused (RFC 9112 6.1), never guessed
                return self._error(HTTPStatus.BAD_REQUEST, "both Content-Length and Transfer-Encoding: chunked",
                                   as_json, True)
            n = None  # the body's length when Content-Length frames it
            if not chunked:
                if length is None:
                    return self._error(HTTPStatus.LENGTH_REQUIRED, "Content-Length required", as_json, True)
                digits = length.strip()
                # ASCII digits only ('²'.isdigit() holds), and few enough for any body size
                if not (digits.isascii() and digits.isdigit()) or len(digits) > 18:
                    return self._error(HTTPStatus.BAD_REQUEST, "Content-Length: expected a decimal byte count",
                                       as_json, True)
                n = int(digits)
                if n > limit:
                    return self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                       f"body of {n} bytes exceeds the limit of {limit}", as_json, True)
            size = limit if n is None else n  # held in memory once read: counted before (a chunked one: the limit)
            if not collector.guard.reserve(size):
                return self._error(HTTPStatus.SERVICE_UNAVAILABLE, "busy: too many request bodies buffered; retry",
                                   as_json, True)
            try:
                collector.guard.deadline(self.connection, collector.read_timeout_s + size / MIN_BODY_BYTES_PER_S)
                return self._read_body_and_store(ctype, as_json, n, limit)
            finally:
                collector.guard.release(size)

        def _read_body_and_store(self, ctype: str, as_json: bool, n: int | None, limit: int):
            """The body (``n`` bytes; None: chunked) read, then decoded and stored."""
            if n is None:  # HTTP/1.1 clients may stream the body in chunks
                try:
                    body = _read_chunked(self.rfile, limit)
                except _BodyTooLarge:
                    return self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                       f"chunked body exceeds the limit of {limit} bytes", as_json, True)
                except ValueError as err:  # malformed or cut: never stored
                    return self._error(HTTPStatus.BAD_REQUEST, f"chunked body: {err}", as_json, True)
            else:
                body = self.rfile.read(n)
                if len(body) < n:  # the client closed its side early: a cut body is never stored
                    return self._error(HTTPStatus.BAD_REQUEST, f"body ended after {len(body)} of its {n} bytes "
                                       "(Content-Length)", as_json, True)
            collector.guard.deadline(self.connection, None)  # the rest is the receiver's own work
            if ctype not in ("application/x-protobuf", "application/json"):
                return self._error(HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                                   "Content-Type must be application/x-protobuf or application/json", as_json)
            encoding = (self.headers.get("Content-Encoding") or "identity").strip().lower()
            with collector.decode_slots:
                return self._decode_and_store(body, encoding, as_json, limit)

        def _decode_and_store(self, body: bytes, encoding: str, as_json: bool, limit: int):
            try:
                if encoding == "gzip":
                    body = _gunzip(body, limit)
                elif encoding == "deflate":
                    body = _inflate(body, limit)
                elif encoding != "identity":
                    return self._error(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, f"Content-Encoding {encoding} not supported",
                                       as_json)
                spans = decode_json(body) if as_json else decode_protobuf(body)
            except OverflowError:
                return self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                   f"decompressed body exceeds the limit of {limit} bytes", as_json)
            except PayloadError as err:
                return self._error(HTTPStatus.BAD_REQUEST, str(err), as_json)
            with collector.replying():  # (stored, then answered, before the collector closes)
                try:
                    collector.ingest(spans)
                except PayloadError as err:  # a value the store cannot hold
                    return self._error(HTTPStatus.BAD_REQUEST, str(err), as_json)
                except KVTraceError as err:  # store busy or unusable: the client may retry
                    return self._error(HTTPStatus.SERVICE_UNAVAILABLE, str(err), as_json)
                self._outcome = "stored"
                if as_json:
                    self._reply(HTTPStatus.OK, b"{}", "application/json")
                else:
                    self._reply(HTTPStatus.OK, trace_service_pb2.ExportTraceServiceResponse().SerializeToString(),
                                "application/x-protobuf")

    return Handler


def serve_collector(store_path: str | Path, host: str = "127.0.0.1", port: int = 4318,
                    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, grpc_port: int | None = None,
                    on_ready: Callable[[OTLPCollector], None] | None = None) -> OTLPCollector:
    """Serve until interrupted (Ctrl-C or SIGTERM), then commit and close the store (its
    runs complete); returns the collector."""
    collector = OTLPCollector(store_path, host, port, max_body_bytes, grpc_port=grpc_port)
    if on_ready is not None:
        on_ready(collector)
    try:
        with sigterm_as_interrupt():
            collector.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        collector._close_servers()
        collector.close_store()
    return collector
