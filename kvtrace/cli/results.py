"""Commands that read what was recorded: ``runs``, ``diff``, ``study``, ``demo``,
``export``, ``dashboard``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from kvtrace.cli.application import app
from kvtrace.cli.choices import BACKENDS, Backend, Behaviour, value
from kvtrace.cli.options import (
    STORE_HELP,
    Db,
    DbToRead,
    Json,
    Markdown,
    Percentiles,
    blank_name,
    dash_store,
    replay_options,
    rewritten_path_problem,
)
from kvtrace.cli.options import percentiles as parse_percentiles
from kvtrace.cli.output import (
    echo_json,
    error,
    one_format,
    print_rows,
    recorded,
    shell_path,
    shell_word,
    status,
    store_shown,
    tell_left_out,
)
from kvtrace.errors import ConfigError, KVTraceError
from kvtrace.metrics import backend_label, run_backend
from kvtrace.names import printable

DEFAULT_BACKEND = Backend(BACKENDS[0])
RUN_ID = Annotated[str, typer.Argument(metavar="RUN", help="A run id (see `kvtrace runs`).")]
# The headline metrics `kvtrace runs` shows, summary keys: the medians by the names every
# summary carries (vllm bench serve's), whatever --percentiles the run had.
RUNS_METRICS = ("requests", "prefix_cache_hit_rate", "median_ttft_ms", "median_itl_ms")
# On a terminal too narrow for every column, those left out first (the last of these first); run,
# name, status and prefix_cache_hit_rate always show. Each cell stays on one line, but a run's
# name, trace and behaviours (long text) fold.
RUNS_PRIORITY = ["trace", "mode", "capacity", "requests", "behaviours", "median_ttft_ms", "median_itl_ms",
                 "backend", "created"]
RUNS_FOLDED = frozenset({"name", "trace", "behaviours"})
# Runs its table shows by default: a terminal table of thousands is read by no one, and
# rich lays one out at about 3 ms a row (20,000 runs: a minute).
RUNS_SHOWN = 100


@app.command()
def runs(db: DbToRead, as_json: Json = False, limit: Annotated[int | None, typer.Option(
        metavar="N", help=f"List the newest N runs (0: all; default {RUNS_SHOWN} in the table, all with "
                                 "--json).")] = None) -> None:
    """List the runs in a store: id, name, trace, mode, backend, behaviours, capacity, status, headline metrics."""
    from kvtrace.compare.model import finite_number
    from kvtrace.compare.pairing import behaviours_on
    from kvtrace.dashboard.run_config import capacity
    from kvtrace.replay.report import format_value
    from kvtrace.store import read
    from kvtrace.store.errors import DAMAGED, StoreError
    from kvtrace.store.read.runs import DAMAGED_STATUS

    if limit is not None and limit < 0:  # (click's range check said "-1 is not in the range x>=0")
        raise ConfigError("--limit", str(limit), "expected a number of runs >= 0 (0: all)")
    stored = read.runs(db)  # (newest first)
    shown = stored.height if limit == 0 or (limit is None and as_json) else min(stored.height, limit or RUNS_SHOWN)
    listed = []
    for row in stored.head(shown).iter_rows(named=True):
        config = json.loads(row["config"]) if row["config"] else {}
        # (a run without a finished one, running, interrupted or failed: the keys of its spans, as
        # diff reads them; per run its own queries only: read.run_summary would list every run again)
        # (a damaged record: no numbers, its damage line says why)
        saved = json.loads(row["summary"]) if row["summary"] else None
        status_shown, damage = row["status"], row["damage"]
        if damage:
            summary = {}
        elif not row["num_spans"]:  # nothing to read back (50 ms a run: 3,000 failed runs took minutes)
            summary = dict(saved) if isinstance(saved, dict) else {}
        else:
            try:
                summary = read.summary_with_spans(db, row["run_id"], saved)
            except StoreError as err:  # (spans no run holds, a count near 2^63: listed damaged, as a record is)
                if not err.what.startswith(DAMAGED):
                    raise
                summary, status_shown, damage = {}, DAMAGED_STATUS, str(err)
        cap = capacity(config, summary) if isinstance(config, dict) else None
        config = config if isinstance(config, dict) else {}
        listed.append({
            "run_id": row["run_id"], "name": row["name"], "trace": row["trace_source"], "mode": row["mode"],
            "backend": run_backend(row["mode"], config),
            # which vLLM a --backend vllm run drove (None for kvtrace's): two checkouts, two runs
            "vllm_version": config.get("vllm_version"), "vllm_commit": config.get("vllm_commit"),
            # (the switched-on ones: a {name: on} record listed its off ones too)
            "behaviours": behaviours_on(row["behaviours"]) or [],
            # (an unbounded cache-only run has no capacity, but a block size all the same)
            # (else the summary's: a stopped cache-only run at its trace's block size, which its spans
            # never record, states its configured capacity there, as diff and the read API show it:
            # runs said "-" and null; one stopped before any span, its config's, which it states)
            "capacity_blocks": cap.blocks if cap else _stated_size(summary.get("capacity_blocks")) or (
                _stated_size(config.get("capacity_blocks")) if config.get("mode") == "cache-only" else None),
            "unbounded": config.get("mode") == "cache-only" and "capacity_blocks" in config
                         and config["capacity_blocks"] is None,
            "block_size": cap.block_size if cap else summary.get("block_size"),
            "status": status_shown, "created": row["created"], "spans": row["num_spans"],
            "damage": damage,  # (status damaged: what its record holds that kvtrace never writes)
            # (as diff reads them: a damaged record's Infinity read "inf%" here and null in --json)
            **{m: finite_number(summary.get(m)) for m in RUNS_METRICS},
        })
    shown_db = store_shown(db)  # (a server URL without its password, as every error names it)
    if as_json:
        echo_json({"db": shown_db, "runs": listed})
        if shown < stored.height:  # (stderr, as the table says it: --limit 2 left six runs out unsaid)
            status(f"{stored.height - shown:,} older runs not listed (--limit 0 lists all {stored.height:,})")
        return
    header = ["run", "name", "trace", "mode", "backend", "behaviours", "capacity", "status", "created", *RUNS_METRICS]
    rows = [header]
    for r in listed:
        size = f"{r['capacity_blocks']:,}×{r['block_size'] or '?'}" if r["capacity_blocks"] else "-"
        if r["unbounded"]:  # (as curve and sweep tables say it: "-" read as a capacity not recorded)
            size = f"unbounded×{r['block_size']}" if r["block_size"] else "unbounded"
        trace = Path(r["trace"]).name if r["trace"] else "-"  # (a collected run names none: not "None")
        backend = backend_label(r["mode"], r) or "-"  # (r holds backend, vllm_version and vllm_commit)
        rows.append([r["run_id"], r["name"] or "", trace, r["mode"] or "", backend,
                     ",".join(r["behaviours"]) or "-", size, r["status"], r["created"] or "",
                     *(format_value(m, r[m]) for m in RUNS_METRICS)])
    tell_left_out(print_rows(rows, title=f"runs in {shown_db}", left=9, priority=RUNS_PRIORITY, fold=RUNS_FOLDED))
    for r in listed:
        if r["damage"]:
            status(r["damage"])
    if shown < stored.height:
        status(f"{stored.height - shown:,} older runs not listed (--limit 0 lists all {stored.height:,})")


def _stated_size(value: object) -> int | None:
    """A summary's size where it is one (an int from 1 to 2^63-1), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1 << 63 else None


@app.command()
def diff(
    run_a: RUN_ID,
    run_b: RUN_ID,
    db: DbToRead,
    as_json: Json = False,
    markdown: Markdown = False,
    force: Annotated[bool, typer.Option(help="Compare runs of different traces anyway.")] = False,
    fail_if: Annotated[list[str], typer.Option(
        "--fail-if", metavar="METRIC:THRESHOLD",
        help="Exit 1 when METRIC changes by more than THRESHOLD (e.g. prefix_cache_hit_rate:-0.01); repeatable.")] = [],  # noqa: B006
    seed: Annotated[int, typer.Option(metavar="N", help="Bootstrap seed.")] = 0,
    top: Annotated[int, typer.Option(metavar="N", help="Requests listed as most gained / lost (0: none).")] = 10,
    resamples: Annotated[int, typer.Option(metavar="N", help="Bootstrap resamples for the latency CIs (100 to "
                                                             "10,000).")] = 1000,
    percentiles: Percentiles = None,
) -> None:
    """Compare two runs of the same trace; exit 1 when a --fail-if gate is violated."""
    one_format(as_json, markdown)
    from kvtrace.compare.options import check_diff_options

    check_diff_options(seed, top, resamples)  # (before the comparison's imports: told at once)
    pcts = parse_percentiles(percentiles)
    from kvtrace.compare.gates import check_fail_if, parse_gates
    from kvtrace.compare.render import render, to_json, to_markdown
    from kvtrace.compare.source import diff_runs

    parse_gates(fail_if)  # a malformed or repeated gate is a usage error: before any work or output
    d = diff_runs(db, run_a, run_b, force=force, seed=seed, top=top, resamples=resamples, percentiles=pcts)
    violated = check_fail_if(d, fail_if)  # an unknown metric is an error before any output
    if as_json:
        echo_json(to_json(d))
    elif markdown:
        typer.echo(to_markdown(d))
    else:
        render(d)
    for v in violated:
        error(f"gate failed: {v}")
    if violated:
        raise typer.Exit(1)


@app.command()
@replay_options(trace_option=True)
def study(
    spec,
    behaviour: Annotated[Behaviour, typer.Argument(
        metavar="BEHAVIOUR", help="The behaviour switched on and off: "
        + ", ".join(b.value for b in Behaviour) + ".", show_default=False)],
    sweeps: Annotated[list[str] | None, typer.Option(
        "--sweep", metavar="NAME=V1,V2,...", help="Repeat the pair for each value of one setting: capacity_blocks, "
                                                  "capacity_tokens, external_capacity_blocks or retention.")] = None,
    db: Db = None,
    as_json: Json = False,
    markdown: Markdown = False,
) -> None:
    """Replay one trace with a behaviour on and off, and print the isolated diff
    (default trace: the behaviour's generated workload and its settings)."""
    one_format(as_json, markdown)
    from kvtrace.compare.study import check_sweep_given_once, parse_sweep, run_study, study_base

    if sweeps and len(sweeps) > 1:  # (typer kept the last: a study sweeps one setting)
        raise ConfigError("--sweep", " ".join(sweeps), "given more than once; a study sweeps one setting")
    sweep = sweeps[0] if sweeps else None

    check_sweep_given_once(spec, sweep)  # (before the behaviour's workload and the replay engine load: told at once)
    name = value(behaviour)
    swept = parse_sweep(sweep)
    res = run_study(name, trace=spec.trace or None, db=db, sweep=sweep, seed=spec.seed,
                    progress=sys.stderr.isatty(), base=study_base(name, spec, swept[0] if swept else None))
    for p in res.points:
        recorded(p.run_off, db)
        recorded(p.run_on, db)
    if as_json:
        echo_json(res.to_json())
    elif markdown:
        typer.echo(res.to_markdown())
    else:
        res.print()


def _demo_store(db: str) -> str:
    # a str, not a Path: Path('clickhouse://u:p@h:8123/db') is 'clickhouse:/u:p@...', which was
    # refused as a name DuckDB would read as a URL (and Path('') is the current directory)
    if db == "":
        raise typer.BadParameter("expected a path, got an empty one")
    blank_name(db)
    dash_store(db)
    return db


@app.command()
def demo(
    db: Annotated[str, typer.Option(metavar="STORE", callback=_demo_store, help="Where to write the demo runs "
                                    f"(replaced), or a ClickHouse store to add them to: {STORE_HELP}.")]
        = "kvtrace-demo.duckdb",
    backend: Annotated[Backend, typer.Option(
        help="The cache manager of the all-on run: kvtrace's or the installed vLLM's (the runs with a behaviour "
             "off are kvtrace's: its switches are its own). vllm: every run on a 100-block pool, where vLLM 0.33 "
             "gets through its connector loads (README, Conformance).")] = DEFAULT_BACKEND,
) -> None:
    """Replay the built-in workload with every behaviour on and each off, and show the diffs."""
    from kvtrace.compare.options import demo_target
    from kvtrace.store.backend import is_clickhouse

    if not is_clickhouse(db):
        from kvtrace.errors import KVTraceError, read_only_problem

        problem = read_only_problem(db) or rewritten_path_problem(db)
        if problem is not None:  # (the new store's rename replaced it all the same)
            raise KVTraceError(f"{printable(db)}: {problem}")  # (a newline in it shown as \n, not a space)
        demo_target(db)  # (before the replay engine loads: a wrong --db is told at once)
    from kvtrace.compare.demo import run_demo
    from kvtrace.process import pyarrow_without_pandas

    pyarrow_without_pandas()
    run_demo(db_path=db, progress=True, backend=value(backend))


@app.command()
def export(
    db: DbToRead,
    run: Annotated[str, typer.Option(metavar="RUN", help="The run id (see `kvtrace runs`).")],
    parquet: Annotated[str, typer.Option(metavar="DIR", help="Output directory (created if missing).")],
) -> None:
    """Export a run to Parquet: spans, run record, evicted blocks.

    Writes DIR/spans.parquet, DIR/runs.parquet (the record, with its summary) and
    DIR/evicted_blocks.parquet, and prints their paths."""
    from kvtrace.store import export_parquet

    if not parquet.strip():  # a str, not a Path: Path('') is '.', the current directory
        # (named at its flag alone: the CLI's own "kvtrace: error:" says which command)
        raise ConfigError("--parquet", None,
                          "expected an output directory, got an empty path (say . for the current one)")
    if parquet == "-":  # (a folder named '-' was made, where every -o refuses '-' as no file name meant)
        raise ConfigError("--parquet", None, "-: not stdout here (an export is three files); name a directory, "
                                             "./- for one of that name")
    for p in export_parquet(db, run, parquet).values():
        typer.echo(printable(p))  # (one path a line: a newline in a name would read as two)


@app.command()
def dashboard(
    db: DbToRead,
    run: Annotated[str | None, typer.Option(metavar="RUN", help="Open on this run.")] = None,
    compare: Annotated[str | None, typer.Option(
        metavar="RUN", help="Open the Compare page: --run against this run (another run of the same trace).")]
        = None,
    port: Annotated[int, typer.Option(metavar="PORT", help="Port to serve on (0: a free one, printed).")] = 8501,
    host: Annotated[str, typer.Option(metavar="ADDRESS", help="Bind address (localhost by default).")]
        = "127.0.0.1",
) -> None:
    """Open the Streamlit dashboard on a kvtrace store."""
    from kvtrace.dashboard import check_address, launch
    from kvtrace.store.backend import is_clickhouse

    check_address(host, port)  # (before the store is read: a busy or wrong port is told at once)
    if is_clickhouse(db):  # attach to the collector's otel_traces, register and finish its runs
        from kvtrace.store import Store, read
        from kvtrace.store.backend import clickhouse_target

        if clickhouse_target(db).embedded:  # a chdb directory must hold a store already: never made here
            read.runs(db)
        Store.open(db).close()
    if compare is not None and run is None:
        raise KVTraceError("--compare needs --run: the run to compare it against")
    if compare is not None and compare == run:
        raise KVTraceError(f"--compare: {compare}: is --run too; the Compare page sets a run against another")
    if run is not None or compare is not None:  # told here, not as a page that finds no run
        from kvtrace.compare.pairing import same_trace
        from kvtrace.store import read

        rows = {r["run_id"]: r for r in read.runs(db).iter_rows(named=True)}
        shown = printable(db)  # (a newline in the path: \n, not a space naming another)
        for flag, value in (("--run", run), ("--compare", compare)):
            if value is not None and value not in rows:  # (a blank one quoted: ' ' read as no value at all)
                named = printable(value) if value.strip() else repr(value) if value else "(empty)"
                raise KVTraceError(f"{flag}: {named}: no such run in {shown} (`kvtrace runs --db {shell_path(db)}` "
                                   "lists them)")
        # (the page offers runs of --run's trace only, and none to a run that names no trace:
        # either was a page of one warning)
        if compare is not None and run is not None:
            anything = (f"(`kvtrace diff --db {shell_path(db)} --force -- {shell_word(run)} {shell_word(compare)}` "
                        "compares any two)")
            for flag, value in (("--run", run), ("--compare", compare)):
                if not rows[value].get("trace_digest") and rows[value].get("trace_source") is None:
                    raise KVTraceError(f"{flag}: {value}: names no trace (a collected run?), so the Compare page "
                                       f"knows no run of the same trace {anything}")
            if not same_trace(rows[run], rows[compare]):
                raise KVTraceError(f"--compare: {compare}: replays another trace than {run}; the Compare page sets "
                                   f"runs of one trace side by side {anything}")
    raise typer.Exit(launch(db, host=host, port=port, run=run, compare=compare))
