"""``kvtrace demo``: the main job on the embedded default workload, no input, no network.

Replays the built-in ``mixed`` workload with ``kimi-hybrid`` four times into one store —
all behaviours on, then each of the three switched off — and prints the runs side by side
and, per behaviour, the isolated diff (A = that behaviour off, B = all on: what it buys).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvtrace.compare.model import RunDiff
from kvtrace.compare.options import demo_target
from kvtrace.compare.render import render
from kvtrace.compare.source import diff_runs
from kvtrace.compare.study import BEHAVIOURS
from kvtrace.errors import ConfigError, KVTraceError, wal_path
from kvtrace.metrics import backend_label, times_source
from kvtrace.names import printable, shell_path, shown_value, stdout_console
from kvtrace.process import pid_after, remove_dead_leftovers, signals_held, stop_exception
from kvtrace.replay.report import format_value
from kvtrace.replay.run import RunResult, RunSpec, run_replay
from kvtrace.store import read
from kvtrace.store.backend import check_db_type, is_clickhouse
from kvtrace.store.connection import check_store, read_connection, write_connection
from kvtrace.store.layout import foreign_relations
from kvtrace.store.schema import SUMMARY_FIELDS
from kvtrace.store.writer import Store

DEMO_DB = "kvtrace-demo.duckdb"
DEMO_TRACE = "gen:mixed"
DEMO_PRESET = "kimi-hybrid"
# A small GPU pool (40 blocks of 512 tokens, shared by the groups) in front of an external tier, so
# that a workload of seconds puts the cache under the pressure a production server sees:
# evictions, external hits and re-prefills happen, and the behaviours have work to do.
DEMO_SETTINGS: dict[str, Any] = {"capacity_blocks": 40, "external_capacity_blocks": 4096}
# vLLM 0.33 allocates a connector load's Mamba blocks without counting them in its free-block
# check: on the 40-block pool it runs out mid-allocation (a ValueError; README, Conformance),
# so a demo through it runs all four replays on a pool it gets through
VLLM_DEMO_SETTINGS: dict[str, Any] = {**DEMO_SETTINGS, "capacity_blocks": 100}


def demo_settings(backend: str = "kvtrace") -> dict[str, Any]:
    """The settings every replay of a demo through ``backend``'s all-on run shares."""
    if not isinstance(backend, str):  # (an array's == "vllm": its truth ValueError; a caller's __eq__ that raises)
        raise ConfigError("--backend", shown_value(backend), "expected a string")
    return VLLM_DEMO_SETTINGS if backend == "vllm" else DEMO_SETTINGS


ALL_ON = "all on"


def demo_specs(trace: str = DEMO_TRACE, *, seed: int = 0, limit: int | None = None,
               backend: str = "kvtrace") -> list[RunSpec]:
    """The four runs: all behaviours on (through ``backend``), then each one off (kvtrace's
    manager: the switches are kvtrace's)."""
    all_on = RunSpec(trace=trace, preset=DEMO_PRESET, seed=seed, limit=limit, name=f"demo: {ALL_ON}",
                     backend=backend, **demo_settings(backend))
    return [all_on] + [replace(all_on, without=(b,), name=f"demo: without {b}", backend="kvtrace")
                       for b in BEHAVIOURS]


@dataclass(slots=True)
class DemoResult:
    db_path: str
    runs: list[tuple[RunSpec, RunResult]] = field(default_factory=list)
    diffs: dict[str, RunDiff] = field(default_factory=dict)  # behaviour -> (off vs all on)

    @property
    def dashboard_command(self) -> str:
        return f"kvtrace dashboard --db {shell_path(self.db_path)}"


def run_demo(
    db_path: str | os.PathLike[str] = DEMO_DB,
    progress: bool = True,
    console: Any = None,
    *,
    trace: str = DEMO_TRACE,
    seed: int = 0,
    limit: int | None = None,
    backend: str = "kvtrace",
) -> DemoResult:
    """Run the demo into ``db_path``, replacing an earlier demo store there only once the new
    one is complete (built beside it, then renamed over it: an interrupted or failed demo
    leaves the old store as it was, and nothing of its own). A symbolic link is written
    through; anything else that is not an earlier demo store is refused before any replay."""
    check_db_type(db_path)  # (str() of 0 or None named a store in the current directory)
    # (progress of None or "no" ran as a flag's truth, an array's a ValueError; a console that
    # is none an AttributeError once the whole demo was recorded, one whose truth raises, that)
    if not isinstance(progress, bool):
        raise ConfigError("progress", shown_value(progress), "expected True or False")
    if console is not None and not callable(getattr(console, "print", None)):
        raise ConfigError("console", shown_value(console), "expected a rich Console, or None")
    console = console if console is not None else stdout_console()
    db = str(db_path)
    specs = demo_specs(trace, seed=seed, limit=limit, backend=backend)
    if is_clickhouse(db):  # a server's or chdb's tables: the runs are added, nothing is replaced
        Store.open(db).close()  # (reachable, and a store, before the progress bar starts)
        result = _replay_all(db, db, specs, seed, progress)
    else:
        target = _demo_target(db)  # refused before any replay: a FIFO, a device, another's store...
        with _beside(target) as building:  # the old store stays as it was until the new one is whole
            result = _replay_all(db, building, specs, seed, progress)
            # again: another command may have recorded a run there while the demo ran (the
            # rename would drop it); the new store then stays unplaced and the old one as it is
            _demo_target(db)
            _replace(building, target)
    console.print(summary_table(result))
    # (README: every view that shows a latency names the cost model that modelled it; the
    # demo's tables showed TTFT and ITL with neither, where kvtrace diff of its runs says both)
    console.print(runs_times_note(result), markup=False, highlight=False)
    backends = runs_backend_note(result)  # (--backend vllm: the all-on column is vLLM's manager)
    if backends:
        console.print(backends, markup=False, highlight=False)
    for behaviour, d in result.diffs.items():
        console.print()
        console.print(f"[bold]{behaviour}[/bold]: A = switched off, B = all on (what the behaviour buys)")
        # kvtrace diff's renderer, its evictions and top requests left out: the same notes, times,
        # backends (--backend vllm: B is vLLM's manager, A kvtrace's) and per-request line
        render(d, console, SUMMARY_FIELDS, detail=False)
    console.print()
    # Unwrapped (a narrow or piped console would break the path mid-word, and the command
    # with it); the path shown as typed, never as markup or terminal codes.
    # (a server URL without its password, as every other line names it: the command below holds it,
    # to work when pasted, as the README says; this line printed it a second time)
    from kvtrace.store.backend import CHDB_PREFIX, db_label

    shown = db_label(db) if is_clickhouse(db) and not str(db).startswith(CHDB_PREFIX) else db
    console.print(f"{len(result.runs)} runs recorded in {printable(shown)}. Open the dashboard:",
                  markup=False, highlight=False, soft_wrap=True)
    console.print(printable(result.dashboard_command), markup=False, highlight=False, soft_wrap=True)
    return result


def summary_table(result: DemoResult) -> Any:
    """The runs side by side: one row per summary field, one column per run."""
    from rich.table import Table

    first = result.runs[0][0] if result.runs else None
    shown = demo_settings(first.backend if first is not None else "kvtrace")
    settings = ", ".join(f"{k}={v}" for k, v in shown.items())
    table = Table(title=f"kvtrace demo: {DEMO_TRACE} on {DEMO_PRESET} ({settings})", title_justify="left")
    table.add_column("metric", overflow="fold")
    for spec, _ in result.runs:
        table.add_column(ALL_ON if not spec.without else f"without\n{spec.without[0]}", justify="right",
                         overflow="fold")
    for key in SUMMARY_FIELDS:
        if key == "digest":
            continue
        table.add_row(key, *(format_value(key, r.summary.get(key)) for _, r in result.runs))
    return table


def runs_times_note(result: DemoResult) -> str:
    """Where the summary table's times come from (``metrics.times_source``), as ``kvtrace diff``
    says it: one source for every run, else each run's (its column's name) in turn."""
    sources = [(_column(spec), times_source(spec.mode, r.summary.get("cost_model"), printable))
               for spec, r in result.runs]
    distinct = list(dict.fromkeys(source for _, source in sources))
    if len(distinct) == 1:
        return f"Times: {distinct[0]}"
    return "Times: " + " · ".join(f"{column} {source}" for column, source in sources)


def runs_backend_note(result: DemoResult) -> str | None:
    """Whose cache manager made each run of the summary table (``metrics.backend_label``), as
    ``kvtrace diff`` says it: None where every run is kvtrace's own, else the all-on column's
    and the others' (each column's in turn where those differ)."""
    labels = [(_column(spec), backend_label(spec.mode, r.record.get("config")) or "unknown")
              for spec, r in result.runs]
    if all(label == "kvtrace" for _, label in labels):
        return None
    (on, on_label), *offs = labels
    if on == ALL_ON and len({label for _, label in offs}) == 1:
        return f"Backend: {ALL_ON} {on_label} · without a behaviour {offs[0][1]}"
    return "Backend: " + " · ".join(f"{column} {label}" for column, label in labels)


def _column(spec: RunSpec) -> str:
    """A run's column in the summary table, on one line."""
    return ALL_ON if not spec.without else f"without {spec.without[0]}"


def _replay_all(db: str, into: str, specs: list[RunSpec], seed: int, progress: bool) -> DemoResult:
    """Replay ``specs`` into the store ``into`` and diff each behaviour's run against all on;
    the result names ``db``, where the store is to be found once the demo is done."""
    result = DemoResult(db_path=db)
    with _progress(progress, len(specs)) as advance:
        for spec in specs:
            advance(spec.name)
            result.runs.append((spec, run_replay(spec, db=into, progress=False, export=False)))
        advance(None)
        (_, on), *offs = result.runs
        for (_, off), behaviour in zip(offs, BEHAVIOURS):
            if on.run_id is None or off.run_id is None:
                continue
            result.diffs[behaviour] = diff_runs(into, off.run_id, on.run_id, seed=seed)
    return result


def _demo_target(db: str) -> str:
    """The file the demo's store is to replace: ``db``, or what a symbolic link ``db`` points
    to (written through, so the link stays a link). Raises KVTraceError, before any replay,
    for anything there that is not an earlier demo store: a directory, a device, a FIFO, a
    socket, a store with other runs, a file that is no store, a missing folder."""
    target, exists = demo_target(db)
    if not exists:
        return target
    if os.path.getsize(target) > 0:
        try:
            runs = read.runs(target).select("name", "trace_source").rows()
            curves = read.curves(target)["curve_id"].n_unique()
        except KVTraceError as err:
            raise KVTraceError(f"{db}: exists and is not a kvtrace demo store ({err}); choose another --db") from None
        # the demo's runs: its names on its trace (a run of another trace named "demo: ..." is not)
        foreign = [n for n, t in runs if not str(n or "").startswith("demo: ") or t != DEMO_TRACE]
        if foreign:
            raise KVTraceError(
                f"{db}: holds {len(foreign)} run(s) that are not the demo's (e.g. {printable(str(foreign[0]))!r}); "
                "choose another --db or remove the file"
            )
        if curves:  # (the demo records none)
            raise KVTraceError(f"{db}: holds {curves} capacity curve(s), which the demo would drop; "
                               "choose another --db or remove the file")
        with read_connection(target) as con:
            extra = foreign_relations(con, check_store(con, target))
        if extra:
            raise KVTraceError(f"{db}: holds {len(extra)} table(s) or view(s) that are not kvtrace's (e.g. "
                               f"{printable(extra[0])!r}), which the demo would drop; choose another --db or remove "
                               "the file")
    return target


_SCRATCH = ".kvtrace-demo-"  # + the building process's pid + "-" + mkdtemp's letters


def _remove_dead_scratch(folder: str) -> None:
    """Remove the scratch folders demos killed with -9 left here; a live demo's stays."""
    remove_dead_leftovers(folder, lambda name: pid_after(_SCRATCH, name, "-"),
                          lambda path: shutil.rmtree(path, ignore_errors=True))


@contextlib.contextmanager
def _beside(target: str) -> Iterator[str]:
    """A store path in a new hidden folder beside ``target`` (the same file system, so the
    finished store is renamed over it); the folder and whatever is left in it are removed
    on the way out, whether the demo finished, failed or was interrupted.

    DuckDB's own interrupt (a signal landing in a query) can surface as ``RuntimeError: Query
    interrupted``; it is raised again as the interrupt it was, so SIGTERM exits 143, SIGHUP 129, Ctrl-C 130."""
    folder = os.path.dirname(os.path.abspath(target))
    _remove_dead_scratch(folder)
    try:
        # (named by this process, not the target: a long file name left no room for a suffix)
        scratch = tempfile.mkdtemp(prefix=f"{_SCRATCH}{os.getpid()}-", dir=folder)
    except OSError as err:
        raise KVTraceError(f"{folder}: cannot write the demo store there ({err.strerror or err})") from None
    try:
        yield os.path.join(scratch, os.path.basename(target))
    except Exception as err:
        if _interrupted_query(err):
            raise stop_exception() from None
        raise
    finally:
        with signals_held():
            shutil.rmtree(scratch, ignore_errors=True)


def _interrupted_query(err: Exception) -> bool:
    """Whether ``err`` is DuckDB's report of a query stopped by a signal."""
    import duckdb

    return isinstance(err, duckdb.InterruptException) or (
        isinstance(err, RuntimeError) and "Query interrupted" in str(err))


def _replace(built: str, target: str) -> None:
    """Rename the finished store ``built`` over ``target`` (one atomic step: a reader sees the
    old store or the new one). An old store's write-ahead log goes first: it belongs to the
    old file and would be replayed into the new one."""
    if os.path.exists(built + ".wal"):  # not checkpointed: fold it in before the rename
        with write_connection(built) as con:
            con.execute("CHECKPOINT")
    with contextlib.suppress(FileNotFoundError):  # the new file keeps the replaced one's permissions
        os.chmod(built, stat.S_IMODE(os.stat(target).st_mode))
    with signals_held():
        try:
            Path(wal_path(target)).unlink(missing_ok=True)  # (not <target>.wal where its name holds a '?')
            os.replace(built, target)
        except OSError as err:
            raise KVTraceError(f"{target}: cannot replace with the new demo store ({err.strerror or err})") from None


class _progress:
    """A rich progress bar over the runs (stderr), or nothing."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total = enabled, total
        self._bar = None
        self._task = None
        self._started = 0

    def __enter__(self):
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                console=Console(stderr=True), transient=False,
            )
            self._bar.__enter__()
            self._task = self._bar.add_task("replaying", total=self.total)
        return self.advance

    def advance(self, description: str | None) -> None:
        """Mark the previous run done and show the next (None: all done, now diffing)."""
        if self._bar is None:
            return
        done = self._started
        self._started += 1 if description is not None else 0
        self._bar.update(
            self._task, completed=done,
            description=f"replay {description}" if description is not None else "diffing runs",
        )

    def __exit__(self, *exc):
        if self._bar is not None:
            if exc[0] is None:
                self._bar.update(self._task, completed=self.total, description="done")
            else:  # interrupted or failed: the bar stays where the demo stopped
                self._bar.update(self._task, description="stopped")
            self._bar.__exit__(*exc)
        return False
