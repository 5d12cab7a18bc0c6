"""The OTLP receiver's limits, and the check of its options.

A light module (no pyarrow, gRPC or DuckDB): ``kvtrace collect`` checks its command line
here before it loads the receiver, so a mistyped option is told at once.
"""

from __future__ import annotations

from kvtrace.errors import ConfigError, check_option

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_BODY_BYTES = 1 << 31  # --max-body-bytes at most: gRPC's receive limit is an int32
# How long a gRPC export in flight at shutdown may take to finish (decode and commit a
# large batch) before it is cancelled and refused.
GRPC_GRACE_S = 10.0
# How long the collector, closing, waits for HTTP requests it stored to be answered (a
# client that does not read its reply is not waited for longer).
REPLY_GRACE_S = 10.0
# How soon a finished run given spans after its record (they came out of order, through a
# forwarding collector's parallel senders) has its derived tables rebuilt while the collector
# serves; at least 4x the last rebuild's time, so a long run's rebuilds hold the store at
# most a fifth of the time. (Until the collector stopped, its readers saw the counts of the
# record's moment: 0 spans, 0 evictions for a record that came first.)
LATE_REFRESH_S = 1.0
READ_TIMEOUT_S = 30.0  # a client that stops sending mid-request is dropped after this long
# ... and one that keeps sending a byte now and then (slowloris) is held to deadlines: its
# request line and headers within READ_TIMEOUT_S, its body within READ_TIMEOUT_S plus its
# length at this rate.
MIN_BODY_BYTES_PER_S = 256 * 1024
# Open OTLP/HTTP connections: each holds a thread, so more are answered 503 at once (an
# OTLP exporter retries a 503).
MAX_CONNECTIONS = 64
# Request bodies held in memory at once, in --max-body-bytes (at least 64 MiB): a body that
# would pass it is answered 503 before it is read.
BUFFERED_BODIES = 4
MIN_BUFFERED_BYTES = 64 * 1024 * 1024
# Members of one gzip body: SDKs send one; each further member costs a copy of the rest of
# the body, so thousands of empty members would cost seconds of CPU a request.
MAX_GZIP_MEMBERS = 64
# Requests decoded and stored at once: a decoded span costs far more memory than its bytes
# (about 60x), so concurrent large requests wait for a slot instead of adding up.
DECODE_SLOTS = 2
# Spans in one request: an SDK exports 512 at a time, kvtrace's own exporter 2,048. Each
# decoded span costs about 60x its bytes, so a 16 MB body of 500k tiny spans took 1.4 GB;
# counted before any span is decoded.
MAX_SPANS_PER_REQUEST = 65_536
# Spans remembered (run, trace id, span id) to tell a retried export from new spans: an
# exporter that got no answer (a reset, a collector killed between its commit and its
# reply) sends the same request again, which stored every span twice (a run's evictions,
# requests and span counts doubled). Two requests' worth; some 150 bytes a span.
RECENT_SPANS = 2 * MAX_SPANS_PER_REQUEST


def check_collector_options(port: int, grpc_port: int | None, max_body_bytes: int, host: str | None = None) -> None:
    """KVTraceError naming the option when one is out of range (``grpc_port`` None: no gRPC)
    or ``host`` is blank: the HTTP server bound every interface for it (an unset shell
    variable in ``--host "$HOST"`` exposed the receiver to the network), and gRPC failed
    with "address in use or not available"."""
    if host is not None and not host.strip():
        raise ConfigError("--host", repr(host), "expected an address to listen on (0.0.0.0: every interface)")
    check_option("--port", port, 0, 65_535)
    if grpc_port is not None:
        check_option("--grpc-port", grpc_port, 0, 65_535)
        if grpc_port == port != 0:  # (one would find the other's listener: "address in use")
            raise ConfigError("--grpc-port", str(grpc_port), "is --port too; OTLP/HTTP and gRPC need a port each")
    check_option("--max-body-bytes", max_body_bytes, 1, MAX_BODY_BYTES)
