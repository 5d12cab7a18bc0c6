"""The ``kvtrace`` command. It only wires the packages together."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from kvtrace.errors import KVTraceError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Flight recorder and wind tunnel for hybrid LLM prefix (KV) caches.",
)
capture_app = typer.Typer(no_args_is_help=True, help="Record a live serving engine.")
app.add_typer(capture_app, name="capture")


def _err(msg: str) -> None:
    typer.echo(f"kvtrace: error: {msg}", err=True)


def _status(msg: str) -> None:
    """A status line on stderr (stdout stays clean for data)."""
    typer.echo(msg, err=True)


def _spec_from_options(trace, **kw):
    from kvtrace.replay.run import RunSpec

    return RunSpec(trace=trace, **kw)


@app.command()
def replay(
    trace: str = typer.Argument(..., help="Trace file (or directory of WEKA files), or gen:NAME for a generated workload."),
    preset: Optional[str] = typer.Option(None, help="Engine/cache preset: dense-attention, kimi-hybrid (default), ..."),
    config: Optional[Path] = typer.Option(None, "--config", help="TOML config overriding the preset."),
    mode: str = typer.Option("engine", help="engine | cache-only"),
    policy: str = typer.Option("lru", help="cache-only eviction policy: lru | belady"),
    fmt: Optional[str] = typer.Option(None, "--format", help="mooncake | bailian | weka | azure | native (default: detect)"),
    block_size: Optional[int] = typer.Option(None, help="Tokens per KV block (cache-only: per trace hash id)."),
    capacity_blocks: Optional[int] = typer.Option(None, help="GPU blocks per KV cache group."),
    capacity_tokens: Optional[int] = typer.Option(None, help="Capacity in tokens (converted to blocks)."),
    retention: Optional[str] = typer.Option(None, help="Retention interval: none | 0 | K (tokens)."),
    external_blocks: Optional[int] = typer.Option(None, help="Add an external (connector) tier of N blocks."),
    without: list[str] = typer.Option([], "--without", help="Switch a behaviour off (repeatable)."),
    limit: Optional[int] = typer.Option(None, help="Replay only the first N requests."),
    seed: int = typer.Option(0, help="Seed for generated workloads and span ids."),
    name: Optional[str] = typer.Option(None, help="Run name stored with the run."),
    db: Optional[Path] = typer.Option(None, help="DuckDB file to record spans and the run into."),
    otlp_endpoint: Optional[str] = typer.Option(None, help="Also export spans over OTLP/HTTP to this URL."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
):
    """Replay a trace deterministically through the cache (and engine) and summarise it."""
    from kvtrace.replay.report import print_summary
    from kvtrace.replay.run import run_replay

    spec = _spec_from_options(
        str(trace),
        preset=preset,
        mode=mode,
        policy=policy,
        config_file=str(config) if config else None,
        trace_format=fmt,
        block_size=block_size,
        capacity_blocks=capacity_blocks,
        capacity_tokens=capacity_tokens,
        retention=retention,
        external_capacity_blocks=external_blocks,
        without=tuple(without),
        limit=limit,
        seed=seed,
        name=name,
    )
    result = run_replay(spec, db=db, otlp_endpoint=otlp_endpoint, progress=sys.stderr.isatty())
    if as_json:
        typer.echo(json.dumps(result.summary, sort_keys=True))
    else:
        print_summary(result.summary, title=f"kvtrace replay {trace}")


@app.command()
def generate(
    workload: str = typer.Argument("mixed", help="chat | agent | mixed | study-<behaviour>"),
    out: Path = typer.Option(..., "--out", "-o", help="Output trace file."),
    fmt: str = typer.Option("native", "--format", help="native | mooncake"),
    seed: int = typer.Option(0),
    num_requests: Optional[int] = typer.Option(None, "--requests", help="Number of requests (default: the preset's)."),
):
    """Write a seeded synthetic workload."""
    from kvtrace.replay.generate import write_generated

    n = write_generated(workload, out, fmt=fmt, seed=seed, num_requests=num_requests)
    typer.echo(f"wrote {n} requests to {out}")


@app.command()
def convert(
    trace: Path = typer.Argument(..., help="Any supported trace."),
    out: Path = typer.Option(..., "--out", "-o", help="Output kvtrace native JSONL."),
    fmt: Optional[str] = typer.Option(None, "--format"),
    limit: Optional[int] = typer.Option(None),
):
    """Convert any supported trace to kvtrace native JSONL."""
    from kvtrace.replay.readers import open_trace
    from kvtrace.workload.native import write_native

    src = open_trace(trace, format=fmt, limit=limit)
    n = write_native(src, out)
    typer.echo(f"wrote {n} requests to {out}")


@app.command()
def demo(
    db: Path = typer.Option(Path("kvtrace-demo.duckdb"), help="Where to write the demo runs."),
):
    """Replay the built-in workload with every behaviour on and each off, and show the diffs."""
    from kvtrace.compare.demo import run_demo

    run_demo(db_path=db, progress=True)


@app.command()
def diff(
    run_a: str = typer.Argument(...),
    run_b: str = typer.Argument(...),
    db: Path = typer.Option(..., help="DuckDB file holding both runs."),
    as_json: bool = typer.Option(False, "--json"),
    markdown: bool = typer.Option(False, "--markdown"),
    force: bool = typer.Option(False, help="Compare runs of different traces anyway."),
    fail_if: list[str] = typer.Option([], "--fail-if", help="METRIC:THRESHOLD gate, e.g. prefix_cache_hit_rate:-0.01"),
    seed: int = typer.Option(0, help="Bootstrap seed."),
    top: int = typer.Option(10, help="Requests listed as most gained / lost."),
    resamples: int = typer.Option(1000, help="Bootstrap resamples for the latency CIs."),
):
    """Compare two runs of the same trace; exit 1 when a --fail-if gate is violated."""
    from kvtrace.compare.gates import check_fail_if
    from kvtrace.compare.render import render, to_json, to_markdown
    from kvtrace.compare.source import diff_runs

    d = diff_runs(db, run_a, run_b, force=force, seed=seed, top=top, resamples=resamples)
    if as_json:
        typer.echo(json.dumps(to_json(d), sort_keys=True))
    elif markdown:
        typer.echo(to_markdown(d))
    else:
        render(d)
    violated = check_fail_if(d, fail_if)
    for v in violated:
        _err(f"gate failed: {v}")
    if violated:
        raise typer.Exit(1)


@app.command()
def study(
    behaviour: str = typer.Argument(..., help="transient-checkpoint-retention | shared-prefix-pinning | external-hit-running-cow"),
    trace: Optional[str] = typer.Option(None, help="Trace to study (default: the behaviour's generated workload)."),
    db: Optional[Path] = typer.Option(None, help="Record both runs (and get per-request diffs)."),
    sweep: Optional[str] = typer.Option(None, help="PARAM=V1,V2,... over capacity_blocks, capacity_tokens, "
                                                   "external_capacity_blocks or retention."),
    limit: Optional[int] = typer.Option(None, help="Replay only the first N requests."),
    as_json: bool = typer.Option(False, "--json"),
    markdown: bool = typer.Option(False, "--markdown"),
    seed: int = typer.Option(0),
):
    """Run one trace with a behaviour on and off, and print the isolated diff."""
    from kvtrace.compare.study import run_study

    res = run_study(behaviour, trace=trace, db=db, sweep=sweep, seed=seed, limit=limit,
                    progress=sys.stderr.isatty())
    if as_json:
        typer.echo(json.dumps(res.to_json(), sort_keys=True))
    elif markdown:
        typer.echo(res.to_markdown())
    else:
        res.print()


@app.command()
def calibrate(
    sources: list[Path] = typer.Option(..., "--from", metavar="FILE",
                                       help="Step timings (.csv) or a `vllm bench serve --save-detailed` result (.json); "
                                            "repeatable."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", metavar="FILE.toml",
                                       help="Write the fitted model as a [cost_model] table for --config."),
    name: str = typer.Option("calibrated", help="Name of the fitted cost model."),
    experts: Optional[str] = typer.Option(None, "--moe", metavar="E:K",
                                          help="A mixture-of-experts model: E experts, K per token (fits the "
                                               "experts-touched term)."),
    knee: Optional[int] = typer.Option(None, help="Token knee of the piecewise token term (default: the best of "
                                                  "0, 256, 512, 1024, 2048)."),
    max_num_batched_tokens: int = typer.Option(8192, help="The served engine's chunk budget (bench results)."),
):
    """Fit a cost model to a real engine's measurements and print its error per term."""
    from kvtrace.engine.clock import CostModel
    from kvtrace.replay.calibrate import calibrate as fit, cost_model_toml, fit_report

    template = None
    if experts is not None:
        e, sep, k = experts.partition(":")
        if not sep or not e.isdigit() or not k.isdigit():
            raise KVTraceError(f"--moe: {experts}: expected E:K, e.g. 256:8")
        template = CostModel(name, 0, 0, 0, 0, 0, num_experts=int(e), experts_per_token=int(k))
    result = fit([str(p) for p in sources], name=name, template=template, knee=knee,
                 max_num_batched_tokens=max_num_batched_tokens)
    for line in fit_report(result):
        typer.echo(line)
    if out is not None:
        from kvtrace.workload.lines import AtomicText

        with AtomicText(out) as f:
            f.write(cost_model_toml(result.model).encode())
        _status(f"wrote {out} (use it with: kvtrace replay TRACE --config {out})")


@app.command()
def dashboard(
    db: Path = typer.Option(..., help="DuckDB file written by kvtrace."),
    port: int = typer.Option(8501),
    host: str = typer.Option("127.0.0.1", help="Bind address (localhost by default)."),
):
    """Open the Streamlit dashboard on a kvtrace DuckDB file."""
    from kvtrace.dashboard import launch

    if not db.exists():
        raise KVTraceError(f"{db}: no such database (run `kvtrace demo` or `kvtrace replay TRACE --db {db}`)")
    raise typer.Exit(launch(db, host=host, port=port))


@app.command()
def export(
    db: Path = typer.Option(...),
    run: str = typer.Option(..., help="Run id."),
    parquet: Path = typer.Option(..., help="Output directory."),
):
    """Export one run's spans and summary to Parquet."""
    from kvtrace.store import export_parquet

    paths = export_parquet(db, run, parquet)
    for p in paths:
        typer.echo(str(p))


@app.command()
def collect(
    db: Path = typer.Option(...),
    port: int = typer.Option(4318, help="OTLP/HTTP port (0: any free port)."),
    grpc_port: int = typer.Option(4317, help="OTLP/gRPC port, the SDKs' default protocol (0: any free port)."),
    grpc: bool = typer.Option(True, "--grpc/--no-grpc", help="Also serve OTLP/gRPC."),
    host: str = typer.Option("127.0.0.1"),
    max_body_bytes: int = typer.Option(16 * 1024 * 1024),
):
    """Receive OTLP traces (HTTP: protobuf or JSON on /v1/traces; gRPC) into the store."""
    from kvtrace.instrument.otlp import serve_collector

    def ready(c) -> None:
        grpc_part = f", OTLP/gRPC on {c.grpc_target}" if c.grpc_target else ""
        _status(f"kvtrace collect: OTLP/HTTP on {c.url}{grpc_part} -> {db} (Ctrl-C to stop)")

    collector = serve_collector(db, host=host, port=port, max_body_bytes=max_body_bytes,
                                grpc_port=grpc_port if grpc else None, on_ready=ready)
    _status(f"kvtrace collect: {collector.spans_received} spans stored, "
            f"{collector.requests_rejected} requests rejected")


@capture_app.command("vllm")
def capture_vllm_cmd(
    endpoint: str = typer.Option(..., help="vLLM KV-events PUB endpoint, e.g. tcp://127.0.0.1:5557"),
    db: Path = typer.Option(...),
    replay_endpoint: Optional[str] = typer.Option(None, help="vLLM replay ROUTER endpoint for gap recovery."),
    duration: Optional[float] = typer.Option(None, help="Stop after S seconds."),
    trace_out: Optional[Path] = typer.Option(None, help="Also reconstruct a native trace here."),
    dp_size: int = typer.Option(1, help="The server's --data-parallel-size: capture every rank, each at vLLM's "
                                        "per-rank endpoint (tcp port + rank)."),
):
    """Record a live vLLM server's KV events into the store."""
    from kvtrace.instrument.vllm import capture_vllm

    capture_vllm(endpoint, replay_endpoint=replay_endpoint, store_path=db, duration=duration, trace_out=trace_out,
                 dp_size=dp_size)


def main() -> None:
    try:
        rc = app(prog_name="kvtrace", standalone_mode=False)  # errors come back here, printed as one line
    except KVTraceError as e:
        _err(str(e))
        sys.exit(2)
    except typer.Abort:
        _err("interrupted")
        sys.exit(130)
    except typer.TyperException as e:  # a mistyped command line (typer's click errors): one line too
        ctx = getattr(e, "ctx", None)
        where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        message = e.format_message() if hasattr(e, "format_message") else str(e)
        _err(" ".join(f"{message}{where}".split()))
        sys.exit(getattr(e, "exit_code", 2))
    except KeyboardInterrupt:
        _err("interrupted")
        sys.exit(130)
    sys.exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    main()
