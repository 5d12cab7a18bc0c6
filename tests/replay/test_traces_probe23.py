"""The twenty-third probe of trace readers, convert and generate: what their headers and
numbers say, against the trace they describe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtrace.replay.readers import native_header, read_trace
from tests.cli.support import run


def _mooncake(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": 600, "output_length": 1,
                                        "hash_ids": [i, 1000 + i]}) + "\n" for i in range(n)))
    return path


def _convert(capsys, *argv: str) -> None:
    code, _, err = run(["convert", *argv], capsys)
    assert code == 0, err


@pytest.mark.parametrize("first_limit", [None, 5])
def test_a_cut_of_a_converted_trace_says_how_many_of_the_first_source_it_keeps(tmp_path, capsys, first_limit):
    """A converted trace cut again (--limit 2) kept the earlier cut's converted_from_limit (5),
    or none (all of the source), in its header: 'how many of its requests are kept' said 5 or
    all of a file that holds 2 of them, until a further conversion said 2 of the same requests."""
    source = _mooncake(tmp_path / "m.jsonl", 8)
    once, twice, thrice = tmp_path / "once.jsonl", tmp_path / "twice.jsonl", tmp_path / "thrice.jsonl"
    _convert(capsys, str(source), "-o", str(once), *(("--limit", str(first_limit)) if first_limit else ()))
    _convert(capsys, str(once), "-o", str(twice), "--limit", "2")
    _convert(capsys, str(twice), "-o", str(thrice))
    cut, again = native_header(twice), native_header(thrice)
    kept = len(read_trace(twice))
    assert kept == 2 and cut["source_limit"] == 2 and cut["converted_from"].startswith("mooncake:sha256:")
    assert cut["converted_from_limit"] == kept, cut
    # the same requests say the same provenance, whichever file they are read from
    assert (again["converted_from"], again["converted_from_limit"]) == (cut["converted_from"], kept), again


def test_a_limit_that_cuts_nothing_leaves_the_first_sources_count_as_it_was(tmp_path, capsys):
    source = _mooncake(tmp_path / "m.jsonl", 8)
    once, twice = tmp_path / "once.jsonl", tmp_path / "twice.jsonl"
    _convert(capsys, str(source), "-o", str(once), "--limit", "5")
    _convert(capsys, str(once), "-o", str(twice), "--limit", "5")  # (all 5: no cut, no source_limit)
    header = native_header(twice)
    assert "source_limit" not in header and header["converted_from_limit"] == 5, header


LATER = '{"timestamp": 999999, "input_length": 10, "output_length": 1, "hash_ids": [77]}\n'


def test_a_trace_appended_while_read_is_refused_not_read_under_its_old_digest(tmp_path):
    """A request appended while a replay read the file was replayed, under the source_id
    (the run's trace_digest) of the bytes before: one trace's run named another."""
    from kvtrace.errors import TraceFormatError
    from kvtrace.replay.readers import open_trace

    path = _mooncake(tmp_path / "m.jsonl", 4)
    source = open_trace(path)
    assert len(source.source_id) == 64 and len(list(source)) == 4  # (read whole, unchanged: taken)
    read = []
    with pytest.raises(TraceFormatError, match=r"m\.jsonl: changed while kvtrace read it") as err:
        for req in source:
            read.append(req)
            if len(read) == 2:
                with open(path, "a") as f:
                    f.write(LATER)
    assert err.value.line is None and len(read) == 5  # (the appended request read, then refused)


def test_a_trace_replaced_after_it_was_hashed_is_refused_when_read(tmp_path):
    import os

    from kvtrace.errors import TraceFormatError
    from kvtrace.replay.readers import open_trace

    path = _mooncake(tmp_path / "m.jsonl", 4)
    source = open_trace(path)
    digest = source.source_id
    other = _mooncake(tmp_path / "other.jsonl", 3)
    os.replace(other, path)  # (an editor's or a generator's atomic save)
    with pytest.raises(TraceFormatError, match=r"m\.jsonl: changed while kvtrace read it"):
        list(source)
    assert open_trace(path).source_id != digest  # (read anew, it is the other trace, under its own digest)


def test_a_replay_of_a_trace_appended_while_read_is_one_line_and_records_nothing(tmp_path, capsys, monkeypatch):
    from kvtrace.replay import readers
    from tests.cli.support import assert_one_line

    path, db = _mooncake(tmp_path / "m.jsonl", 4), tmp_path / "s.duckdb"
    real = readers.READERS["mooncake"]

    def appending(file, **options):
        for i, req in enumerate(real(file, **options)):
            yield req
            if i == 1:
                with open(path, "a") as f:
                    f.write(LATER)

    monkeypatch.setitem(readers.READERS, "mooncake", appending)
    code, out, err = run(["replay", str(path), "--no-content", "--db", str(db), "--json"], capsys)
    assert_one_line(code, err, f"{path}: changed while kvtrace read it")
    assert out == ""
    assert not db.exists() or "r1" not in run(["runs", "--db", str(db), "--json"], capsys)[1]


def test_convert_to_a_pipe_says_what_it_wrote_before_a_bad_request(tmp_path):
    """Written in place (stdout, a FIFO), the requests before a bad line are out already: the
    error named the input's line alone, and a reader of the pipe took a trace cut short for
    the whole one (a line too long for the writer said so; a line the reader refused did not)."""
    import subprocess
    import sys

    from kvtrace.replay.readers.source import CHECKED_BEFORE_DIGEST

    n = CHECKED_BEFORE_DIGEST + 1  # (a bad line among the first ones is told before any is written)
    trace = _mooncake(tmp_path / "m.jsonl", n)
    with open(trace, "a") as f:
        f.write('{"timestamp": 9}\n')
    command = [sys.executable, "-m", "kvtrace.cli", "convert", str(trace), "-o"]
    proc = subprocess.run([*command, "/dev/stdout"], capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == 2 and len(proc.stdout.splitlines()) == 1 + n, proc.stderr  # (the header, then n)
    [line] = proc.stderr.splitlines()
    assert line.startswith(f"kvtrace: error: {trace}:{n + 1}: Object missing required field `input_length`"), line
    assert line.endswith(f"(/dev/stdout: the header and {n:,} requests written before it)"), line
    out = tmp_path / "out.jsonl"  # a file is replaced whole or not at all: nothing to say of it
    out.write_text("kept\n")
    proc = subprocess.run([*command, str(out)], capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == 2 and "written before it" not in proc.stderr and out.read_text() == "kept\n"


def test_an_output_through_stdout_onto_the_input_is_refused_not_appended_to_it(tmp_path):
    """`kvtrace convert t.jsonl -o /dev/stdout >> t.jsonl` appended the native trace to the
    Mooncake trace it read (exit 0, a file of two formats), where `-o t.jsonl` is refused: no
    command writes a trace over its own input. A DuckDB store appended to is refused too."""
    import subprocess
    import sys

    import duckdb

    trace = _mooncake(tmp_path / "m.jsonl", 3)
    before = trace.read_bytes()
    command = [sys.executable, "-m", "kvtrace.cli"]
    for out in ("/dev/stdout", "/dev/fd/1"):
        with open(trace, "ab") as stdout:
            proc = subprocess.run([*command, "convert", str(trace), "-o", out], stdout=stdout, stderr=subprocess.PIPE,
                                  text=True, check=False, timeout=120)
        assert proc.returncode == 2 and proc.stderr.splitlines() == [
            f"kvtrace: error: {out}: is also {trace}; write the output elsewhere"], proc.stderr
        assert trace.read_bytes() == before
    store = tmp_path / "s.duckdb"
    duckdb.connect(str(store)).close()
    kept = store.read_bytes()
    with open(store, "ab") as stdout:
        proc = subprocess.run([*command, "generate", "chat", "--requests", "1", "-o", "/dev/stdout"], stdout=stdout,
                              stderr=subprocess.PIPE, text=True, check=False, timeout=120)
    assert proc.returncode == 2 and "/dev/stdout: is a DuckDB database" in proc.stderr and store.read_bytes() == kept
    with open(tmp_path / "other.jsonl", "ab") as stdout:  # (any other file: appended to, as a redirection does)
        proc = subprocess.run([*command, "convert", str(trace), "-o", "/dev/stdout"], stdout=stdout,
                              stderr=subprocess.PIPE, text=True, check=False, timeout=120)
    assert proc.returncode == 0 and len(read_trace(tmp_path / "other.jsonl")) == 3, proc.stderr


@pytest.mark.parametrize(("encoding", "named"), [("utf-16", "UTF-16"), ("utf-32", "UTF-32")])
def test_a_wide_unicode_trace_is_named_as_such_with_how_to_convert_it(tmp_path, capsys, encoding, named):
    """A trace saved as UTF-16 (a Windows tool's export) was 'not UTF-8 text (byte 0xff at
    column 1)': true, but not what it is or how to read it."""
    text = _mooncake(tmp_path / "m.jsonl", 2).read_text(encoding="utf-8")
    wide = tmp_path / "w.jsonl"
    wide.write_bytes(text.encode(encoding))  # (Python's utf-16/utf-32 write the byte-order mark)
    folder = tmp_path / "weka"
    folder.mkdir()
    (folder / "c.json").write_bytes(json.dumps({"requests": []}).encode(encoding))
    for path in (wide, folder / "c.json"):
        code, _, err = run(["replay", str(path), "--mode", "cache-only"], capsys)
        assert code == 2 and err.splitlines() == [
            f"kvtrace: error: {path}: {named} text; kvtrace reads traces as UTF-8: convert it first "
            f"(iconv -f {named} -t UTF-8)"], err


def test_a_trace_rewritten_under_a_limited_read_is_refused(tmp_path):
    """A --limit read stopped before the end that checked the file: a trace rewritten (the
    same size, other bytes) while its first requests were read was replayed under the
    digest of the bytes before, exit 0."""
    import os

    from kvtrace.errors import TraceFormatError
    from kvtrace.replay.readers import open_trace

    path = _mooncake(tmp_path / "m.jsonl", 6)
    source = open_trace(path, limit=4)
    assert len(source.source_id) == 64
    text = path.read_text()
    with pytest.raises(TraceFormatError, match=r"m\.jsonl: changed while kvtrace read it"):
        for i, _ in enumerate(source):
            if i == 1:
                path.write_text(text.replace('"output_length": 1', '"output_length": 2'))  # (same size)
                os.utime(path, ns=(1, 1))  # (another time, as any write gives it on a coarse clock)


def test_a_trace_touched_or_rewritten_with_its_own_bytes_is_read_on(tmp_path):
    """A touch (a backup tool's, a sync's) or a copy of the same bytes over the trace made it
    'changed while kvtrace read it', exit 2 and the run failed: the bytes are hashed again and
    the read goes on where they are the same."""
    import os

    from kvtrace.replay.readers import open_trace

    for limit in (None, 3):
        path = _mooncake(tmp_path / f"m{limit}.jsonl", 5)
        source = open_trace(path, limit=limit)
        digest, text = source.source_id, path.read_bytes()
        read = 0
        for read, _ in enumerate(source, 1):
            if read == 1:
                os.utime(path, ns=(10**9, 10**9))
            if read == 2:
                path.write_bytes(text)
        assert read == (5 if limit is None else 3) and source.source_id == digest
        assert len(list(source)) == read  # (and again, the new time taken as the file's)


def test_a_conversation_added_to_a_weka_folder_while_read_is_refused(tmp_path):
    """The folder was listed again as it was read: a file added meanwhile was replayed under
    the digest of the files listed before (7 requests under the digest of 6)."""
    import shutil

    from kvtrace.errors import TraceFormatError
    from kvtrace.replay.readers import open_trace

    conversation = Path(__file__).resolve().parents[1] / "data" / "weka_sample" / "trace_0211.json"
    folder = tmp_path / "wk"
    folder.mkdir()
    shutil.copy(conversation, folder / "a.json")
    source = open_trace(str(folder))
    assert len(source.source_id) == 64 and len(list(source)) > 0  # (read whole, unchanged: taken)
    with pytest.raises(TraceFormatError, match=r"wk: changed while kvtrace read it"):
        shutil.copy(conversation, folder / "b.json")
        list(source)
