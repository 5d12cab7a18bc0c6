"""``kvtrace demo``: the main job on the embedded default workload, no input, no network.

Replays the built-in ``mixed`` workload with ``kimi-hybrid`` four times into one store —
all behaviours on, then each of the three switched off — and prints the runs side by side
and, per behaviour, the isolated diff (A = that behaviour off, B = all on: what it buys).
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvtrace.compare.model import RunDiff
from kvtrace.compare.render import tables
from kvtrace.compare.source import diff_runs
from kvtrace.compare.study import BEHAVIOURS
from kvtrace.errors import KVTraceError
from kvtrace.replay.report import format_value
from kvtrace.replay.run import RunResult, RunSpec, run_replay
from kvtrace.store import read
from kvtrace.store.schema import SUMMARY_FIELDS

DEMO_DB = "kvtrace-demo.duckdb"
DEMO_TRACE = "gen:mixed"
DEMO_PRESET = "kimi-hybrid"
# A small GPU pool (40 blocks of 512 tokens, shared by the groups) in front of an external tier, so
# that a workload of seconds puts the cache under the pressure a production server sees:
# evictions, external hits and re-prefills happen, and the behaviours have work to do.
DEMO_SETTINGS: dict[str, Any] = {"capacity_blocks": 40, "external_capacity_blocks": 4096}
ALL_ON = "all on"


def demo_specs(trace: str = DEMO_TRACE, *, seed: int = 0, limit: int | None = None,
               backend: str = "kvtrace") -> list[RunSpec]:
    """The four runs: all behaviours on (through ``backend``), then each one off (kvtrace's
    manager: the switches are kvtrace's)."""
    all_on = RunSpec(trace=trace, preset=DEMO_PRESET, seed=seed, limit=limit, name=f"demo: {ALL_ON}",
                     backend=backend, **DEMO_SETTINGS)
    return [all_on] + [replace(all_on, without=(b,), name=f"demo: without {b}", backend="kvtrace")
                       for b in BEHAVIOURS]


@dataclass(slots=True)
class DemoResult:
    db_path: str
    runs: list[tuple[RunSpec, RunResult]] = field(default_factory=list)
    diffs: dict[str, RunDiff] = field(default_factory=dict)  # behaviour -> (off vs all on)

    @property
    def dashboard_command(self) -> str:
        return f"kvtrace dashboard --db {shlex.quote(self.db_path)}"


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
    """Run the demo into ``db_path`` (replaced if it exists: it is the demo's own output)."""
    from rich.console import Console

    console = console or Console()
    db = str(db_path)
    _remove_store(db)
    result = DemoResult(db_path=db)
    specs = demo_specs(trace, seed=seed, limit=limit, backend=backend)
    with _progress(progress, len(specs)) as advance:
        for spec in specs:
            advance(spec.name)
            result.runs.append((spec, run_replay(spec, db=db, progress=False)))
        advance(None)
        (_, on), *offs = result.runs
        for (_, off), behaviour in zip(offs, BEHAVIOURS):
            if on.run_id is None or off.run_id is None:
                continue
            result.diffs[behaviour] = diff_runs(db, off.run_id, on.run_id, seed=seed)

    console.print(summary_table(result))
    for behaviour, d in result.diffs.items():
        console.print()
        console.print(f"[bold]{behaviour}[/bold]: A = switched off, B = all on (what the behaviour buys)")
        for table in tables(d, metrics=SUMMARY_FIELDS)[:2]:  # metric deltas, latency percentiles with CIs
            console.print(table)
    console.print()
    console.print(f"{len(result.runs)} runs recorded in {db}. Open the dashboard:")
    console.print(result.dashboard_command, markup=False, highlight=False)
    return result


def summary_table(result: DemoResult) -> Any:
    """The runs side by side: one row per summary field, one column per run."""
    from rich.table import Table

    settings = ", ".join(f"{k}={v}" for k, v in DEMO_SETTINGS.items())
    table = Table(title=f"kvtrace demo: {DEMO_TRACE} on {DEMO_PRESET} ({settings})", title_justify="left")
    table.add_column("metric")
    for spec, _ in result.runs:
        table.add_column(ALL_ON if not spec.without else f"without\n{spec.without[0]}", justify="right")
    for key in SUMMARY_FIELDS:
        if key == "digest":
            continue
        table.add_row(key, *(format_value(key, r.summary.get(key)) for _, r in result.runs))
    return table


def _remove_store(db: str) -> None:
    """Delete an earlier demo store at ``db``; refuse anything else that lives there."""
    if os.path.isdir(db):
        raise KVTraceError(f"{db}: is a directory; expected a DuckDB file path for the demo store")
    if os.path.exists(db) and os.path.getsize(db) > 0:
        try:
            names = read.runs(db)["name"].to_list()
        except KVTraceError as err:
            raise KVTraceError(f"{db}: exists and is not a kvtrace demo store ({err}); choose another --db") from None
        foreign = [n for n in names if not str(n or "").startswith("demo: ")]
        if foreign:
            raise KVTraceError(
                f"{db}: holds {len(foreign)} run(s) that are not the demo's (e.g. {foreign[0]!r}); "
                "choose another --db or remove the file"
            )
    for path in (db, db + ".wal"):
        Path(path).unlink(missing_ok=True)


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
            self._bar.update(self._task, completed=self.total, description="done")
            self._bar.__exit__(*exc)
        return False
