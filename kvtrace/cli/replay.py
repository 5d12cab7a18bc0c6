"""Commands that replay traces: ``replay``, ``sweep``, ``curve``."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Annotated

import typer

from kvtrace.cli.application import app
from kvtrace.cli.choices import Mode
from kvtrace.cli.options import Db, Json, replay_options
from kvtrace.cli.output import echo_json, error, print_rows, recorded, status, tell_left_out
from kvtrace.process import pyarrow_without_pandas, stop_signalled


@app.command()
@replay_options
def replay(
    spec,
    db: Db = None,
    otlp_endpoint: Annotated[str | None, typer.Option(
        metavar="URL", help="Also export the spans to this collector URL: OTLP/HTTP, or gRPC when "
                     "OTEL_EXPORTER_OTLP_PROTOCOL=grpc.")] = None,
    as_json: Json = False,
) -> None:
    """Replay a trace deterministically through the cache (and engine) and summarise it."""
    from kvtrace.replay.report import print_summary
    from kvtrace.replay.run import run_replay

    if otlp_endpoint is not None and not otlp_endpoint.strip():  # (an empty value meant no endpoint, silently)
        from kvtrace.errors import ConfigError

        raise ConfigError("--otlp-endpoint", "''", "expected a collector URL, e.g. http://127.0.0.1:4318")
    if db is not None or otlp_endpoint is not None:
        pyarrow_without_pandas()
    result = run_replay(spec, db=db, otlp_endpoint=otlp_endpoint, progress=sys.stderr.isatty())
    recorded(result.run_id, db)
    if result.otlp_run_id is not None and not result.undelivered:  # (else the error below says what was not)
        status(f"kvtrace: spans sent over OTLP as run {result.otlp_run_id}")
    if as_json:
        echo_json({**result.summary, "run_id": result.run_id,
                   **({"otlp_run_id": result.otlp_run_id} if result.otlp_run_id is not None else {})})
    else:
        print_summary(result.summary, title=f"kvtrace replay {spec.trace}")
    if result.undelivered:  # the run (and its store copy) is whole; the collector is short
        error(result.undelivered)
        raise typer.Exit(1)


@app.command()
@replay_options
def sweep(
    spec,
    param: Annotated[list[str], typer.Option(
        "--param", metavar="NAME=V1,V2,...",
        help="A setting to sweep (repeatable; every combination runs): capacity_blocks, capacity_tokens, "
             "external_capacity_blocks, block_size, retention, preset, policy, mode, or without "
             "(behaviours joined by +, or none).")],
    db: Db = None,
    workers: Annotated[int | None, typer.Option(
        metavar="N", help="Local worker processes, at least 1 (default 2; at most one a CPU and one a replay); "
                          "with --ray, the most replays in flight on the cluster at once (default: all).")] = None,
    ray: Annotated[str | None, typer.Option(
        "--ray", metavar="ADDRESS",
        help="Run each replay as a task on this Ray cluster (auto: the running one; local: start one here). "
             "Needs kvtrace[ray].")] = None,
    baseline: Annotated[str | None, typer.Option(
        metavar="NAME=V,...", help="The combination the table's deltas are taken against (default: the first).")]
        = None,
    as_json: Json = False,
) -> None:
    """Replay every combination of the swept settings, each an independent run."""
    from kvtrace.replay.sweep import parse_baseline, parse_param, run_sweep, sweep_table

    params = [parse_param(p) for p in param]
    base = parse_baseline(baseline, params)
    if db is not None:
        pyarrow_without_pandas()

    def done(run) -> None:
        if run.run_id is not None:
            recorded(run.run_id, db)

    with _worker_deaths_told(db):
        result = run_sweep(spec, params, db=db, workers=workers, ray_address=ray, on_done=done)
    if as_json:
        echo_json(result.to_json())
    else:
        rows = sweep_table(result, base)
        metrics = rows[0][len(params):]  # (the parameters' columns always shown; the metrics as fit, in order)
        tell_left_out(print_rows(rows, title=f"kvtrace sweep {spec.trace} ({result.sweep_id})", left=len(params),
                                 priority=metrics, wrap=frozenset(metrics)))


@app.command()
@replay_options(exclude=("policy",), defaults={"mode": Mode("cache-only")})
def curve(
    spec,
    capacities: Annotated[str, typer.Option(
        metavar="auto|C1,C2,...",
        help="Capacities in blocks, inf for the unbounded cache (auto, cache-only mode: from the largest request up "
             "to the trace's distinct blocks, and inf). Engine mode: explicit block counts (no auto, no inf), each a "
             "--capacity-blocks, vLLM's num_gpu_blocks with its null block, drawn at the usable blocks (one fewer) "
             "as its run states them.")] = "auto",
    policy: Annotated[str | None, typer.Option(
        metavar="lru,belady", help="The curves to draw: lru, belady (the offline bound, MIN), or both (default: both; "
                                   "lru in engine mode, where the Belady bound has no unit).")] = None,
    db: Db = None,
    workers: Annotated[int | None, typer.Option(
        metavar="N", help="Engine mode: local worker processes, at least 1 (default 2; at most one a CPU and one a "
                          "capacity); with --ray, the most replays in flight on the cluster at once (default: "
                          "all).")] = None,
    ray: Annotated[str | None, typer.Option(
        "--ray", metavar="ADDRESS", help="Engine mode: replay each capacity as a Ray task (see `kvtrace sweep`).")]
        = None,
    as_json: Json = False,
) -> None:
    """Hit rate against capacity: LRU (one exact pass in cache-only mode) and the Belady bound."""
    from kvtrace.replay.curve import run_curve

    policies = None if policy is None else tuple(p.strip() for p in policy.split(","))  # (run_curve refuses '')
    if db is not None:
        pyarrow_without_pandas()

    def show(result) -> None:  # (before it is recorded: a store that cannot take it loses nothing computed)
        if as_json:
            echo_json(result.to_json())
        else:
            print_rows(result.table(), title=f"kvtrace curve {spec.trace}")
            status(result.method_note())

    with _worker_deaths_told(db, curve=True):
        result = run_curve(spec, capacities, policies=policies, db=db, workers=workers, ray_address=ray,
                           computed=show)
    if db is not None:
        status(f"kvtrace: curve {result.curve_id} recorded in {db}")


@contextlib.contextmanager
def _worker_deaths_told(db: str | None, curve: bool = False) -> Iterator[None]:
    """A worker that died (``kill -9``, the OOM killer; a local one or a Ray task's) as one
    line and exit 1, not the pool's traceback. The sweep stores each run once it and every
    earlier one are back: those stay, the rest were not recorded; a curve is recorded only
    once every point is back. Without a store nothing was, and the line says nothing of it."""
    from concurrent.futures.process import BrokenProcessPool

    from kvtrace.replay.sweep import WorkerDied

    kept = "" if db is None else ("; the runs stored before it are kept, the rest were not recorded"
                                  + (", nor the curve" if curve else ""))
    try:
        yield
    except BrokenProcessPool:
        if stop_signalled():  # (Ctrl-C or SIGTERM to the process group: the workers died of it)
            raise
        error(f"a worker process died before its replay finished (killed, or out of memory?){kept}")
        raise typer.Exit(1) from None
    except WorkerDied as err:
        error(f"{err}{kept}")
        raise typer.Exit(1) from None
