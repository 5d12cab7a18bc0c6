"""The application with every command registered, and ``run``: one command line, its
errors as one line each and its exit status as documented (2 a user's error, 130 Ctrl-C,
143 SIGTERM, 129 SIGHUP)."""

from __future__ import annotations

import sys
from typing import Any, NoReturn

import typer
import typer.main
from typer.models import TyperPath

from kvtrace.cli import calibrate, conformance, live, replay, results, traces  # noqa: F401  (registers the commands)
from kvtrace.cli.application import app
from kvtrace.cli.output import StdoutError, error, fitted_streams, stdout_discarded, stdout_failure, unreadable_argument
from kvtrace.errors import KVTraceError, OutputClosed
from kvtrace.process import raise_stop, sigterm_as_interrupt, stop_signalled, stop_swallowed, terminated

__all__ = ["app", "run"]


def run() -> None:
    with fitted_streams():  # a closed or full stdout, an encoding that cannot show a name: no traceback
        _run()


def _run() -> None:
    bad = unreadable_argument(sys.argv[1:])
    if bad is not None:
        error(bad)
        sys.exit(2)
    try:
        with sigterm_as_interrupt():  # `kill`, `timeout`: what was recorded is flushed, the run marked
            rc = _command()(prog_name="kvtrace", standalone_mode=False)  # errors come back here, printed as one line
            if stop_swallowed():  # a finalizer dropped the stop's KeyboardInterrupt and no loop met it after
                raise_stop()
    except OutputClosed:  # `| head`, `-o /dev/stdout | head`: the reader had what it wanted
        _stdout_closed()
    except KVTraceError as e:
        if not (_while_interrupted(e) or stop_signalled()):
            error(str(e))
            sys.exit(2)
        rc = 130  # (raised by the stop's own unwinding, a store it closed: the stop is what happened)
    except typer.Abort:
        error("interrupted")
        sys.exit(130)
    except typer.TyperException as e:  # a mistyped command line (typer's click errors): one line too
        ctx = getattr(e, "ctx", None)
        if type(e).__name__ == "NoArgsIsHelpError" and ctx is not None:  # (typer vendors click)
            try:  # `kvtrace`, `kvtrace capture`: asking what there is, as --help does, which a closed or
                typer.echo(ctx.get_help())  # full stdout ends as --help's does (it ended in a traceback)
            except OutputClosed:
                _stdout_closed()
            except StdoutError as failed:
                error(stdout_failure(failed))
                sys.exit(2)
            sys.exit(0)
        error(_usage_error(e))
        sys.exit(getattr(e, "exit_code", 2))
    except KeyboardInterrupt:
        rc = 130
    except StdoutError as e:  # stdout gone (a full disk) while the result was written
        error(stdout_failure(e))
        sys.exit(2)
    except Exception as e:
        if _out_of_memory(e):  # (`ulimit -v`, a container's limit: what was committed before is kept)
            error("out of memory; give the command more memory, or less to hold (--limit, a smaller trace or pool)")
            sys.exit(2)
        deleted = _cwd_deleted(e)
        if deleted is not None:
            error(deleted)
            sys.exit(2)
        if not (_while_interrupted(e) or stop_signalled()):
            raise
        # Ctrl-C or SIGTERM came while a library ran, which raised its own error instead
        # (DuckDB: "Query interrupted", an aborted transaction), or a second one stopped
        # the first one's flush: what was committed before is kept
        rc = 130
    if rc == 130:  # (typer returns 130 for a KeyboardInterrupt, SIGTERM's and SIGHUP's Terminated included)
        kept = "; what was recorded is kept" if _recording(sys.argv[1:]) else ""
        by = terminated()
        if by is not None:
            error(f"terminated ({by.name}){kept}")  # (after a hang-up, stderr may be gone: nothing else is lost)
            sys.exit(128 + by)
        error(f"interrupted{kept}")
    sys.exit(rc if isinstance(rc, int) else 0)


def _stdout_closed() -> NoReturn:
    """stdout's reader went away: exit 141 silently, as a shell's command killed by SIGPIPE."""
    stdout_discarded()
    sys.exit(141)


class _NonEmptyPath(TyperPath):
    """A path parameter that refuses ``''``: ``Path('')`` is the current directory, so
    ``--config ''`` read ``.`` as a config and ``convert ''`` converted it."""

    def convert(self, value, param, ctx):
        if value == "":
            self.fail("expected a path, got an empty one", param, ctx)
        return super().convert(value, param, ctx)


class _AsciiNumber:
    """A number parameter that takes ASCII digits alone: click converts with int() and
    float(), which read `--limit ３` (a fullwidth digit) as 3, `--seed ١٢` as 12 and
    `--requests 1_000` as 1000, where a trace's numbers, an endpoint's port and --moe are
    refused unless ASCII decimal."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and (not value.isascii() or "_" in value):
            self.fail(f"{value!r}: expected a number in ASCII digits", param, ctx)
        return super().convert(value, param, ctx)


_ASCII_NUMBERS: dict[type, type] = {}


def _ascii_number(kind: type) -> type:
    """``kind`` (click's int, float or range type) taking ASCII digits alone."""
    if kind not in _ASCII_NUMBERS:
        _ASCII_NUMBERS[kind] = type(f"Ascii{kind.__name__}", (_AsciiNumber, kind), {})
    return _ASCII_NUMBERS[kind]


def _a_number(kind: type) -> bool:
    # (typer vendors click: its classes told by name, as the errors are)
    return not issubclass(kind, _AsciiNumber) and any(
        k.__name__ in ("IntParamType", "FloatParamType") for k in kind.__mro__)


def _command() -> typer.main.TyperGroup:
    """``app``'s click command (what ``app(...)`` builds), its path parameters non-empty and
    its numbers ASCII digits."""
    command = typer.main.get_command(app)
    todo = [command]
    while todo:
        c = todo.pop()
        for param in c.params:
            if type(param.type) is TyperPath:  # the class typer gives a Path annotation
                param.type.__class__ = _NonEmptyPath
            elif _a_number(type(param.type)):  # (click's INT is one instance for every int option: changed once)
                param.type.__class__ = _ascii_number(type(param.type))
        subcommands = getattr(c, "commands", None)
        if subcommands is None:
            _refuse_repeats(c)
        todo.extend((subcommands or {}).values())
    return command  # type: ignore[return-value]


def _refuse_repeats(command: Any) -> None:
    """A usage error for an option of one value given twice: click keeps the last, so
    `runs --db a.duckdb --db b.duckdb` read b alone without a word (a flag twice says the same
    thing twice, and a repeatable option collects them all), and for an on/off flag given both
    ways (`collect --grpc --no-grpc` served no gRPC, unsaid)."""
    parse_args = command.parse_args

    def checked(ctx: Any, args: list[str]) -> list[str]:
        if not ctx.resilient_parsing:
            order = command.make_parser(ctx).parse_args(args=list(args))[2]
            if any(getattr(p, "name", None) == "help" for p in order):  # (--help parsed as the option wins, as before;
                return parse_args(ctx, args)  # a run named --help, or one after --, is no help)
            seen: set[str] = set()
            for param in order:
                if param.param_type_name != "option" or param.multiple or param.count:
                    continue
                if param.name in seen:
                    if not param.is_flag:
                        raise typer.BadParameter("given more than once (give it once)", ctx=ctx, param=param)
                    both = _both_ways(command, param, args)
                    if both is not None:
                        raise typer.BadParameter(f"given as both {both}; give one", ctx=ctx, param=param)
                seen.add(param.name)
        return parse_args(ctx, args)

    command.parse_args = checked


def _both_ways(command: Any, flag: Any, args: list[str]) -> str | None:
    """``--grpc and --no-grpc`` when ``args`` give the on/off ``flag`` both ways, else None
    (a value of another option spelled like it, as in `--name --no-grpc`, is no flag)."""
    if not flag.secondary_opts:
        return None
    takes_value = {o for p in command.params if p.param_type_name == "option" and not (p.is_flag or p.count)
                   for o in p.opts}
    spelled: dict[bool, str] = {}
    value_next = False
    for token in args:
        if value_next:
            value_next = False
        elif token == "--":
            break
        elif token in takes_value:
            value_next = True
        elif token in flag.opts or token in flag.secondary_opts:
            spelled.setdefault(token in flag.opts, token)
    return f"{spelled[True]} and {spelled[False]}" if len(spelled) == 2 else None


# The commands that record into a store: stopped, they keep what they recorded (the run
# marked). The others (the dashboard, the demo's scratch store, a trace written whole or
# not at all) have nothing to keep, so the line does not say it.
_RECORDING = frozenset({"replay", "sweep", "curve", "study", "collect", "capture"})


def _recording(argv: list[str]) -> bool:
    """A recording command given a store (``--db``; collect and capture require one) that
    is there: a replay without one records nothing to keep, and one stopped before it made
    the store's file kept nothing either (it said so all the same)."""
    import os

    from kvtrace.store.backend import is_clickhouse

    command = next((a for a in argv if not a.startswith("-")), None)
    if command not in _RECORDING:
        return False
    for i, a in enumerate(argv):
        db = argv[i + 1] if a == "--db" and i + 1 < len(argv) else a.removeprefix("--db=") if a.startswith("--db=") \
            else None
        if db is not None:
            return is_clickhouse(db) or os.path.exists(db)
    return False


def _out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is an allocation refused: Python's MemoryError, or DuckDB's own (a
    query's block), whose text is a page of tuning advice."""
    if isinstance(e, MemoryError):
        return True
    duckdb = sys.modules.get("duckdb")  # (imported only by the commands that open a store)
    refused = getattr(duckdb, "OutOfMemoryException", None)
    return refused is not None and isinstance(e, refused)


def _cwd_deleted(e: BaseException) -> str | None:
    """The error line of ``e`` where it is the current directory's getcwd() failing, the
    directory deleted under the shell (a relative path made absolute: ``os.path.realpath``,
    ``abspath``, raise FileNotFoundError naming no file); else None."""
    import os

    if not isinstance(e, FileNotFoundError) or e.filename is not None:
        return None
    try:
        os.getcwd()
        return None
    except FileNotFoundError:
        pass
    try:
        where = os.readlink("/proc/self/cwd").removesuffix(" (deleted)")
    except OSError:
        where = "."
    from kvtrace.names import printable

    return (f"{printable(where)}: the current directory no longer exists (deleted), so no relative path can be "
            "read or written; cd to a folder that exists, or give absolute paths")


def _while_interrupted(e: BaseException) -> bool:
    """Whether ``e`` was raised while an interrupt (Ctrl-C, SIGTERM) was being handled."""
    seen = set()
    cause = e.__context__
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return True
        seen.add(id(cause))
        cause = cause.__context__
    return False


def _usage_error(e: Exception) -> str:
    """``--flag: what is wrong (see `kvtrace CMD --help`)``, as the run's own errors read."""
    ctx = getattr(e, "ctx", None)
    where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
    param = getattr(e, "param", None)
    if type(e).__name__ == "BadParameter" and param is not None:  # a bad value (typer vendors click)
        name = param.opts[0] if param.param_type_name == "option" else (param.metavar or param.name.upper())
        message = f"{name}: {str(getattr(e, 'message', e)).removeprefix('Value error, ')}"
    else:
        message = e.format_message() if hasattr(e, "format_message") else str(e)
    return " ".join(f"{message}{where}".split())
