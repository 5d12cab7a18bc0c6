"""Options shared by several commands, declared once.

``replay_options`` gives a command every ``kvtrace replay`` setting of a run (preset,
config, mode, capacities, behaviours, ...) and hands it the resulting ``RunSpec`` as
``spec``, so ``replay``, ``sweep``, ``curve`` and ``study`` take the same flags with the
same help and the same checks.
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
from collections.abc import Callable
from typing import Annotated, Any, get_args

import typer

from kvtrace.cli.choices import BACKENDS, BEHAVIOURS, Backend, Behaviour, Mode, Policy, Preset, TraceFormat, value

RUN_PANEL = "Run settings"

# What every --db takes (kvtrace.store.backend): kept a string, a URL is no path.
STORE_HELP = "a DuckDB file, chdb:DIR (embedded ClickHouse) or clickhouse://USER:PASS@HOST:8123/DB"


def blank_name(path: str) -> None:
    """A usage error for a file name of spaces alone (`--db "$DB"`, a variable holding a space):
    the store or output was made under a name no line can show ("recorded in  ")."""
    if path and not path.strip():
        raise typer.BadParameter(f"{path!r}: expected a path, got a blank one")


def _store_to_write(db: str | None) -> str | None:
    # checked while parsing, before the command imports duckdb or the receivers: a typo is
    # told at once (the open checks it again, and what it cannot see without opening)
    from kvtrace.errors import KVTraceError
    from kvtrace.names import printable
    from kvtrace.store.backend import store_to_write_problem

    if db is None:
        return None
    blank_name(db)
    dash_store(db)
    problem = store_to_write_problem(db) or rewritten_path_problem(db)
    if problem is not None:  # (the path as typed: a newline in it shown as \n, not joined into a space)
        raise KVTraceError(f"{printable(db) if db else repr(db)}: {problem}")
    return db


def dash_store(db: str) -> None:
    """``-`` is no store a user means (a store is a file, never stdin or stdout): a DuckDB
    store named '-' was made in the current directory ('run r1 recorded in -', exit 0), as
    161b718 found of --parquet -; ``./-`` names such a file."""
    from kvtrace.errors import KVTraceError

    if db == "-":
        raise KVTraceError("--db: -: not stdin or stdout here (a store is a file); name one, ./- for a file of "
                           "that name")


def rewritten_path_problem(db: str, writing: bool = True) -> str | None:
    """``store.connection.rewritten_path_problem`` of a DuckDB store (a leading '~', a '\\', a
    '?' in the folder of one to write: DuckDB would open or log elsewhere), duckdb loaded only
    where one of them is."""
    from kvtrace.store.backend import is_clickhouse

    if is_clickhouse(db) or not (db.startswith("~") or "\\" in db or any(c in os.path.realpath(db) for c in "?\\")):
        return None
    from kvtrace.store.connection import rewritten_path_problem as problem

    return problem(db, writing)


# A store a command writes into: created when missing.
Db = Annotated[str | None, typer.Option(metavar="STORE", callback=_store_to_write,
                                        help=f"Store to record the run(s) into: {STORE_HELP}.")]
DbRequired = Annotated[str, typer.Option(metavar="STORE", callback=_store_to_write,
                                         help=f"Store written by kvtrace: {STORE_HELP}.")]


def _existing_store(db: str) -> str:
    # checked while parsing, before the command imports duckdb: a typo is told at once
    from kvtrace.cli.output import shell_word
    from kvtrace.errors import KVTraceError, file_problem
    from kvtrace.names import printable
    from kvtrace.store.backend import is_clickhouse, url_like_problem

    if is_clickhouse(db):
        return db
    if not db:
        raise KVTraceError("--db: expected a store path, got an empty one")
    dash_store(db)
    shown = printable(db)  # (as typed: a newline in the path shown as \n, not joined into a space)
    # (md:foo, s3://...: told as the writer tells it; its "kvtrace replay --db md:foo" hint was refused)
    problem = url_like_problem(db) or rewritten_path_problem(db, writing=False) or file_problem(
        db, missing=f"no such database (run `kvtrace demo` or `kvtrace replay TRACE --db {shell_word(db)}`)")
    if problem is not None:
        raise KVTraceError(f"{shown}: {problem}")
    return db


# A store a command reads: a DuckDB path must exist.
DbToRead = Annotated[str, typer.Option("--db", metavar="STORE", callback=_existing_store,
                                       help=f"Store written by kvtrace: {STORE_HELP}.")]


def typed_path(path: str | None) -> str | None:
    # a str, not a Path: Path('run.toml/') is 'run.toml', read as the config although the name
    # typed is no file, and every error named the path Path made, not the one typed
    if path == "":
        raise typer.BadParameter("expected a path, got an empty one")
    return path


def typed_paths(paths: list[str] | None) -> list[str] | None:
    """``typed_path`` of each value of a repeatable option."""
    for path in paths or ():
        typed_path(path)
    return paths


def output_file(path: str | None) -> str | None:
    """An output file's path as typed (a ``Path`` would drop the trailing slash of ``NAME/``,
    which the writer, ``AtomicText``, refuses); ``-`` is no file name a user means."""
    if path is None:
        return None
    if path == "":
        raise typer.BadParameter("expected a path, got an empty one")
    if path == "-":
        raise typer.BadParameter("-: not taken as stdout here; say /dev/stdout")
    blank_name(path)
    return path


def _run_name(name: str | None) -> str | None:
    # '' ran under the default name as if no --name was given, and ' ' stored a name no table shows
    if name is not None and not name.strip():
        raise typer.BadParameter(f"{name!r}: expected a run name (without --name, one is made from the settings)")
    return name


Json = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")]
Markdown = Annotated[bool, typer.Option("--markdown", help="Print Markdown (for a pull request).")]
Seed = Annotated[int, typer.Option(metavar="N", help="Seed of the generated workload (0 to 2^64-1).")]

# name -> (annotation, default, RunSpec field); the order is --help's order.
_RUN_OPTIONS: dict[str, tuple[Any, Any, str]] = {
    "preset": (Annotated[Preset | None, typer.Option(
        help="Engine and cache preset (engine mode; default kimi-hybrid).", rich_help_panel=RUN_PANEL)],
        None, "preset"),
    "config": (Annotated[str | None, typer.Option(
        "--config", metavar="FILE.toml", callback=typed_path, help="TOML settings overriding the "
        "preset (engine mode); a flag beside it overrides the key it sets (--without adds to the file's without).",
        rich_help_panel=RUN_PANEL)], None, "config_file"),
    "mode": (Annotated[Mode, typer.Option(
        help="engine: scheduler, worker and modelled time; cache-only: the cache alone.",
        rich_help_panel=RUN_PANEL)], Mode("engine"), "mode"),
    "backend": (Annotated[Backend, typer.Option(
        help="Whose cache manager the engine drives: kvtrace's, or the installed vLLM's own KVCacheManager "
             "(engine mode; kvtrace's scheduler, content checks, clock and spans around it).",
        rich_help_panel=RUN_PANEL)], Backend(BACKENDS[0]), "backend"),
    "policy": (Annotated[Policy, typer.Option(
        help="Cache-only eviction policy (belady: the offline bound, MIN).", rich_help_panel=RUN_PANEL)],
        Policy("lru"), "policy"),
    "fmt": (Annotated[TraceFormat | None, typer.Option(
        "--format", help="Trace format (default: detected).", rich_help_panel=RUN_PANEL)], None, "trace_format"),
    "trace_block_size": (Annotated[int | None, typer.Option(
        metavar="TOKENS", min=1, help="Tokens per hash id of a Mooncake, Bailian or Azure trace, whose files do "
        "not say (default 512, 16, 16).", rich_help_panel=RUN_PANEL)], None, "trace_block_size"),
    "block_size": (Annotated[int | None, typer.Option(
        metavar="TOKENS", help="Tokens per KV block, at least 1 (default: the preset's; cache-only: the trace's "
        "tokens per hash id, 16 for a trace of token ids alone).", rich_help_panel=RUN_PANEL)],
        None, "block_size"),
    "capacity_blocks": (Annotated[str | None, typer.Option(
        metavar="BLOCKS|inf", help="GPU KV blocks as vLLM's num_gpu_blocks counts them: at least 2, the null "
        "block included (default: the preset's). Cache-only mode: at least 1; omit it, or say inf, for an "
        "unbounded cache (the infinite-cache hit rate; nothing is evicted, and the pool holds the trace's "
        "distinct blocks, nothing preallocated beyond them).",
        rich_help_panel=RUN_PANEL)], None, "capacity_blocks"),
    "capacity_tokens": (Annotated[int | None, typer.Option(
        metavar="TOKENS", help="Capacity in tokens, at least 1, converted to blocks (instead of --capacity-blocks; "
        "engine mode: the shared pool, that many tokens' blocks for each attention group and the null block, "
        "Mamba states included; cache-only mode needs --block-size with it).", rich_help_panel=RUN_PANEL)],
        None, "capacity_tokens"),
    "retention": (Annotated[str | None, typer.Option(
        metavar="none|0|K", help="Retention interval of sliding-window and Mamba groups (engine mode): none (dense), 0 "
        "(latest-only) or every K tokens, K a multiple of the block size.",
        rich_help_panel=RUN_PANEL)], None, "retention"),
    "external_blocks": (Annotated[int | None, typer.Option(
        metavar="BLOCKS", help="Add an external (connector) tier of this many blocks, at least 1 (engine mode).",
        rich_help_panel=RUN_PANEL)],
        None, "external_capacity_blocks"),
    "without": (Annotated[list[Behaviour], typer.Option(
        "--without", metavar="BEHAVIOUR", rich_help_panel=RUN_PANEL,
        help=f"Switch a behaviour off (repeatable): {', '.join(BEHAVIOURS)}.")], [], "without"),
    "limit": (Annotated[int | None, typer.Option(
        metavar="N", help="Replay only the first N requests, N >= 1 (default: all).", rich_help_panel=RUN_PANEL)],
        None, "limit"),
    "seed": (Annotated[int, typer.Option(
        metavar="N", help="Seed for generated workloads and span ids (0 to 2^64-1).", rich_help_panel=RUN_PANEL)],
        0, "seed"),
    "name": (Annotated[str | None, typer.Option(
        metavar="TEXT", callback=_run_name, help="Run name stored with the run (a cache-only curve stores none: "
        "refused there).", rich_help_panel=RUN_PANEL)], None, "name"),
    "no_content": (Annotated[bool, typer.Option(
        "--no-content", help="Engine mode without device content, sampling checks or stale-hash audits: hits and "
        "timings only, several times faster.", rich_help_panel=RUN_PANEL)], False, "content"),
    "percentiles": (Annotated[str | None, typer.Option(
        metavar="P1,P2,...", help="Latency percentiles of the summary, each 0 to 100, as vllm bench serve's "
                                  "--metric-percentiles (default 50,90,99).", rich_help_panel=RUN_PANEL)],
        None, "percentiles"),
}
# vllm bench serve's spelling of the same option (the --percentiles flag is kvtrace's)
Percentiles = Annotated[str | None, typer.Option(
    metavar="P1,P2,...", help="Latency percentiles, each 0 to 100, as vllm bench serve's --metric-percentiles "
    "(default 50,90,99).")]


def percentiles(text: str | None) -> tuple[float, ...]:
    """--percentiles 50,90,99 -> (50.0, 90.0, 99.0); one-line error naming the flag."""
    from kvtrace.errors import ConfigError
    from kvtrace.metrics import parse_percentiles
    from kvtrace.names import cut_middle

    # (at most metrics.MAX_PERCENTILES: the read API summarises a stopped run's latencies at its
    # own percentiles, and `runs` and `diff` of a store holding a killed run of 2,001 failed)
    try:
        return parse_percentiles(text)
    except ValueError as err:
        raise ConfigError("--percentiles", cut_middle(str(text), 200), str(err)) from None

TRACE_HELP = "Trace file (or a directory of WEKA files), or gen:NAME for a generated workload."


def _trace_named(trace: str | None) -> str | None:
    # '' named no file (": no such file or directory"), and a study took --trace '' for no
    # --trace at all: its default workload replayed without a word
    if trace == "":
        raise typer.BadParameter("expected a trace file, a directory of WEKA files or gen:NAME, got an empty one")
    return trace


def replay_options(fn: Callable[..., Any] | None = None, *, trace_option: bool = False,
                   exclude: tuple[str, ...] = (), defaults: dict[str, Any] | None = None,
                   helps: dict[str, str] | None = None) -> Any:
    """Add the run settings and TRACE to ``fn``'s options; call it with ``spec=RunSpec(...)``
    in their place. ``trace_option``: TRACE is an optional ``--trace`` (None when not
    given); ``exclude``: settings the command does not take; ``defaults``: other defaults;
    ``helps``: another help text for a setting (one that means less in this command)."""
    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        own = [p for name, p in inspect.signature(fn, eval_str=True).parameters.items() if name != "spec"]
        if trace_option:
            trace = inspect.Parameter("trace", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[
                str | None, typer.Option(metavar="TRACE", help=TRACE_HELP, callback=_trace_named,
                                         rich_help_panel=RUN_PANEL)])
        else:
            trace = inspect.Parameter("trace", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                      annotation=Annotated[str, typer.Argument(
                                          metavar="TRACE", help=TRACE_HELP, callback=_trace_named)])
        taken = {k: v for k, v in _RUN_OPTIONS.items() if k not in exclude}
        added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                                   annotation=_helped(ann, (helps or {}).get(name)),
                                   default=(defaults or {}).get(name, default))
                 for name, (ann, default, _) in taken.items()]
        positional = [p for p in own if p.default is inspect.Parameter.empty]
        optional = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
                    for p in own if p.default is not inspect.Parameter.empty]
        params = [*positional, trace, *optional, *added] if trace_option else [trace, *positional, *optional, *added]

        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            return fn(spec=run_spec(kwargs.pop("trace"), {k: kwargs.pop(k) for k in taken}), **kwargs)

        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        del command.__wrapped__  # typer must read the signature above, not fn's
        return command

    return decorate(fn) if fn is not None else decorate


def _helped(annotation: Any, help_text: str | None) -> Any:
    """``Annotated[T, typer.Option(...)]`` with another help text (None: as it is)."""
    if help_text is None:
        return annotation
    kind, info = get_args(annotation)
    info = copy.copy(info)
    info.help = help_text
    return Annotated[kind, info]


def run_spec(trace: str, options: dict[str, Any]):
    """The RunSpec for TRACE and the run settings (keyed as in ``_RUN_OPTIONS``); a
    study without --trace gets ``trace=""``."""
    from kvtrace.errors import check_limit
    from kvtrace.replay.run import RunSpec, parse_capacity_blocks

    fields = {_RUN_OPTIONS[k][2]: value(v) for k, v in options.items()}
    if "content" in fields:
        fields["content"] = not fields["content"]  # the flag is --no-content
    if "capacity_blocks" in fields:
        fields["capacity_blocks"] = parse_capacity_blocks(fields["capacity_blocks"])
    if "without" in fields:
        fields["without"] = tuple(fields["without"] or ())
    if "percentiles" in fields:
        fields["percentiles"] = percentiles(fields["percentiles"])
    if "limit" in fields:  # (before the trace is opened: its reader named the flag `limit`)
        check_limit(fields["limit"])
    return RunSpec(trace="" if trace is None else str(trace), **fields)
