"""``kvtrace runs`` on a terminal 80, 100 or 200 columns wide: the columns that do not fit
are left out, least wanted first, and a line on stderr names them; every cell shown but a
run's name, trace and behaviours stays on one line (its 13 columns at 80 folded every
header, id, date and number to three characters a line). Piped, and with --json, nothing
changes with the width."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest

KVTRACE = str(Path(sys.executable).with_name("kvtrace"))
ALWAYS = ("run", "name", "status", "prefix_cache_hit_rate")
ONE_LINE = ("run", "mode", "backend", "capacity", "status", "created", "requests", "prefix_cache_hit_rate",
            "median_ttft_ms", "median_itl_ms")
_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def on_terminal(args: list[str], columns: int, program: str = KVTRACE) -> tuple[str, str]:
    """stdout (escapes dropped) and stderr of ``kvtrace ARGS`` with a pseudo-terminal as its stdout."""
    leader, follower = pty.openpty()
    env = {**os.environ, "COLUMNS": str(columns), "LINES": "50", "TERM": "xterm"}
    with subprocess.Popen([program, *args], stdout=follower, stderr=subprocess.PIPE, env=env) as proc:
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # (EIO: the child closed it)
                break
            if not chunk:
                break
            chunks.append(chunk)
        err = proc.stderr.read().decode() if proc.stderr else ""
    os.close(leader)
    assert proc.returncode == 0, err
    return _ESCAPE.sub("", b"".join(chunks).decode().replace("\r\n", "\n")), err


def piped(args: list[str], columns: int) -> str:
    done = subprocess.run([KVTRACE, *args], capture_output=True, text=True, check=False,
                          env={**os.environ, "COLUMNS": str(columns)})
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("columns", [80, 100, 200])
def test_runs_fits_the_terminal_and_names_what_it_leaves_out(replayed_store, columns):
    out, err = on_terminal(["runs", "--db", replayed_store.path], columns)
    lines = out.splitlines()
    assert all(len(line) <= columns for line in lines), out
    header = next(line for line in lines if line.startswith("┃"))
    shown = [h.strip() for h in header.strip("┃").split("┃")]
    assert set(ALWAYS) <= set(shown), out
    listed = json.loads(piped(["runs", "--db", replayed_store.path, "--json"], columns))["runs"]
    every = ["run", "name", "trace", "mode", "backend", "behaviours", "capacity", "status", "created", "requests",
             "prefix_cache_hit_rate", "median_ttft_ms", "median_itl_ms"]
    left_out = [h for h in every if h not in shown]
    if left_out:
        assert f"columns left out to fit the terminal: {', '.join(left_out)}" in err
    else:
        assert "left out" not in err
    rows = [line for line in lines if line.startswith("│")]
    for run in listed:  # each run's row starts a line, its one-line cells whole on it
        row = next(line for line in rows if line.strip("│ ").startswith(run["run_id"] + " "))
        cells = [c.strip() for c in row.strip("│").split("│")]
        values = dict(zip(shown, cells, strict=True))
        assert values["run"] == run["run_id"] and values["status"] == run["status"]
        assert re.fullmatch(r"\d+\.\d\d%", values["prefix_cache_hit_rate"]), row
        if "created" in values:
            assert values["created"] == run["created"]
        at = rows.index(row) + 1
        while at < len(rows) and rows[at].strip("│").split("│")[0].strip() == "":  # (its continuation lines)
            more = dict(zip(shown, (c.strip() for c in rows[at].strip("│").split("│")), strict=True))
            assert not any(more[name] for name in ONE_LINE if name in more), rows[at]
            at += 1
    if columns == 200:  # (a store's 25-character dates, the last wanted, may be all that is left out)
        assert left_out in ([], ["created"])


def test_piped_and_json_output_do_not_change_with_the_width(replayed_store):
    for args in (["runs", "--db", replayed_store.path, "--json"], ["runs", "--db", replayed_store.path]):
        assert piped(args, 80) == piped(args, 300)
    table = piped(["runs", "--db", replayed_store.path], 80)
    assert "median_itl_ms" in table and "created" in table


SWEEP_LIKE = r'''
import sys
from kvtrace.cli.output import print_rows
rows = [["capacity_blocks", "retention", "prefix_cache_hit_rate", "prefix_cache_hits", "evictions",
         "median_ttft_ms", "median_itl_ms", "divergent_outputs"],
        ["20", "0", "34.09% (baseline)", "11,264 (baseline)", "115 (baseline)", "56.450 (baseline)",
         "5.370 (baseline)", "0 (baseline)"],
        ["40", "1024", "50.75% (+16.66pp)", "16,768 (+5,504)", "81 (-34)", "58.294 (+1.845)", "5.369 (-0.000)",
         "0 (+0)"]]
left_out = print_rows(rows, title="sweep", left=2, priority=rows[0][2:], wrap=frozenset(rows[0][2:]))
print("left out:", ",".join(left_out), file=sys.stderr)
'''


@pytest.mark.parametrize("columns", [80, 100, 200])
def test_wrapped_columns_break_at_spaces_never_inside_a_word(columns, tmp_path):
    """print_rows' ``wrap`` columns (a sweep's "34.09% (+0.00pp)" cells): a cell takes more
    lines at its spaces, never folded inside a number or a header, and what does not fit is
    left out (at 80 the sweep's 8 columns folded "(baseline)" and every header mid-word)."""
    script = tmp_path / "rows.py"
    script.write_text(SWEEP_LIKE)
    out, err = on_terminal([str(script)], columns, program=sys.executable)
    words = {w for line in SWEEP_LIKE.splitlines() for w in re.findall(r'"([^"]+)"', line)}
    words = {w for cell in words for w in cell.split(" ")}
    printed = {w for line in out.splitlines() if line[:1] in ("│", "┃")
               for cell in line.strip("│┃").split("│" if "│" in line else "┃") for w in cell.split()}
    header = next(line for line in out.splitlines() if line.startswith("┃"))
    for cell in header.strip("┃").split("┃"):
        assert cell.strip() in words, header  # (a header whole on its line)
    assert printed <= words, out  # (no word cut: each printed word is a whole one)
    assert all(len(line) <= columns for line in out.splitlines())
    assert ("median_ttft_ms" in header) == (columns >= 200) and err.startswith("left out:")
