"""Trace readers, `convert` and the native writer, re-probed with hostile files (round 21):
what convert writes its own reader takes back, and every refusal names the line at fault."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtrace.errors import KVTraceError, TraceFormatError
from kvtrace.replay.readers import open_trace, read_trace
from kvtrace.workload import lines, native
from kvtrace.workload.lines import MAX_TOKENS
from tests.cli.support import assert_one_line, run

ONE_ID = {"timestamp": 0, "input_length": 500, "output_length": 1, "hash_ids": [7]}


@pytest.fixture
def mooncake(tmp_path: Path) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(ONE_ID) + "\n")
    return path


# -- --trace-block-size past what a trace may say -----------------------------------------

def test_a_trace_block_size_past_the_bound_is_refused_at_its_flag(tmp_path: Path, capsys, mooncake):
    """2^40 was taken: convert wrote a native trace whose own reader refused its block_size
    (exit 0, an unreadable output), and an engine replay ran for minutes on 12 GB."""
    out = tmp_path / "out.jsonl"
    code, stdout, err = run(["convert", str(mooncake), "-o", str(out), "--trace-block-size", str(2**40)], capsys)
    assert_one_line(code, err, "t.jsonl", "--trace-block-size", "1,099,511,627,776", f"at most {MAX_TOKENS:,}")
    assert not out.exists() and stdout == ""


def test_the_largest_trace_block_size_converts_to_a_trace_its_reader_takes(tmp_path: Path, mooncake):
    out = tmp_path / "out.jsonl"
    native.write_native(open_trace(mooncake, block_size=MAX_TOKENS), out)
    [req] = read_trace(out)
    assert req.hash_block_size == MAX_TOKENS and req.hash_ids == (7,)
    with pytest.raises(TraceFormatError, match="--trace-block-size"):
        open_trace(mooncake, block_size=MAX_TOKENS + 1)


def test_a_bool_block_size_is_no_block_size(mooncake):
    with pytest.raises(TraceFormatError, match="block_size: expected an int >= 1, got True"):
        open_trace(mooncake, block_size=True)


# -- the native writer never writes a line its reader refuses -----------------------------

AZURE = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,8,1\n2023-11-16 18:15:47,400,1\n"


def test_convert_refuses_a_line_longer_than_a_reader_takes(tmp_path: Path, capsys, monkeypatch):
    """An Azure row names a length, not content: at --trace-block-size 1 a 7M-token row became
    a 77 MB native line, written with exit 0, which the reader then refused (64 MiB a line).
    Here the bound is lowered to 1 KiB for both sides; the earlier output is kept."""
    monkeypatch.setattr(lines, "MAX_LINE_BYTES", 1024)
    monkeypatch.setattr(native, "MAX_LINE_BYTES", 1024)
    trace = tmp_path / "a.csv"
    trace.write_text(AZURE)
    out = tmp_path / "out.jsonl"
    out.write_text("earlier\n")
    code, stdout, err = run(["convert", str(trace), "-o", str(out), "--trace-block-size", "1"], capsys)
    assert_one_line(code, err, "out.jsonl", "request r1", "nothing written")
    assert out.read_text() == "earlier\n" and stdout == ""
    assert not list(tmp_path.glob("*.tmp-*"))


def test_convert_to_a_pipe_says_what_it_wrote_before_a_line_too_long(tmp_path: Path):
    """To stdout (or a FIFO) the lines before the refused one are out already: the error said
    "nothing written" beside the header and r0 on stdout."""
    import subprocess
    import sys

    trace = tmp_path / "b.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,10,4\n"
                     "2023-11-16 18:15:47,16777215,4\n")
    proc = subprocess.run([sys.executable, "-m", "kvtrace.cli", "convert", str(trace), "-o", "/dev/stdout",
                           "--trace-block-size", "1"], capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == 2 and len(proc.stdout.splitlines()) == 2, proc.stderr  # (the header and r0)
    assert "the header and 1 request written before it" in proc.stderr and "nothing written" not in proc.stderr


def test_the_longest_line_written_is_one_the_reader_takes(tmp_path: Path, monkeypatch):
    """The writer's bound and the reader's are the same bytes: a line that ends exactly at the
    reader's bound (its newline included) is written and read back; one byte more is refused."""
    [req] = read_trace(_csv(tmp_path), limit=1, block_size=1)
    width = len(native._encode(native.native_record(req))) + 1  # (its newline)
    out = tmp_path / "out.jsonl"
    for bound, fits in ((width, True), (width - 1, False)):
        monkeypatch.setattr(lines, "MAX_LINE_BYTES", bound)
        monkeypatch.setattr(native, "MAX_LINE_BYTES", bound)
        if fits:
            native.write_native([req], out)
            assert read_trace(out) == [req]
        else:
            with pytest.raises(KVTraceError, match="would be a line of"):
                native.write_native([req], out)


def _csv(tmp_path: Path) -> Path:
    trace = tmp_path / "a.csv"
    trace.write_text(AZURE)
    return trace


# -- a pretty-printed WEKA conversation: the line of the key at fault -----------------------

def _pretty_weka(tmp_path: Path, **top) -> tuple[Path, list[str]]:
    conv = {"id": "c", "hash_id_scope": "local", "requests": [{"t": 0, "in": 20, "out": 1, "hash_ids": [1]}],
            "block_size": 16, **top}
    path = tmp_path / "c.json"
    text = json.dumps(conv, indent=2)
    path.write_text(text)
    return path, text.splitlines()


@pytest.mark.parametrize("key,value,what", [
    ("block_size", 0, "block_size: expected > 0, got 0"),
    ("block_size", 2**40, "block_size: 1099511627776 is beyond"),
    ("block_size", "16", "Expected `int`, got `str` - at `$.block_size`"),
    ("hash_id_scope", "bogus", "hash_id_scope: expected 'local' or 'global'"),
    ("id", 5, "Expected `str | null`, got `int` - at `$.id`"),
])
def test_a_top_level_key_of_a_pretty_weka_file_is_named_at_its_line(tmp_path: Path, key, value, what):
    """Each was named at line 1, the object's first, wherever the key stood."""
    path, text = _pretty_weka(tmp_path, **{key: value})
    at = next(i for i, t in enumerate(text, start=1) if t.lstrip().startswith(f'"{key}"'))
    assert at > 1
    with pytest.raises(TraceFormatError) as err:
        read_trace(path)
    assert err.value.line == at and what in err.value.what, str(err.value)


def test_a_repeated_weka_key_is_named_where_the_value_read_stands(tmp_path: Path):
    """msgspec reads a repeated key's last value (the same one twice is taken): the line named
    is that one's."""
    path = tmp_path / "c.json"
    path.write_text('{\n"block_size": 0,\n"requests": [],\n"block_size": 0\n}\n')
    with pytest.raises(TraceFormatError) as err:
        read_trace(path)
    assert err.value.line == 4 and "block_size: expected > 0" in err.value.what


# -- lines that end in CR alone ---------------------------------------------------------

@pytest.mark.parametrize("fmt", [None, "mooncake"])
def test_lines_that_end_in_a_carriage_return_alone_are_told_so(tmp_path: Path, fmt):
    """An old Mac file's lines are one line to a JSONL reader: it said only "trailing
    characters (byte 79)"."""
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\r".join(json.dumps({**ONE_ID, "timestamp": i}).encode() for i in range(3)) + b"\r")
    with pytest.raises(TraceFormatError) as err:
        read_trace(path, fmt)
    assert err.value.line == 1 and "lines must end in LF or CRLF, not in CR alone" in err.value.what


@pytest.mark.parametrize("tail", [" x", "{}", "\r\n{} \t{}"])
def test_trailing_characters_without_a_carriage_return_get_no_such_hint(tmp_path: Path, tail):
    path = tmp_path / "t.jsonl"
    path.write_bytes((json.dumps(ONE_ID) + tail.replace("{}", json.dumps(ONE_ID)) + "\n").encode())
    with pytest.raises(TraceFormatError) as err:
        read_trace(path, "mooncake")
    assert "trailing characters" in err.value.what and "carriage return" not in err.value.what


# -- a key given twice with two values ---------------------------------------------------

NATIVE_HEAD = '{"kvtrace_trace": 1, "block_size": 512}\n'
NATIVE_LINE = '{"arrival_ns": 0, "input_length": 500, "output_length": 1, "hash_ids": [7]'
BAILIAN_LINE = ('{"chat_id": 0, "parent_chat_id": -1, "timestamp": 0, "input_length": 16, "output_length": 1, '
                '"hash_ids": [7]')


@pytest.mark.parametrize("name,text,line,key", [
    ("t.jsonl", '{"timestamp": 0, "timestamp": 5, "input_length": 500, "output_length": 1, "hash_ids": [7]}\n', 1,
     "timestamp"),
    ("t.jsonl", json.dumps(ONE_ID) + "\n" + json.dumps(ONE_ID)[:-1] + ', "hash_ids": [8]}\n', 2, "hash_ids"),
    ("b.jsonl", BAILIAN_LINE + ', "chat_id": 3}\n', 1, "chat_id"),
    ("n.jsonl", NATIVE_HEAD + NATIVE_LINE + ', "arrival_ns": 5}\n', 2, "arrival_ns"),
    ("n.jsonl", '{"kvtrace_trace": 1, "block_size": 16, "block_size": 512}\n' + NATIVE_LINE + "}\n", 1, "block_size"),
    ("c.json", '{"block_size": 16, "requests": [], "block_size": 32}', 1, "block_size"),
    ("c.json", '{"block_size": 16, "requests": [{"t": 0, "in": 20, "out": 1, "out": 9, "hash_ids": [1]}]}', 1, "out"),
    # the second written escaped: the cheap count saw one "timestamp" and let msgspec take 5
    ("t.jsonl", '{"timestamp": 0, "timest\\u0061mp": 5, "input_length": 500, "output_length": 1, "hash_ids": [7]}\n',
     1, "timestamp"),
])
def test_a_key_given_twice_with_two_values_is_refused(tmp_path: Path, name, text, line, key):
    """msgspec read the last value unsaid (Python's json too): "timestamp": 0 then 5 was a
    request at 5 ms, where another reader takes 0."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(TraceFormatError) as err:
        read_trace(path)
    assert err.value.line == line and f"key `{key}` given twice in one object" in err.value.what, str(err.value)


@pytest.mark.parametrize("name,text", [
    ("t.jsonl", '{"timestamp": 0, "timestamp": 0.0, "input_length": 500, "output_length": 1, "hash_ids": [7]}\n'),
    ("t.jsonl", '{"timestamp": 0, "input_length": 500, "output_length": 1, "hash_ids": [7], "x": 1, "x": 2}\n'),
    ("t.jsonl", '{"timestamp": 0, "input_length": 500, "output_length": 1, "hash_ids": [7], "n": "\\"timestamp\\""}\n'),
    ("n.jsonl", '{"kvtrace_trace": 1, "block_size": 512, "m": {"a": 1, "a": 2}, "block_size": 512}\n' + NATIVE_LINE
     + "}\n"),
])
def test_a_key_given_twice_with_one_value_or_unread_is_taken(tmp_path: Path, name, text):
    """The same value twice says one thing, and a key no reader reads changes nothing."""
    path = tmp_path / name
    path.write_text(text)
    [req] = read_trace(path)
    assert req.arrival_ns == 0 and req.hash_ids == (7,)


def test_the_trace_format_page_states_the_line_bound():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "trace-format.md").read_text(encoding="utf-8")
    assert f"A line holds at most {lines.MAX_LINE_BYTES >> 20} MiB" in doc


# -- Azure timestamps told in the file's own words ----------------------------------------

AZURE_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


@pytest.mark.parametrize("rows,what", [
    (["2023-11-16 18:15:50,1,1", "2023-11-16 18:15:46.5,1,1"],
     "TIMESTAMP goes back in time ('2023-11-16 18:15:46.5' < previous '2023-11-16 18:15:50')"),
    (["0001-01-01 00:00:00,1,1", "9999-12-31 23:59:59,1,1"],
     "TIMESTAMP: '9999-12-31 23:59:59' is 4,611,686,018 s or more after the first row's '0001-01-01 00:00:00'"),
])
def test_an_azure_timestamp_out_of_order_or_range_is_quoted(tmp_path: Path, rows, what):
    """Both were told in ns after the first row: "(-3500000000 ns < previous 0 ns)", and
    "315537897599000000000 is not a time kvtrace can replay"."""
    path = tmp_path / "a.csv"
    path.write_text(AZURE_HEAD + "\n".join(rows) + "\n")
    with pytest.raises(TraceFormatError) as err:
        read_trace(path)
    assert err.value.line == 3 and what in err.value.what, str(err.value)


def test_equal_and_leap_second_azure_timestamps_are_in_order(tmp_path: Path):
    path = tmp_path / "a.csv"
    path.write_text(AZURE_HEAD + "2023-11-16 23:59:59,1,1\n2023-11-16 23:59:60,1,1\n2023-11-17 00:00:00,1,1\n"
                    "2023-11-17 00:00:00,1,1\n")
    assert [r.arrival_ns for r in read_trace(path)] == [0, 10**9, 10**9, 10**9]
