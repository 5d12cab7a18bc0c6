"""The command line against what a shell can hand it besides flags: a closed or full
stdout, an ASCII-only terminal, argv bytes that are not UTF-8, a FIFO or an overlong name
where a file belongs, a run name with control codes or rich markup, Ctrl-C while the
commands load. Each is one line (or a clean result) and never a traceback.

These run the real console entry point in a subprocess: the streams and argv are the
process's own.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import duckdb
import pytest

KVTRACE = [sys.executable, "-m", "kvtrace.cli"]
TRACE = str(Path(__file__).resolve().parents[1] / "data" / "mooncake_synthetic_trace.jsonl")
HOSTILE_NAME = "a\nb\x1b[31mRED\x07z [/] [bold]x"


def kvtrace(*argv: str | bytes, env: dict | None = None, shell_tail: str = "", timeout: float = 120,
            cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    if shell_tail:  # a redirection only a shell can make (>&-)
        import shlex

        command = " ".join(shlex.quote(str(a)) for a in [*KVTRACE, *argv]) + " " + shell_tail
        return subprocess.run(command, shell=True, capture_output=True, timeout=timeout, check=False,
                              env=env, cwd=cwd)
    return subprocess.run([*KVTRACE, *argv], capture_output=True, timeout=timeout, env=env, cwd=cwd, check=False)


def one_error_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 2, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtrace: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """Two cache-only runs: one named with control codes and markup, one in plain words."""
    db = str(tmp_path_factory.mktemp("hostile") / "s.duckdb")
    for name in (HOSTILE_NAME, "plain"):
        proc = kvtrace("replay", TRACE, "--limit", "5", "--mode", "cache-only", "--db", db, "--name", name)
        assert proc.returncode == 0, proc.stderr
    return db


def test_a_closed_stdout_is_no_traceback(store):
    proc = kvtrace("runs", "--db", store, shell_tail=">&-")
    assert proc.returncode == 0, proc.stderr
    assert b"Traceback" not in proc.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_a_full_stdout_is_one_line(store, json_flag):
    proc = kvtrace("runs", "--db", store, *json_flag, shell_tail=">/dev/full")
    one_error_line(proc, "cannot write to stdout", "No space left")


def test_an_ascii_terminal_gets_escapes(store, tmp_path):
    env = dict(os.environ, PYTHONIOENCODING="ascii")
    named = str(tmp_path / "ünï.duckdb")
    shutil.copy(store, named)
    proc = kvtrace("runs", "--db", named, env=env)
    assert proc.returncode == 0, proc.stderr
    assert b"Traceback" not in proc.stderr
    assert proc.stdout.isascii()
    assert b"\\xfcn\\xef" in proc.stdout  # the store's name, escaped in the table's title


def test_arguments_that_are_not_utf8_are_one_line(tmp_path):
    bad = os.fsencode(str(tmp_path)) + b"/bad\xffname.duckdb"
    proc = kvtrace("replay", TRACE, "--limit", "3", "--mode", "cache-only", "--db", bad)
    line = one_error_line(proc, "--db: ", "not valid UTF-8")
    assert "bad\\xffname" in line
    assert not os.listdir(tmp_path)  # nothing created


def test_a_fifo_is_refused_where_a_file_belongs(tmp_path, store):
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    for argv in (["runs", "--db", fifo], ["diff", "r1", "r2", "--db", fifo],
                 ["replay", TRACE, "--limit", "3", "--mode", "cache-only", "--db", fifo],
                 ["replay", fifo, "--limit", "3"], ["replay", TRACE, "--limit", "3", "--config", fifo]):
        one_error_line(kvtrace(*argv, timeout=60), fifo, "FIFO")  # (it hung, waiting for a writer)


def test_a_directory_given_with_a_format_is_called_a_directory(tmp_path):
    proc = kvtrace("convert", str(tmp_path), "--format", "azure", "-o", str(tmp_path / "x.jsonl"))
    one_error_line(proc, "is a directory", "azure format")


def test_a_name_too_long_is_one_line(tmp_path):
    long = str(tmp_path / ("a" * 300))
    one_error_line(kvtrace("runs", "--db", long + ".duckdb"), "File name too long")
    one_error_line(kvtrace("replay", TRACE, "--limit", "3", "--mode", "cache-only", "--db", long + "/x.duckdb"),
                   "File name too long")
    one_error_line(kvtrace("calibrate", "--from", long + ".csv"), "File name too long")


def test_control_codes_and_markup_in_a_name_are_shown_not_obeyed(store):
    proc = kvtrace("runs", "--db", store)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.decode()
    assert "\x1b" not in out and "\x07" not in out
    assert "a\\nb\\x1b[31mRED\\x07z [/] [bold]x" in out  # as typed, markup not read
    runs = json.loads(kvtrace("runs", "--db", store, "--json").stdout)["runs"]
    hostile, plain = (r["run_id"] for r in sorted(runs, key=lambda r: r["name"] == "plain"))
    proc = kvtrace("diff", hostile, plain, "--db", store)
    assert proc.returncode == 0, proc.stderr
    assert "\x1b" not in proc.stdout.decode() and "[/] [bold]x" in proc.stdout.decode()
    proc = kvtrace("diff", hostile, plain, "--db", store, "--markdown")
    heading = proc.stdout.decode().splitlines()[0]
    assert heading.startswith("### kvtrace diff:") and "\\n" in heading  # the newline did not break it


def test_json_says_null_for_what_is_not_a_number(store, tmp_path):
    db = str(tmp_path / "nan.duckdb")
    shutil.copy(store, db)
    con = duckdb.connect(db)
    summary = json.loads(con.execute("SELECT summary FROM runs WHERE name = 'plain'").fetchone()[0])
    summary["prefix_cache_hit_rate"] = float("nan")
    con.execute("UPDATE runs SET summary = ? WHERE name = 'plain'", [json.dumps(summary)])
    con.close()

    def strict(text: bytes):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))

    runs = strict(kvtrace("runs", "--db", db, "--json").stdout)["runs"]
    (plain,) = [r for r in runs if r["name"] == "plain"]
    # a NaN rate is no value kvtrace writes: the record is damaged, in every view (its JSON null)
    assert plain["prefix_cache_hit_rate"] is None and plain["status"] == "damaged", plain
    ids = sorted(r["run_id"] for r in runs)
    proc = kvtrace("diff", *ids, "--db", db, "--json")
    assert proc.returncode == 2 and proc.stdout == b"", proc.stdout
    assert b"prefix_cache_hit_rate: expected a rate from 0 to 1, got nan" in proc.stderr


def test_ctrl_c_while_the_commands_load_is_one_line(tmp_path):
    # SIGINT lands inside `import typer`, deterministically: an import hook sends it
    script = textwrap.dedent("""
        import os, signal, sys

        class Interrupt:
            def find_spec(self, name, path=None, target=None):
                if name == "typer":
                    os.kill(os.getpid(), signal.SIGINT)
                return None

        sys.meta_path.insert(0, Interrupt())
        sys.argv = ["kvtrace", "runs", "--db", "x.duckdb"]
        from kvtrace.cli import main
        main()
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60, cwd=tmp_path, check=False)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.decode() == "kvtrace: error: interrupted\n"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # (this process: untouched)


def _stderr_on_a_terminal(*argv: str, cwd: Path) -> str:
    """stderr as a terminal shows it (click strips terminal codes only when it is not one)."""
    import pty

    leader, follower = pty.openpty()
    try:
        proc = subprocess.run([*KVTRACE, *argv], stdout=subprocess.DEVNULL, stderr=follower, timeout=120,
                              cwd=cwd, check=False)
        os.close(follower)
        follower = -1
        out = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # (EIO: the terminal's other side is closed)
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)
    assert proc.returncode in (0, 2), out
    return out.decode("utf-8", "replace")


def test_a_path_with_control_codes_is_shown_not_obeyed_on_a_terminal(tmp_path):
    hostile = "x\x1b[31mRED\x07\nz [red]q"
    # the error line quoting it
    err = _stderr_on_a_terminal("replay", f"{hostile}.jsonl", cwd=tmp_path)
    assert "\x1b" not in err and "\x07" not in err, repr(err)
    # (its newline shown as \n, as the bar and the status line show it; it was joined into a space)
    assert err.strip().splitlines() == [r"kvtrace: error: x\x1b[31mRED\x07\nz [red]q.jsonl: no such file or directory"]
    # the progress bar naming the trace, and the status line naming the store the run went to
    shutil.copy(TRACE, tmp_path / f"{hostile}.jsonl")
    err = _stderr_on_a_terminal("replay", f"{hostile}.jsonl", "--limit", "2", "--mode", "cache-only", "--db",
                                f"{hostile}.duckdb", cwd=tmp_path)
    assert "RED\x07" not in err and "\x1b[31m" not in err, repr(err)  # (the bar's own colours are rich's)
    assert r"x\x1b[31mRED\x07\nz [red]q.jsonl" in err, repr(err)  # the bar's label, markup and all
    line = next(x for x in err.splitlines() if "recorded in" in x)
    assert line.endswith(r"recorded in x\x1b[31mRED\x07\nz [red]q.duckdb"), repr(line)


@pytest.mark.parametrize("argv", [
    ["convert", TRACE, "-o", "/dev/stdout"],  # (was "/dev/stdout: cannot write: Broken pipe", exit 2)
    ["generate", "chat", "--requests", "20000", "-o", "/dev/stdout"],
])
def test_an_output_whose_reader_stops_early_exits_141_silently(argv):
    """``kvtrace convert T -o /dev/stdout | head``: as for stdout itself, the reader had what
    it wanted, which is no error."""
    proc = subprocess.Popen([*KVTRACE, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    assert len(proc.stdout.read(10)) == 10
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and err == b"", err


def test_an_output_name_near_name_max_is_written(tmp_path):
    """The temporary file beside it took the name past 255 bytes: a valid name was refused."""
    out = tmp_path / ("a" * 250)
    proc = kvtrace("convert", TRACE, "--limit", "3", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert out.read_text().count("\n") == 4 and sorted(p.name for p in tmp_path.iterdir()) == [out.name]
