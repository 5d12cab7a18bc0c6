"""Commands that record live engines: ``collect`` (OTLP) and ``capture vllm`` (KV events)."""

from __future__ import annotations

from typing import Annotated

import typer

from kvtrace.cli.application import app, capture_app
from kvtrace.cli.options import DbRequired, output_file
from kvtrace.cli.output import count, recorded, status
from kvtrace.process import pyarrow_without_pandas


@app.command()
def collect(
    ctx: typer.Context,
    db: DbRequired,
    port: Annotated[int, typer.Option(metavar="PORT", help="OTLP/HTTP port (0: any free port).")] = 4318,
    grpc_port: Annotated[int, typer.Option(
        metavar="PORT", help="OTLP/gRPC port, the SDKs' default protocol (0: any free port).")] = 4317,
    grpc: Annotated[bool, typer.Option("--grpc/--no-grpc", help="Also serve OTLP/gRPC.")] = True,
    host: Annotated[str, typer.Option(
        metavar="ADDRESS", help="Bind address (IPv6 as ::1; 0.0.0.0 or :: for every interface).")] = "127.0.0.1",
    max_body_bytes: Annotated[int, typer.Option(
        metavar="BYTES", help="Largest request body accepted, 1 to 2,147,483,648 (over gRPC at most "
                              "2,147,483,647, gRPC's own limit).")]
        = 16 * 1024 * 1024,
) -> None:
    """Receive OTLP traces (HTTP: protobuf or JSON on /v1/traces; gRPC) into the store."""
    import os

    from kvtrace.instrument.otlp.limits import check_collector_options

    source = ctx.get_parameter_source("grpc_port")  # (typer's own click's enum: told by its name)
    if not grpc and getattr(source, "name", None) == "COMMANDLINE":
        from kvtrace.errors import ConfigError  # (it was ignored without a word, even a port of -5)

        raise ConfigError("--grpc-port", str(grpc_port), "given with --no-grpc, which serves no gRPC port; drop one")
    check_collector_options(port, grpc_port if grpc else None, max_body_bytes, host)  # (before the receiver loads)
    # Before grpc loads: its C core wrote a stderr line for each malformed request any peer
    # sends (a bad grpc-encoding, say); the summary counts what kvtrace refuses. Set
    # GRPC_VERBOSITY to see gRPC's own lines again.
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    from kvtrace.instrument.otlp import serve_collector

    pyarrow_without_pandas()

    def ready(c) -> None:
        grpc_part = f", OTLP/gRPC on {c.grpc_target}" if c.grpc_target else ""
        status(f"kvtrace collect: OTLP/HTTP on {c.url}{grpc_part} -> {db} (Ctrl-C to stop)")

    collector = serve_collector(db, host=host, port=port, max_body_bytes=max_body_bytes,
                                grpc_port=grpc_port if grpc else None, on_ready=ready)
    again = f"{count(collector.duplicate_spans, 'span')} sent again not stored twice, " \
        if collector.duplicate_spans else ""
    # (a kvtrace.run record is no span: it was counted as one, a span more than `runs` listed)
    n = collector.runs_recorded
    recorded_runs = f"{count(n, 'run')} finished by {'its record' if n == 1 else 'their records'}, " if n else ""
    status(f"kvtrace collect: {count(collector.spans_received, 'span')} stored, {again}{recorded_runs}"
           f"{count(collector.requests_rejected, 'request')} rejected")


# the bytes of a path a Unix socket's address holds (Linux's sun_path, 108 with its NUL)
_IPC_PATH_BYTES = 107


@capture_app.command("vllm")
def capture_vllm(
    endpoint: Annotated[str, typer.Option(
        metavar="URL", help="vLLM's KV-events PUB endpoint, e.g. tcp://127.0.0.1:5557.")],
    db: DbRequired,
    replay_endpoint: Annotated[str | None, typer.Option(
        metavar="URL", help="vLLM's replay ROUTER endpoint, for gap recovery.")] = None,
    duration: Annotated[float | None, typer.Option(
        metavar="SECONDS", help="Stop after this long (0 to a year; default: until Ctrl-C).")] = None,
    trace_out: Annotated[str | None, typer.Option(  # (a str: a Path drops the / of NAME/, which is refused)
        metavar="FILE", callback=output_file, help="Also reconstruct a native trace here.")] = None,
    dp_size: Annotated[int, typer.Option(
        metavar="N", help="The server's --data-parallel-size, 1 to 1,024: capture every rank, each at vLLM's "
                          "per-rank endpoint (tcp port + rank).")] = 1,
) -> None:
    """Record a live vLLM server's KV events into the store. Exits 1 when no publisher
    was ever reached (nothing was listening there); a reached but idle server is not an
    error (the run's summary says nothing_received)."""
    from kvtrace.errors import ConfigError
    from kvtrace.instrument.vllm.endpoints import capture_endpoints
    from kvtrace.names import printable

    for option, address in (("--endpoint", endpoint), ("--replay-endpoint", replay_endpoint)):
        if address is not None and not address.strip():  # (--replay-endpoint '' turned gap recovery off unsaid)
            raise ConfigError(option, repr(address), "expected tcp://HOST:PORT or ipc://PATH, got an empty one")
        if address is not None and address.startswith("inproc://"):  # (it recorded a run of nothing, exit 1)
            raise ConfigError(option, address, "inproc:// reaches sockets of this process only, never a vLLM "
                                               "server's: give its tcp:// or ipc:// endpoint")
    # each rank's own address (an ipc path holding "inproc" gets _dp{rank} appended, as vLLM
    # does): rank 1's past the socket's 107 bytes was 'File name too long' once its run was made
    ranks = capture_endpoints(endpoint, replay_endpoint, duration, dp_size)  # (before ZMQ and the store load)
    for rank_endpoints in ranks:
        for option, address in zip(("--endpoint", "--replay-endpoint"), rank_endpoints, strict=True):
            if address is None or not address.startswith("ipc://"):
                continue
            given = endpoint if option == "--endpoint" else str(replay_endpoint)
            path = address.removeprefix("ipc://")
            if path in ("", "@"):  # (ZMQ's 'Invalid argument' once the capture's run was made: a failed run)
                raise ConfigError(option, given, "expected ipc://PATH (a socket's path, or @NAME for an abstract "
                                                 "one), got no path")
            size = len(path.encode("utf-8", "surrogateescape"))
            if size > _IPC_PATH_BYTES:
                # (ZMQ's connect refused it, 'File name too long', once the capture's run was made: a failed run)
                whose = "" if address == given else f" of {printable(address)}, a DP rank's,"
                raise ConfigError(option, given, f"the socket path{whose} is {size:,} bytes, past the "
                                                 f"{_IPC_PATH_BYTES} a Unix socket's address holds; give a shorter "
                                                 "path (or tcp://)")
    if trace_out is not None:  # before anything is received (a store there would be lost)
        from kvtrace.store.backend import is_clickhouse
        from kvtrace.workload.lines import AtomicText

        AtomicText(trace_out, [] if is_clickhouse(db) else [db]).check()
    from kvtrace.instrument.vllm import capture_report
    from kvtrace.instrument.vllm import capture_vllm as capture

    pyarrow_without_pandas()
    stats = capture(endpoint, replay_endpoint=replay_endpoint, store_path=db, duration=duration,
                    trace_out=trace_out, dp_size=dp_size)
    status(capture_report(stats))
    if trace_out is not None:  # (the trace was written without a word: an empty one too, which replay refuses)
        from kvtrace.workload.lines import MAX_TOKENS

        empty = "" if stats.requests else " (no stored block was received: the trace holds no request to replay)"
        # (a chain past what replay takes was written whole, and the trace this line vouched for refused)
        cut = (f" ({stats.requests_cut} cut to the longest prefix of blocks within the {MAX_TOKENS:,} tokens a "
               "replayed prompt may hold)") if stats.requests_cut else ""
        status(f"kvtrace capture vllm: {count(stats.requests, 'request')} rebuilt in {trace_out}{empty}{cut}")
    recorded(stats.run_id, db)
    if stats.nothing_received and not stats.connected:
        raise typer.Exit(1)
