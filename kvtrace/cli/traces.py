"""Commands that write traces: ``generate``, ``convert``."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from kvtrace.cli.application import app
from kvtrace.cli.choices import GeneratedFormat, TraceFormat, Workload, value
from kvtrace.cli.options import Seed, output_file, typed_path
from kvtrace.cli.output import status

Out = Annotated[str, typer.Option("--out", "-o", metavar="FILE", callback=output_file, help="Output trace file.")]


@app.command()
def generate(
    out: Out,
    workload: Annotated[Workload, typer.Argument(
        metavar="[WORKLOAD]", help="The generated workload: " + ", ".join(w.value for w in Workload) + ".")]
        = "mixed",
    fmt: Annotated[GeneratedFormat, typer.Option("--format", help="Output format.")]
        = "native",
    seed: Seed = 0,
    num_requests: Annotated[int | None, typer.Option(
        "--requests", metavar="N", help="Number of requests, 1 to 1,000,000 (default: the workload's).")] = None,
) -> None:
    """Write a seeded synthetic workload."""
    from kvtrace.replay.generate import write_generated

    n = write_generated(value(workload), out, fmt=value(fmt), seed=seed, num_requests=num_requests)
    status(f"wrote {n} request{'' if n == 1 else 's'} to {out}")


@app.command()
def convert(
    trace: Annotated[str, typer.Argument(metavar="TRACE", callback=typed_path, help="Any supported trace.")],
    out: Annotated[str, typer.Option("--out", "-o", metavar="FILE", callback=output_file,
                                     help="Output kvtrace native JSONL.")],
    fmt: Annotated[TraceFormat | None, typer.Option(
        "--format", help="Input format (default: detected).")] = None,
    limit: Annotated[int | None, typer.Option(
        metavar="N", help="Convert only the first N requests (at least 1).")] = None,
    trace_block_size: Annotated[int | None, typer.Option(
        metavar="TOKENS", min=1, help="Tokens per hash id of a Mooncake, Bailian or Azure trace (default 512, 16, "
                                      "16).")]
        = None,
) -> None:
    """Convert any supported trace to kvtrace native JSONL."""
    from kvtrace.errors import check_limit
    from kvtrace.replay.readers import open_trace
    from kvtrace.workload.native import write_native

    check_limit(limit)
    if trace.startswith("gen:") and not os.path.lexists(trace):  # (replay's generated workload: no file here)
        from kvtrace.errors import TraceFormatError
        from kvtrace.names import WORKLOADS

        # (kvtrace's own workload names only: "gen:$(touch x)" was pasted into the hint as it was)
        name = trace[4:] if trace[4:] in WORKLOADS else "NAME"
        raise TraceFormatError(trace, None, "a generated workload, not a trace file; write it with "
                                            f"`kvtrace generate {name} -o FILE`")
    source = open_trace(trace, format=value(fmt), limit=limit, block_size=trace_block_size)
    inputs = [trace, *source.files]  # (a directory trace: each of its files is an input too)
    if source.format == "weka" and os.path.isdir(trace):
        _refuse_an_output_in_the_folder(trace, out)
    kept = None
    if source.format == "native":  # its header's metadata (generator, seed, block sizes) was dropped
        from kvtrace.replay.readers import native_header

        kept = dict(native_header(trace))
        # the header's own source is what this file is now: its source becomes converted_from,
        # and where it was converted already, the first source stays (a third conversion named
        # the second file and lost the trace it all came from). Conversions are lossless and a
        # --limit keeps a prefix, so what is kept of the first source is the smallest limit
        limits = []
        for key in ("converted_from_limit", "source_limit"):
            if key in kept:
                given = kept.pop(key)
                if isinstance(given, bool) or not isinstance(given, int) or given < 1:  # (free metadata: any JSON)
                    from kvtrace.errors import TraceFormatError
                    from kvtrace.names import cut_middle

                    raise TraceFormatError(trace, 1, f"header {key}: expected a number of requests >= 1, "
                                                     f"got {cut_middle(repr(given), 60)}")
                limits.append(given)
        if "source" in kept:
            source_was = kept.pop("source")
            kept.setdefault("converted_from", source_was)
        if limits:
            kept["converted_from_limit"] = min(limits)
    if source.holds_more():  # the header's source names the whole file; these are its first N requests
        kept = {**(kept or {}), "source_limit": limit}
        if limit is not None and "converted_from" in kept:  # a prefix of the first source too: at most N of
            # its requests (it said the earlier cut's count, or none, of a file that holds fewer)
            kept["converted_from_limit"] = min(kept.get("converted_from_limit", limit), limit)
    n = write_native(source, out, header=kept, sources=inputs)
    status(f"wrote {n} request{'' if n == 1 else 's'} to {out}")  # stderr: `-o /dev/stdout` gets the trace alone


def _refuse_an_output_in_the_folder(folder: str, out: str) -> None:
    """An output that would be one of the WEKA folder's own files (``-o DIR/all.json``): it
    was written, exit 0, and every later read of the folder refused it (a native JSONL is no
    conversation), the input trace broken by its own conversion."""
    from kvtrace.errors import KVTraceError
    from kvtrace.names import printable
    from kvtrace.replay.readers.weka import read_in_folder

    real = os.path.realpath(out)  # (one there already is an input, which the writer refuses as such)
    if (not os.path.lexists(real) and os.path.dirname(real) == os.path.realpath(folder)
            and read_in_folder(os.path.basename(real))):
        raise KVTraceError(f"{printable(out)}: would be a file of the WEKA folder {printable(folder)} it is converted "
                           "from, read with its conversations from then on; write the output elsewhere (or name it "
                           "*.jsonl)")
