"""The kvtrace command run in this process, and the one-line error every user mistake gets:
shared by the tests that drive the CLI in-process (fast; the subprocess path is test_cli.py's)."""

from __future__ import annotations

import sys

from kvtrace import cli


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    """``kvtrace ARGV`` through the console script's ``main``: (exit code, stdout, stderr)."""
    return run_main(cli.main, "kvtrace", argv, capsys)


def run_main(main, program: str, argv: list[str], capsys) -> tuple[int, str, str]:
    """``main()`` with ``sys.argv`` ``[program, *argv]`` (a console script's, or a bench
    script's): (exit code, stdout, stderr)."""
    old = sys.argv
    sys.argv = [program, *argv]
    try:
        code = main()
        code = code if isinstance(code, int) else 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = old
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line(code: int, err: str, *needles: str) -> str:
    """Exit 2, and stderr exactly one ``kvtrace: error:`` line holding each of ``needles``,
    no traceback; returns the line."""
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtrace: error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]
