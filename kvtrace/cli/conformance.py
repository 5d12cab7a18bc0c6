"""``kvtrace conformance``: kvtrace's cache manager beside vLLM's own, request by request."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

import typer

from kvtrace.cli.application import app
from kvtrace.cli.options import Json, replay_options
from kvtrace.cli.output import echo_json


@app.command()
@replay_options(exclude=("mode", "policy", "capacity_blocks", "capacity_tokens", "name", "no_content", "percentiles",
                         "backend"),
                # (replay's texts spoke of cache-only mode and span ids: conformance has neither)
                helps={"block_size": "Tokens per KV block, at least 1 (default: the preset's).",
                       "seed": "Seed of a generated workload (0 to 2^64-1)."})
def conformance(
    spec,
    capacity_blocks: Annotated[list[int], typer.Option(
        "--capacity-blocks", metavar="BLOCKS", min=2,
        help="The block pool as vLLM counts it (num_gpu_blocks, the null block included), shared by every "
             "KV cache group; repeatable: one comparison per size (default: the preset's).")] = [],  # noqa: B006
    concurrency: Annotated[int, typer.Option(metavar="N", min=1, help="Requests in the system at once.")] = 8,
    max_output_tokens: Annotated[int, typer.Option(
        metavar="N", min=1, help="Output tokens per request: the trace's output length (at least 1), capped at N "
                                 "(each token after the first is a decode step).")] = 4,
    as_json: Json = False,
) -> None:
    """Drive kvtrace's cache manager and vLLM's own KVCacheManager with the same requests
    and compare them request by request; exit 1 on any disagreement, 2 without vLLM."""
    from kvtrace.replay.conformance import ConformanceSpec, format_report, run_conformance

    cspec = ConformanceSpec(
        spec.trace, preset=spec.preset, config_file=spec.config_file, trace_format=spec.trace_format,
        trace_block_size=spec.trace_block_size, block_size=spec.block_size,
        capacity_blocks=tuple(capacity_blocks) or (None,), retention=spec.retention, without=spec.without,
        limit=spec.limit, concurrency=concurrency, max_output_tokens=max_output_tokens,
        external_capacity_blocks=spec.external_capacity_blocks, seed=spec.seed,
    )
    if _cwd_deleted():
        # torch (its MKL: 'Intel oneMKL FATAL ERROR: Cannot load .../libtorch_cpu.so', exit 2) and
        # vLLM (torch._dynamo's getcwd(): 'vLLM does not import (... FileNotFoundError ...)') do not
        # import in a current directory deleted under the shell: loaded from / (a command of
        # absolute paths or gen:NAME works; a relative path is still told as 691226d tells it)
        from kvtrace.engine.backends.vllm._load import load_vllm

        with _in_the_root():
            load_vllm()
    result = run_conformance(cspec)
    if as_json:
        echo_json(result.as_dict())
    else:
        for line in format_report(result):
            typer.echo(line)
    if not result.agree:
        raise typer.Exit(1)


def _cwd_deleted() -> bool:
    try:
        os.getcwd()
    except FileNotFoundError:
        return True
    return False


@contextmanager
def _in_the_root() -> Iterator[None]:
    """In /, and back in the current directory (deleted, still open) after."""
    here = os.open(".", os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.chdir("/")
        yield
    finally:
        os.fchdir(here)
        os.close(here)
