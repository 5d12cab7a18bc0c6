"""Human-readable summaries for the terminal (rich tables on stdout)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvtrace.metrics import SUMMARY_RATES, percent_text

if TYPE_CHECKING:  # rich loads when a table is printed, not when the CLI starts
    from rich.console import Console
    from rich.table import Table

# every rate of a summary, one format: the external and preempted hit rates showed as 0.285
# beside a hit rate of 52.04% in the same table
_PERCENT = frozenset(SUMMARY_RATES)


def format_value(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key in _PERCENT and isinstance(value, (int, float)):
        return percent_text(value)  # (1 hit in 30,002 queries read 0.00% beside its hit)
    if isinstance(value, float):
        # (3 decimals showed 0.0003 tokens/s, a run that generated some, as 0.000; below 0.01,
        # 3 significant digits, so 0.0015 is not shown coarser than 0.00099)
        if 0 < abs(value) < 0.01:
            return f"{value:.3g}"
        return f"{value:,.3f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


# Values a user copies whole (a digest to compare runs by, a trace's path): where the table would fold them,
# they are printed on their own line under it instead
_COPIED = ("digest", "trace")


def summary_table(summary: Mapping[str, Any], title: str = "summary", leave_out: tuple[str, ...] = ()) -> Table:
    from rich.table import Table

    from kvtrace.names import markup_literal

    # the title names the user's trace: shown as typed, never read as markup
    table = Table(title=markup_literal(title), show_header=True, header_style="bold")
    table.add_column("metric", overflow="fold")  # (never cut: a digest, a trace path)
    table.add_column("value", justify="right", overflow="fold")
    for key, value in summary.items():
        if key in leave_out:
            continue
        if isinstance(value, dict):  # (evictions_by_reason: the table left it out, which only --json showed)
            for sub, count in value.items():
                table.add_row(markup_literal(f"{key}.{sub}"), markup_literal(format_value(key, count)))
            continue
        if isinstance(value, list):
            continue
        # (a trace's path is the user's text: shown, never read as markup or control codes)
        table.add_row(key, markup_literal(format_value(key, value)))
    return table


def print_summary(summary: Mapping[str, Any], title: str = "summary", console: Console | None = None) -> None:
    """The summary table; on a terminal too narrow for it, the values a user copies whole
    (``_COPIED``) go under it, one line each: folded across rows, a 64-digit digest was
    copied with the table's borders in it."""
    from kvtrace.names import markup_literal, stdout_console

    console = console or stdout_console()
    table = summary_table(summary, title)
    if console.measure(table, options=console.options.update_width(1 << 20)).maximum <= console.width:
        console.print(table)
        return
    copied = tuple(k for k in _COPIED if isinstance(summary.get(k), str))
    console.print(summary_table(summary, title, leave_out=copied))
    for key in copied:
        console.print(f"{key}: {markup_literal(summary[key])}", soft_wrap=True)
