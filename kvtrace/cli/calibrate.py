"""``kvtrace calibrate``: fit the engine's cost model to a real engine's measurements."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvtrace.cli.application import app
from kvtrace.cli.options import output_file, typed_paths
from kvtrace.cli.output import is_stdout, shell_word, status
from kvtrace.errors import KVTraceError, check_option


@app.command()
def calibrate(
    sources: Annotated[list[str], typer.Option(  # (str: a Path made clickhouse:/h of clickhouse://h)
        "--from", metavar="FILE", callback=typed_paths,
        help="Step timings (.csv), a `vllm bench serve --save-detailed` result (.json), or a kvtrace store "
             "(.duckdb, chdb:DIR or clickhouse://...) of vLLM's request spans received by `kvtrace collect`; "
             "repeatable.")],
    out: Annotated[str | None, typer.Option(
        "--out", "-o", metavar="FILE.toml", callback=output_file,
        help="Write the fitted model as a [cost_model] table for --config.")]
        = None,
    name: Annotated[str, typer.Option(metavar="TEXT", help="Name of the fitted cost model.")] = "calibrated",
    experts: Annotated[str | None, typer.Option(
        "--moe", metavar="E:K",
        help="A mixture-of-experts model: E experts, K per token (fits the experts-touched term).")] = None,
    knee: Annotated[int | None, typer.Option(
        metavar="TOKENS", help="Token knee of the piecewise token term, 0 to 2^31 (default: the best of 0, 256, "
                               "512, 1024, 2048).")] = None,
    max_num_batched_tokens: Annotated[int, typer.Option(
        metavar="TOKENS", help="The served engine's chunk budget, 1 to 2^31 (bench results and spans).")] = 8192,
    run: Annotated[str | None, typer.Option(
        metavar="RUN", help="The collected run of a store (default: its only one).")] = None,
) -> None:
    """Fit a cost model to a real engine's measurements; print its error per kind of measurement and each term."""
    from kvtrace.engine.clock import CostModel
    from kvtrace.replay.calibrate import calibrate as fit
    from kvtrace.replay.calibrate import cost_model_toml, fit_report
    from kvtrace.workload.lines import MAX_TOKENS, AtomicText

    check_option("--max-num-batched-tokens", max_num_batched_tokens, 1, MAX_TOKENS)
    if knee is not None:
        check_option("--knee", knee, 0, MAX_TOKENS)
    from kvtrace.engine.clock import COST_MODELS, MAX_EXPERTS
    from kvtrace.names import printable

    # the name goes into the TOML that --config reads back, which needs one it can use
    if not name.strip() or printable(name) != name:
        raise KVTraceError(f"--name: {name!r}: expected a name of printable text")
    if name in COST_MODELS:
        raise KVTraceError(f"--name: {name}: is a built-in cost model's name; choose another for a fitted one")
    template = None
    if experts is not None:
        e, sep, k = experts.partition(":")
        digits = lambda s: s.isascii() and s.isdigit() and len(s) <= 9  # ('²'.isdigit() holds)
        if not sep or not digits(e) or not digits(k) or not 1 <= int(k) <= int(e) <= MAX_EXPERTS:
            raise KVTraceError(f"--moe: {printable(experts)}: expected E:K with 1 <= K < E <= {MAX_EXPERTS:,}, "
                               "e.g. 256:8")
        if int(k) == int(e):  # (the fit said only that it "cannot tell step_overhead_ns and moe_expert_ns apart")
            raise KVTraceError(f"--moe: {experts}: with K = E every step touches all {int(e):,} experts, a constant "
                               "the step overhead already holds; expected K < E")
        template = CostModel(name, 0, 0, 0, 0, 0, num_experts=int(e), experts_per_token=int(k))
    if out is not None:  # before the fit: a store or an input there is refused at once
        AtomicText(out, sources).check()
        if not _a_stream(out):  # (-o /dev/stdout >> log: appended through the descriptor, nothing replaced)
            _refuse_a_run_config(out)
    result = fit([str(p) for p in sources], name=name, template=template, knee=knee,
                 max_num_batched_tokens=max_num_batched_tokens, run_id=run)
    # (-o /dev/stdout: the report went into the TOML beside the model, which --config then refused)
    to_stdout = out is not None and is_stdout(out)
    for line in fit_report(result):
        status(line) if to_stdout else typer.echo(line)
    if out is not None:
        from kvtrace.engine.clock import free_step_problem

        problem = free_step_problem(result.model)  # (what --config refuses: not written to be refused)
        if problem is not None:
            raise KVTraceError(f"-o {printable(out)}: not written: {problem}; these measurements priced no step "
                               "overhead and no token (--config would refuse the model)")
        with AtomicText(out, sources) as f:
            f.write(cost_model_toml(result.model).encode())
        if to_stdout:
            status("wrote the cost model to stdout (save it as a file and use it with: kvtrace replay TRACE --config "
                   "FILE.toml)")
        elif _a_stream(out) or not Path(out).is_file():  # (-o /dev/null, /dev/stderr or a FIFO: "--config
            # /dev/null" read nothing back)
            status(f"wrote the cost model to {out} (not a file: save it to one to use it with --config)")
        else:
            status(f"wrote {out} (use it with: kvtrace replay TRACE --config {shell_word(out)})")


def _a_stream(out: str) -> bool:
    """Whether ``out`` is written in place as a stream (``AtomicText``'s rule: a descriptor's
    name, a device, a FIFO, a socket), so nothing there is replaced. What the path is, not how its
    name starts: a run config under /dev/shm, or one named while stdout was redirected onto it,
    was replaced whole as "not a file"; /dev/stdin, a file's link, renamed over it."""
    from kvtrace.workload.lines import writes_in_place

    return writes_in_place(str(out))


def _refuse_a_run_config(out: str) -> None:
    """KVTraceError when ``out`` is a --config file holding settings besides a [cost_model]
    table: the fitted model replaced it whole (its preset, [cache] and [scheduler] lost
    without a word). One of cost_model alone (an earlier fit) is replaced as -o does."""
    import os
    import tomllib

    from kvtrace.names import cut_middle, printable
    from kvtrace.replay.config_file import MAX_CONFIG_BYTES
    from kvtrace.workload.lines import without_bom

    try:
        if not os.path.isfile(out) or os.path.getsize(out) == 0:  # (a FIFO is never opened)
            return
        if os.path.getsize(out) > MAX_CONFIG_BYTES:
            raise ValueError("larger than a config file")
        with open(out, "rb") as f:
            doc = tomllib.loads(without_bom(f.read()).decode("utf-8"))
    except OSError:
        return  # (unreadable: the write below says what it can of it)
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError, ValueError) as err:
        # a run config with a typo, a trace, a measurements file: replaced without a word
        why = cut_middle(str(err).splitlines()[0] if str(err) else type(err).__name__, 80)
        raise KVTraceError(f"{printable(out)}: exists and is no cost-model TOML ({why}), which the fitted model "
                           "would replace whole; write it elsewhere, or remove it first") from None
    other = sorted(set(doc) - {"cost_model"})
    if other:
        keys = cut_middle(", ".join(printable(k) for k in other), 120)
        raise KVTraceError(f"{printable(out)}: a --config file with settings besides [cost_model] ({keys}), which "
                           "the fitted model would replace whole; write it elsewhere (and copy its [cost_model] "
                           "table in)")
