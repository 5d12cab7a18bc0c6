"""How commands talk: data on stdout, status and errors on stderr."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import os
import sys
from collections.abc import Iterator
from typing import Any

import typer

from kvtrace.errors import OutputClosed
from kvtrace.names import count as count  # (re-exported: its home is the ground floor)
from kvtrace.names import cut_middle, markup_literal, printable, stdout_console, without_secrets
from kvtrace.names import shell_path as shell_path  # (re-exported: its home is the ground floor)
from kvtrace.names import shell_word as shell_word

MAX_ERROR_CHARS = 1_000  # a message quoting a user's value (a list of 200k numbers) stays a readable line


def error(msg: str) -> None:
    """The one error line; what it quotes (a path, a key) shown as typed, never obeyed as
    terminal codes (click strips those only when stderr is not a terminal), and cut in the
    middle when it quotes a huge value or path (its end, what is wrong, kept)."""
    line = without_secrets(printable(msg))  # (an endpoint's or a store URL's password, never shown)
    line = cut_middle(line, MAX_ERROR_CHARS)  # (the end says what is wrong: a 4,000-byte path's "no such file")
    typer.echo(f"kvtrace: error: {line}", err=True)


def status(msg: str) -> None:
    """A status line on stderr, so stdout stays clean for data: one line, whatever path or
    name it quotes, and a store URL's password never shown, as ``error`` hides it ("run r1
    recorded in clickhouse://u:PASSWORD@..." printed it)."""
    typer.echo(without_secrets(printable(msg)), err=True)


def echo_json(obj: Any) -> None:
    """``obj`` as one line of JSON; a value that is not a number (NaN, infinity: a store
    written by hand, a ratio over zero) is null, as JSON has no other word for it."""
    typer.echo(json.dumps(_finite(obj), sort_keys=True, allow_nan=False))


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def one_format(as_json: bool, markdown: bool) -> None:
    """Refuse --json with --markdown: one output, never one silently dropped."""
    if as_json and markdown:
        from kvtrace.errors import ConfigError

        raise ConfigError("--markdown", "given with --json", "choose one output format")


def recorded(run_id: str | None, db) -> None:
    """Every command that records a run says so, with the id the other commands take."""
    if run_id is not None:
        status(f"kvtrace: run {run_id} recorded in {store_shown(db)}")


def store_shown(db: Any) -> str:
    """A store as a line or ``--json`` names it: a ClickHouse server URL without its password
    (the form every store error prints: runs' title and JSON, a recorded run's line, showed
    clickhouse://u:PASSWORD@...), anything else as given."""
    from kvtrace.store.backend import CHDB_PREFIX, db_label, is_clickhouse

    text = str(db)
    return db_label(text) if is_clickhouse(text) and not text.startswith(CHDB_PREFIX) else text


FOLD_MIN = 16  # the narrowest a column of long text (a run's name, its behaviours) is laid out at


def tell_left_out(left_out: list[str]) -> None:
    """The stderr line naming the columns ``print_rows`` left out to fit the terminal, if any."""
    if left_out:
        status(f"columns left out to fit the terminal: {', '.join(left_out)} (a wider terminal, a pipe or --json "
               "shows them)")


def print_rows(rows: list[list[str]], title: str | None = None, left: int = 1,
               priority: list[str] | None = None, fold: frozenset[str] = frozenset(),
               wrap: frozenset[str] = frozenset()) -> list[str]:
    """A table on stdout; the first row is the header, the first ``left`` columns are
    text (left-aligned). Piped output is not wrapped to 80 columns: it is for reading
    whole, or for grep. On a terminal too narrow for it a cell folds onto more lines,
    never cut: rich's default ellipsis showed a hit rate of 59.51% as "59…" and run r13 as
    "r1…" in an 80-column `kvtrace runs`.

    With ``priority`` (header names, most wanted first: the others are never left out), a
    terminal too narrow for every column leaves out the least wanted ones that do not fit
    instead (13 columns at 80 folded every header and id to three characters a line): each
    cell shown stays on one line, but those of the ``fold`` columns (long text, at least
    ``FOLD_MIN`` wide) and of the ``wrap`` columns (at their spaces, never inside a word:
    a sweep's "34.09% (+0.00pp)"). Returns the names of the columns left out, for the
    caller to say."""
    from rich.cells import cell_len
    from rich.table import Table

    console = stdout_console()
    header = rows[0]
    shown, fits = list(range(len(header))), False
    if priority is not None:
        shown, fits = _fitting(rows, priority, fold, wrap, console.width, cell_len)
    table = Table(title=None if title is None else markup_literal(title), header_style="bold")
    for i in shown:
        name = header[i]
        # (where even the columns always shown do not fit, every cell folds, as without priority)
        several = name in fold or name in wrap  # (lines a cell may take)
        table.add_column(name, justify="left" if i < left else "right", overflow="fold",
                         no_wrap=fits and not several,
                         min_width=_narrowest(rows, i, fold, wrap, cell_len) if fits and several else None)
    for row in rows[1:]:  # a run's name is the user's text: shown, never read as markup or control codes
        table.add_row(*(markup_literal(row[i]) for i in shown))
    console.print(table)
    return [header[i] for i in range(len(header)) if i not in shown]


def _narrowest(rows: list[list[str]], i: int, fold: frozenset[str], wrap: frozenset[str], cell_len: Any) -> int:
    """Column ``i``'s width: its widest cell; a ``fold`` column's at most ``FOLD_MIN``; a
    ``wrap`` column's its widest word."""
    if rows[0][i] in wrap:
        return max(cell_len(word) for row in rows for word in printable(row[i]).split(" "))
    widest = max(cell_len(printable(row[i])) for row in rows)
    return min(widest, FOLD_MIN) if rows[0][i] in fold else widest


def _fitting(rows: list[list[str]], priority: list[str], fold: frozenset[str], wrap: frozenset[str],
             width: int, cell_len: Any) -> tuple[list[int], bool]:
    """The columns shown within ``width``: every one not in ``priority``, then those of
    ``priority`` in its order that still fit (a wide one left out, a narrower later one may
    fit), each at its ``_narrowest``; in the table's order; and whether they fit. A column
    takes its width, a space each side and a rule: 3 more; the table 1."""
    header = rows[0]

    def need(i: int) -> int:
        return _narrowest(rows, i, fold, wrap, cell_len) + 3

    keep = [i for i, name in enumerate(header) if name not in priority]
    used = 1 + sum(need(i) for i in keep)
    for name in priority:
        if name not in header:
            continue
        i = header.index(name)
        if used + need(i) <= width:
            keep.append(i)
            used += need(i)
    return sorted(keep), used <= width


class StdoutError(OSError):
    """stdout could not be written (a full disk): the command's result is lost, what it
    recorded is not."""


class StdoutClosed(OutputClosed):
    """stdout's reader went away (``| head``): exit 141, silently. Not an OSError, which
    typer takes for a broken pipe of its own and ends in a silent exit 1, the status of a
    failed ``diff --fail-if`` gate."""


class _Stdout:
    """sys.stdout, its write failures told apart from every other OSError (a store's, a
    trace's) as StdoutError, or StdoutClosed for a closed pipe."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as err:
            raise _failure(err) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as err:
            raise _failure(err) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _Stderr:
    """sys.stderr, which a failed write (its reader gone: ``2>&1 | head``; a full disk)
    points at the null device: the progress, status and error lines are lost, nothing else.
    The command goes on and exits with its own status (typer took the closed pipe for one
    of its own and exited 1, a finished replay included, its error's 2 too)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError:
            _discard(2)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError:
            _discard(2)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _discard(fd: int) -> None:
    """``fd`` pointed at the null device: what is written to it, or flushed at exit, is dropped."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
    except OSError:
        pass


@contextlib.contextmanager
def fitted_streams() -> Iterator[None]:
    """Streams every command can write to, within the block: a closed stdout or stderr
    (``>&-``) is the null device; a character the terminal's encoding lacks
    (``PYTHONIOENCODING=ascii``, a run named in Greek) is written as its escape instead of
    failing the command; a failed write to stdout is a StdoutError (StdoutClosed for a
    closed pipe); one to stderr loses what stderr shows, nothing else. A ``COLUMNS`` that is
    no width (``0``, ``-1``) is set aside for the block: rich laid every table out in it, a
    terminal's summary, runs and diff tables printed as nothing, exit 0."""
    saved = sys.stdout, sys.stderr
    columns = os.environ.get("COLUMNS")
    no_width = columns is not None and not (columns.strip().isdigit() and int(columns) > 0)
    if no_width:  # (rich asks the terminal instead: its size, or 80 where it says 0)
        del os.environ["COLUMNS"]
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None:
            setattr(sys, name, open(os.devnull, "w", encoding="utf-8"))  # noqa: SIM115  (for the process's life)
        elif isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")
    if not isinstance(sys.stdout, _Stdout):
        sys.stdout = _Stdout(sys.stdout)
    if not isinstance(sys.stderr, _Stderr):
        sys.stderr = _Stderr(sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
        if no_width:
            os.environ["COLUMNS"] = str(columns)


def _failure(err: OSError) -> StdoutError | StdoutClosed:
    """What a failed write to stdout raises."""
    if err.errno == errno.EPIPE:
        return StdoutClosed(f"cannot write to stdout: {err.strerror or err}")
    return StdoutError(err.errno, err.strerror)


def stdout_failure(err: StdoutError) -> str:
    """The one line for ``err``, after ``stdout_discarded``."""
    stdout_discarded()
    return f"cannot write to stdout: {err.strerror or err}"


def stdout_discarded() -> None:
    """stdout pointed at the null device, so that Python's own flush at exit of what it
    still buffers does not fail again, with a traceback."""
    _discard(1)


def unreadable_argument(argv: list[str]) -> str | None:
    """The one line for the first argument that is not text (bytes that are not UTF-8, which
    a store, a name or a JSON result cannot hold), else None."""
    for i, arg in enumerate(argv, 1):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            shown = arg.encode("utf-8", "surrogateescape").decode("ascii", "backslashreplace")
            where = argv[i - 2] if i > 1 and argv[i - 2].startswith("-") else f"argument {i}"
            return f"{where}: {shown}: not valid UTF-8 text; rename the file or retype the value"
    return None


def is_stdout(path: str) -> bool:
    """Whether ``path`` is the file this process's stdout writes to (``/dev/stdout``,
    ``/dev/fd/1``, or the file stdout is redirected to): a command that writes its result
    there keeps its report off it."""
    try:
        target, out = os.stat(path), os.fstat(sys.stdout.fileno())
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return False
    return (target.st_dev, target.st_ino) == (out.st_dev, out.st_ino)
