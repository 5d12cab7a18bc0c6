"""Trace formats at their edges: what a probe of the readers, ``convert`` and the writers
found, each held here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvtrace.errors import TraceFormatError
from kvtrace.replay.readers import detect_format, read_trace
from kvtrace.workload import lines
from tests.cli.support import assert_one_line, run


def _conversation(n: int) -> dict:
    return {"id": "c", "block_size": 64, "hash_id_scope": "local",
            "requests": [{"t": float(i), "in": 150, "out": 3, "hash_ids": [1, 2]} for i in range(n)]}


def test_a_weka_conversation_on_one_line_longer_than_a_trace_line_is_detected(tmp_path, monkeypatch, capsys):
    """A conversation is one JSON document, read whole up to 256 MiB; written on one line
    (``json.dump``'s way) past the 64 MiB a line format's line may have, detection refused
    it as 'line longer than 64 MiB; expected one request a line', while ``--format weka``
    (or its directory) read it."""
    monkeypatch.setattr(lines, "MAX_LINE_BYTES", 1 << 10)  # (the bound, at a size a test can write)
    conv = tmp_path / "conv.json"
    conv.write_text(json.dumps(_conversation(40)))
    assert conv.stat().st_size > lines.MAX_LINE_BYTES and "\n" not in conv.read_text()
    assert detect_format(str(conv)) == "weka"
    assert len(read_trace(conv)) == 40
    code, out, err = run(["replay", str(conv), "--mode", "cache-only", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["requests"] == 40
    # a line format's file of such a line is still refused at it
    jsonl = tmp_path / "conv.jsonl"
    jsonl.write_text(conv.read_text() + "\n")
    code, _, err = run(["replay", str(jsonl), "--mode", "cache-only"], capsys)
    assert_one_line(code, err, f"{jsonl}:1: line longer than")


def test_mooncake_ids_survive_a_write_back_only_where_numbered_as_the_writer_numbers_them(tmp_path):
    """The page said a Mooncake trace read and written back gives the same ids, of any trace:
    ids not numbered from 0 in order of first appearance are renumbered, the same requests
    sharing them (the same replay)."""
    from kvtrace.replay.cache_only import replay_cache_only
    from kvtrace.replay.writers import write_mooncake
    from tests.conftest import TRACES

    published = read_trace(TRACES / "formats" / "mooncake_fast25.jsonl")
    write_mooncake(published, tmp_path / "back.jsonl")
    assert [r.hash_ids for r in read_trace(tmp_path / "back.jsonl")] == [r.hash_ids for r in published]

    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"timestamp": t, "input_length": 600, "output_length": 1, "hash_ids": ids})
                             + "\n" for t, ids in ((0, [5, 9]), (1, [5, 7]), (2, [5, 9]))))
    write_mooncake(read_trace(other), tmp_path / "renumbered.jsonl")
    again = read_trace(tmp_path / "renumbered.jsonl")
    assert [r.hash_ids for r in again] == [(0, 1), (0, 2), (0, 1)]
    hits = [replay_cache_only(read_trace(p)).summary()["prefix_cache_hits"]
            for p in (other, tmp_path / "renumbered.jsonl")]
    assert hits[0] == hits[1] > 0
    doc = (Path(__file__).resolve().parents[2] / "docs" / "trace-format.md").read_text()
    assert "other ids are renumbered" in " ".join(doc.split())


def test_converting_a_generated_workload_names_the_command_that_writes_it(tmp_path, capsys, monkeypatch):
    """`kvtrace convert gen:chat` said 'gen:chat: no such file or directory', though replay
    takes gen:chat as a trace; a file of that name is still converted."""
    monkeypatch.chdir(tmp_path)
    code, _, err = run(["convert", "gen:chat", "-o", "out.jsonl"], capsys)
    assert_one_line(code, err, "gen:chat: a generated workload", "`kvtrace generate chat -o FILE`")
    assert not (tmp_path / "out.jsonl").exists()
    (tmp_path / "gen:chat").write_text(json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1,
                                                   "hash_ids": [0]}) + "\n")
    code, _, err = run(["convert", "gen:chat", "-o", "out.jsonl"], capsys)
    assert code == 0, err
    assert len(read_trace(tmp_path / "out.jsonl")) == 1


@pytest.mark.parametrize("chat_id", [-1, -7])
def test_a_negative_bailian_chat_id_is_refused_at_its_line(tmp_path, chat_id):
    """A chat -1 was read, and the next turn naming parent -1 became a first turn of its own
    session (-1 marks a first turn); a chat below it could be no turn's parent either."""
    def turn(cid: int, parent: int, t: float) -> str:
        return json.dumps({"chat_id": cid, "parent_chat_id": parent, "timestamp": t, "input_length": 20,
                           "output_length": 1, "type": "text", "turn": 1, "hash_ids": [0, 1]}) + "\n"

    trace = tmp_path / "b.jsonl"
    trace.write_text(turn(0, -1, 0.0) + turn(chat_id, -1, 0.5) + turn(5, chat_id, 1.0))
    with pytest.raises(TraceFormatError, match=re.escape(f"b.jsonl:2: chat_id: expected >= 0, got {chat_id}")):
        read_trace(trace)


@pytest.mark.parametrize("where", ["request", "sub-agent request"])
def test_a_weka_request_without_out_is_refused_at_its_line(tmp_path, where):
    """A request without ``out`` (the tester writes it on every one) was replayed as one of 0
    output tokens: no decode, other latencies, and no word of it."""
    conv = _conversation(2)
    del conv["requests"][1]["out"]
    if where == "sub-agent request":
        conv["requests"][1] = {"t": 1.0, "type": "subagent", "agent_id": "a", "requests": [conv["requests"][1]]}
    trace = tmp_path / "c.json"
    trace.write_text(json.dumps(conv, indent=1))
    key = "requests[1].out" if where == "request" else "requests[1].requests[0].out"
    with pytest.raises(TraceFormatError, match=re.escape(f"c.json:{_line_of(trace, 1)}: {key}: missing")):
        read_trace(trace)


def _line_of(path: Path, index: int) -> int:
    """1-based line where ``requests[index]`` of an indented conversation starts."""
    from kvtrace.replay.readers.weka import request_line

    line = request_line(path.read_text(), index)
    assert line is not None
    return line


@pytest.mark.parametrize("salt", ["", "a" * 129, "tenant/a", "a@b", "back\\slash", "nul\x00"])
def test_a_native_salt_vllm_refuses_is_refused_at_its_line(tmp_path, salt):
    """An empty salt kept its requests apart from unsalted ones, where vLLM's cache reads it
    as none (``if request.cache_salt``) and its API refuses it, as it refuses these others:
    no vLLM request carried one."""
    from kvtrace.workload.native import MAX_CACHE_SALT

    trace = tmp_path / "n.jsonl"
    rows = [{"kvtrace_trace": 1, "block_size": 16},
            {"request_id": "a", "arrival_ns": 0, "input_length": 32, "output_length": 1, "hash_ids": [0, 1]},
            {"request_id": "b", "arrival_ns": 1, "input_length": 32, "output_length": 1, "hash_ids": [0, 1],
             "cache_salt": salt}]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(TraceFormatError, match=re.escape(f"n.jsonl:3: cache_salt: expected 1 to {MAX_CACHE_SALT} "
                                                         "characters")):
        read_trace(trace)
    rows[2]["cache_salt"] = "a" * MAX_CACHE_SALT  # (the longest vLLM takes)
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_trace(trace)[1].cache_salt == "a" * MAX_CACHE_SALT


@pytest.mark.parametrize("text, line", [
    ("TIMESTAMP,ContextTokens,GeneratedTokens\r2023-11-16 18:15:46,374,44\r", 1),  # (an old Mac's line ends)
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,374,44\n2023-11-16 18:15:47,3\r74,44\n", 3),
])
def test_a_carriage_return_in_an_azure_field_is_told_without_csvs_advice_to_programmers(tmp_path, capsys, text, line):
    """csv's 'new-line character seen in unquoted field - do you need to open the file in
    universal-newline mode?' was the error, a question about Python's open()."""
    trace = tmp_path / "a.csv"
    trace.write_bytes(text.encode())
    code, _, err = run(["replay", str(trace), "--mode", "cache-only"], capsys)
    told = assert_one_line(code, err, f"a.csv:{line}: unreadable CSV ", "carriage return (\\r)", "LF or CRLF")
    assert "universal-newline" not in told


def test_a_weka_files_identity_holds_its_name_which_names_its_requests(tmp_path):
    """A renamed copy of a conversation was the same trace (its bytes' sha256), so `diff`
    compared its runs unasked, pairing none of their requests (`a/0` against `b/0`, their
    tokens in other namespaces too). Its name and bytes are its identity, as a directory's
    files' are: the same file elsewhere, or alone in a directory, is the same trace."""
    from kvtrace.replay.readers import open_trace

    text = json.dumps(_conversation(2))
    for where in ("one", "two", "renamed", "folder"):
        (tmp_path / where).mkdir()
    for path in (tmp_path / "one" / "a.json", tmp_path / "two" / "a.json", tmp_path / "renamed" / "b.json",
                 tmp_path / "folder" / "a.json"):
        path.write_text(text)
    a, elsewhere, renamed = (open_trace(tmp_path / p) for p in ("one/a.json", "two/a.json", "renamed/b.json"))
    assert [r.request_id for r in a] == ["a/0", "a/1"] and [r.request_id for r in renamed] == ["b/0", "b/1"]
    assert a.source_id == elsewhere.source_id == open_trace(tmp_path / "folder").source_id
    assert renamed.source_id != a.source_id


@pytest.mark.parametrize("fmt", [None, "mooncake", "weka"])
def test_a_parquet_export_given_as_the_trace_is_named_as_such(tmp_path, capsys, fmt):
    """`kvtrace export` writes Parquet; given back to replay it was 'spans.parquet:1: not UTF-8
    text (byte 0xb5 at column 20)', with no word of what the file is."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / ("spans.json" if fmt == "weka" else "spans.parquet")
    pq.write_table(pa.table({"seq": [1, 2]}), path)
    code, _, err = run(["replay", str(path), "--mode", "cache-only", *(["--format", fmt] if fmt else [])], capsys)
    assert_one_line(code, err, f"{path}: a Parquet file (a kvtrace export?), not a trace")


@pytest.mark.parametrize("scope", ["local", "global"])
def test_a_weka_id_where_kvtrace_numbers_tails_is_refused_so_a_tail_never_hits(tmp_path, scope):
    """A tail's id is 2^62 + its index (global files: offset by their name's hash); a file's
    own id there (ids were taken up to 2^63) was the same block as a tail: the tail hit."""
    from kvtrace.replay.cache_only import replay_cache_only
    from kvtrace.replay.readers.weka import TAIL_ID_BASE

    def conversation(second: int) -> str:
        return json.dumps({"block_size": 64, "hash_id_scope": scope, "requests": [
            {"t": 0.0, "in": 100, "out": 1, "hash_ids": [1]},  # (its tail: request 0's)
            {"t": 1.0, "in": 128, "out": 1, "hash_ids": [1, second]}]}, indent=1)

    trace = tmp_path / "c.json"
    trace.write_text(conversation(TAIL_ID_BASE - 1))  # (the highest id a file may hold)
    assert replay_cache_only(read_trace(trace)).summary()["prefix_cache_hits"] == 64  # block 1 alone
    tail = read_trace(trace)[0].hash_ids[1]
    trace.write_text(conversation(tail))
    with pytest.raises(TraceFormatError, match=re.escape(f"c.json:{_line_of(trace, 1)}: requests[1].hash_ids: ids "
                                                         "must lie in [0, 2^62)")):
        read_trace(trace)


def test_a_conversation_named_json_in_another_case_is_named_not_skipped(tmp_path):
    """A directory's ``B.JSON`` was left out without a word (``*.json`` is matched as it is
    spelt): 1 of 2 conversations replayed, as compressed ones were before they were named."""
    folder = tmp_path / "w"
    folder.mkdir()
    (folder / "a.json").write_text(json.dumps(_conversation(1)))
    (folder / "B.JSON").write_text(json.dumps(_conversation(1)))
    (folder / ".hidden.JSON").write_text("not read, as hidden files are not")
    with pytest.raises(TraceFormatError, match=re.escape(f"{folder / 'B.JSON'}: named .JSON, not .json (1 such in")):
        read_trace(folder)
    (folder / "B.JSON").rename(folder / "b.json")
    assert len(read_trace(folder)) == 2
