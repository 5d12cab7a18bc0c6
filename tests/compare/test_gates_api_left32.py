"""The public functions of compare.gates and compare.render, called with what an API
caller may pass: one KVTraceError line naming the argument, never a Python traceback
(``parse_gate(None)`` was an AttributeError, a 5,000-character gate was quoted whole,
``check_fail_if(diff, "a:1")`` read its characters as gates, ``to_text(diff, 0)`` gave an
empty text, ``tables(diff, detail="no")`` the detail), and a second gate on a metric in
the same direction refused (one of the two never decided)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from kvtrace.compare.gates import check_fail_if, parse_gate, parse_gates
from kvtrace.compare.render import render, tables, to_json, to_markdown, to_text
from kvtrace.compare.source import diff_runs
from kvtrace.errors import KVTraceError


class Odd(str):
    def partition(self, sep):  # (a str subclass's own method never runs)
        raise RuntimeError("ran")


@pytest.fixture(scope="module")
def diff(replayed_store):
    return diff_runs(replayed_store.path, replayed_store.run_on, replayed_store.run_off)


def one_line(err: pytest.ExceptionInfo, *names: str, most: int = 400) -> str:
    text = str(err.value)
    assert "\n" not in text and len(text) <= most, text
    for name in names:
        assert name in text, text
    return text


@pytest.mark.parametrize("value", [None, 1, 2.5, b"a:1", ["a:1"], object()])
def test_parse_gate_refuses_what_is_no_string(value):
    with pytest.raises(KVTraceError) as err:
        parse_gate(value)
    one_line(err, "--fail-if", "expected METRIC:THRESHOLD")


@pytest.mark.parametrize("text", ["a:" + "9" * 5000, "x" * 100_000, "a:" + "1" * 5000 + "%", "a" * 5000 + ":zz",
                                  "a:\n\x1bq"])
def test_parse_gate_quotes_a_huge_or_odd_gate_cut(text):
    with pytest.raises(KVTraceError) as err:
        parse_gate(text)
    assert "\x1b" not in one_line(err, "--fail-if", most=300)


@pytest.mark.parametrize("text", ["a:nan", "a:inf", "a:-inf%", "a:1e400", "a:NaN%"])
def test_parse_gate_refuses_nan_and_inf(text):
    with pytest.raises(KVTraceError) as err:
        parse_gate(text)
    one_line(err, "finite")


def test_a_str_subclass_is_read_as_its_text():
    gate = parse_gate(Odd("p99_ttft_ms:+5"))
    assert (gate.metric, gate.threshold, type(gate.text)) == ("p99_ttft_ms", 5.0, str)


@pytest.mark.parametrize("gates", [["p99_ttft_ms:+5", "p99_ttft_ms:+10"], ["p99_ttft_ms:5", "p99_ttft_ms:+5"],
                                   ["a:-1%", "a:-2%"], ["a:-0", "a:-1"]])
def test_a_second_gate_in_one_direction_is_refused(gates):
    with pytest.raises(KVTraceError) as err:
        parse_gates(gates)
    one_line(err, "a second", "give one")


def test_a_band_and_a_relative_beside_an_absolute_gate_are_kept():
    assert len(parse_gates(["p99_ttft_ms:+5", "p99_ttft_ms:-5", "p99_ttft_ms:+10%", "p99_ttft_ms:-10%"])) == 4


@pytest.mark.parametrize("gates", [None, "p99_ttft_ms:+5", 5, [None], [b"a:1"]])
def test_check_fail_if_refuses_gates_that_are_no_list_of_strings(diff, gates):
    with pytest.raises(KVTraceError) as err:
        check_fail_if(diff, gates)
    one_line(err, "--fail-if")


def test_check_fail_if_reads_any_iterable_and_refuses_a_duplicate(diff):
    assert check_fail_if(diff, iter(["p99_ttft_ms:+1000000"])) == []
    with pytest.raises(KVTraceError, match="a second rise gate"):
        check_fail_if(diff, ["p99_ttft_ms:+5", "p99_ttft_ms:+5"])


@pytest.mark.parametrize("bad", [None, {}, "x", 1])
@pytest.mark.parametrize("call", [to_json, to_markdown, tables, render, to_text,
                                  lambda d: check_fail_if(d, ["p99_ttft_ms:+5"])])
def test_every_view_refuses_what_is_no_diff(bad, call):
    with pytest.raises(KVTraceError) as err:
        call(bad)
    one_line(err, "diff", "expected a RunDiff")


def test_a_list_of_diffs_is_named_cut(diff):
    with pytest.raises(KVTraceError) as err:
        to_json([diff])
    one_line(err, "expected a RunDiff")


@pytest.mark.parametrize("width", [0, -1, 5, 2.5, "80", True, None, 10**9])
def test_to_text_refuses_a_width_it_cannot_lay_out(diff, width):
    with pytest.raises(KVTraceError) as err:
        to_text(diff, width)
    one_line(err, "width")


@pytest.mark.parametrize("metrics", ["prefix_cache_hit_rate", 5, [1], [None], ["no_such_metric"]])
def test_tables_and_render_refuse_metrics_they_cannot_show(diff, metrics):
    for call in (lambda: tables(diff, metrics), lambda: render(diff, Console(file=io.StringIO()), metrics)):
        with pytest.raises(KVTraceError) as err:
            call()
        one_line(err, "metrics", most=1200)


@pytest.mark.parametrize("detail", [None, "no", 1, 0])
def test_detail_is_a_bool(diff, detail):
    with pytest.raises(KVTraceError) as err:
        tables(diff, detail=detail)
    one_line(err, "detail", "True or False")


@pytest.mark.parametrize("console", [1, "x", object()])
def test_render_refuses_what_is_no_console(diff, console):
    with pytest.raises(KVTraceError) as err:
        render(diff, console)
    one_line(err, "console")


def test_the_views_still_read_good_arguments(diff):
    assert to_text(diff, 80) and to_json(diff)["metrics"]
    assert len(tables(diff, ["prefix_cache_hit_rate"], detail=False)[0].rows) == 1


def test_the_cli_refuses_a_repeated_gate_before_any_output(replayed_store):
    import subprocess
    import sys
    from pathlib import Path

    kvtrace = str(Path(sys.executable).with_name("kvtrace"))
    done = subprocess.run([kvtrace, "diff", replayed_store.run_on, replayed_store.run_off, "--db",
                           replayed_store.path, "--fail-if", "p99_ttft_ms:+5", "--fail-if", "p99_ttft_ms:+10"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.startswith("kvtrace: error: --fail-if 'p99_ttft_ms:+10': a second rise gate")
    assert done.stderr.count("\n") == 1


@pytest.mark.parametrize("value", ["x", [1], b"1", object()])
def test_fmt_refuses_what_is_no_number(value):
    from kvtrace.compare.render import fmt

    with pytest.raises(KVTraceError) as err:
        fmt(value)
    one_line(err, "value", "expected a number")


def test_fmt_shows_a_numpy_int_and_an_int_past_float():
    import numpy as np

    from kvtrace.compare.render import fmt

    assert (fmt(np.int64(5)), fmt(np.int64(5), signed=True)) == ("5", "+5")  # (read 5.000)
    assert fmt(10**400) == "1.00000e+400" and fmt(-(10**400), signed=True) == "-1.00000e+400"  # (OverflowError)
