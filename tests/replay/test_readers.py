"""Trace readers on the shared public samples and on malformed inputs."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from kvtrace.errors import TraceFormatError
from kvtrace.replay.readers import FORMATS, detect_format, native_header, open_trace, read_trace
from kvtrace.replay.readers.azure import AZURE_NAMESPACE, parse_timestamp_ns
from kvtrace.replay.readers.weka import TAIL_ID_BASE, namespace_for
from tests.conftest import TRACES

MOONCAKE = TRACES / "mooncake_synthetic_trace.jsonl"
AZURE = TRACES / "AzureLLMInferenceTrace_conv.csv"
WEKA = TRACES / "weka_sample"



def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def line(**kw) -> str:
    return json.dumps(kw)


# -- the shared samples ------------------------------------------------------------------

def test_mooncake_sample_facts():
    src = open_trace(MOONCAKE)
    assert src.format == "mooncake"
    reqs = list(src)
    assert len(reqs) == 3993
    assert sum(r.input_length for r in reqs) / len(reqs) == pytest.approx(15325.5, abs=0.05)
    assert reqs[-1].arrival_ns == 1_022_025 * 1_000_000
    assert all(r.hash_block_size == 512 and len(r.hash_ids) == math.ceil(r.input_length / 512) for r in reqs)
    assert [r.request_id for r in reqs[:2]] == ["r0", "r1"]
    # streaming: a second pass re-reads and agrees; limit stops early
    assert [r.hash_ids for r in open_trace(MOONCAKE, limit=5)] == [r.hash_ids for r in reqs[:5]]
    assert len(src.source_id) == 64 and src.source_id == open_trace(MOONCAKE, "mooncake").source_id


def test_azure_sample_is_unique_per_request():
    reqs = read_trace(AZURE)
    assert len(reqs) == 19366
    assert reqs[0].arrival_ns == 0
    assert reqs[1].arrival_ns == parse_timestamp_ns("2023-11-16 18:15:50.9951690") - parse_timestamp_ns(
        "2023-11-16 18:15:46.6805900"
    ) == 4_314_579_000
    assert (reqs[0].input_length, reqs[0].output_length) == (374, 44)
    ids = [h for r in reqs[:500] for h in r.hash_ids]
    assert len(ids) == len(set(ids))  # no prefix sharing at all
    assert all(r.namespace == AZURE_NAMESPACE for r in reqs[:10])
    toks = reqs[3].prompt_token_ids()
    assert toks.shape == (91,) and toks.dtype == np.int64


def test_weka_directory_merges_files_by_arrival():
    src = open_trace(WEKA)
    assert src.format == "weka"
    reqs = list(src)
    assert len(reqs) == 6 + 27 + 22
    arrivals = [r.arrival_ns for r in reqs]
    assert arrivals == sorted(arrivals)
    assert {r.session_id for r in reqs} == {"trace_0211", "trace_0393", "trace_0616"}
    first = next(r for r in reqs if r.session_id == "trace_0211")
    # 109555 tokens in 64-token blocks: 1711 full ids + a synthetic tail id
    assert first.input_length == 109555 and len(first.hash_ids) == 1712
    assert first.hash_ids[-1] == TAIL_ID_BASE + 0
    assert first.namespace == namespace_for("trace_0211.json") != namespace_for("trace_0393.json")
    # consecutive turns of one conversation share their prefix
    conv = [r for r in reqs if r.session_id == "trace_0393"]
    assert conv[1].hash_ids[:1055] == conv[0].hash_ids[:1055]
    # the directory's id is stable and differs from one file's
    assert src.source_id == open_trace(WEKA).source_id != open_trace(WEKA / "trace_0211.json").source_id


def test_weka_namespace_is_stable_across_processes():
    # sha256-derived: a fixed value, not Python's salted hash()
    assert namespace_for("/a/b/trace_0211.json") == namespace_for("trace_0211.json") == 0x50EE9B1B9259712F
    assert 0 <= namespace_for("x.json") < 2**63


# -- small well-formed files of each format ----------------------------------------------

def test_bailian_sessions_follow_the_root(tmp_path):
    rows = [
        dict(chat_id=10, parent_chat_id=-1, timestamp=0.5, input_length=20, output_length=3, type="text", turn=1,
             hash_ids=[1, 2]),
        dict(chat_id=11, parent_chat_id=-1, timestamp=0.75, input_length=16, output_length=3, type="text", turn=1,
             hash_ids=[7]),
        dict(chat_id=12, parent_chat_id=10, timestamp=1.25, input_length=40, output_length=5, type="text", turn=2,
             hash_ids=[1, 2, 3]),
        dict(chat_id=13, parent_chat_id=12, timestamp=2.0, input_length=50, output_length=5, type="text", turn=3,
             hash_ids=[1, 2, 3, 4]),
        dict(chat_id=14, parent_chat_id=99, timestamp=2.0, input_length=1, output_length=0, type="text", turn=5,
             hash_ids=[5]),
    ]
    p = write(tmp_path, "b.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n")
    assert detect_format(str(p)) == "bailian"
    reqs = read_trace(p)
    assert [r.session_id for r in reqs] == ["10", "11", "10", "10", "99"]
    assert [r.arrival_ns for r in reqs] == [500_000_000, 750_000_000, 1_250_000_000, 2_000_000_000, 2_000_000_000]
    assert reqs[2].request_id == "chat-12" and reqs[2].hash_block_size == 16
    assert reqs[3].prompt_token_ids()[:40].tolist() == reqs[2].prompt_token_ids().tolist()


def test_native_reads_tokens_hashes_and_options(tmp_path):
    text = "\n".join([
        json.dumps({"kvtrace_trace": 1, "block_size": 4, "note": "x"}),
        line(arrival_ns=0, input_length=6, output_length=2, hash_ids=[3, 4]),
        "",
        line(request_id="q", arrival_ns=5, session="s", input_length=3, output_length=2, token_ids=[7, 8, 9],
             expected_output=[1, 2], cache_salt="salt"),
        line(arrival_ns=5, input_length=3, output_length=1, hash_ids=[9], block_size=8, namespace=3),
    ]) + "\n"
    p = write(tmp_path, "n.jsonl", text)
    assert detect_format(str(p)) == "native"
    assert native_header(p)["note"] == "x"
    a, b, c = read_trace(p)
    assert (a.request_id, a.hash_ids, a.hash_block_size, a.namespace) == ("r0", (3, 4), 4, 0)
    assert (b.request_id, b.session_id, b.cache_salt, b.expected_output) == ("q", "s", "salt", (1, 2))
    assert b.token_ids.tolist() == [7, 8, 9] and b.hash_ids is None
    assert (c.request_id, c.hash_block_size, c.namespace) == ("r2", 8, 3)


def test_detect_and_unknown_format(tmp_path):
    p = write(tmp_path, "m.jsonl", line(timestamp=0, input_length=3, output_length=1, hash_ids=[0]) + "\n")
    assert detect_format(str(p)) == "mooncake"
    assert read_trace(p, block_size=4)[0].hash_block_size == 4
    with pytest.raises(TraceFormatError, match="unknown trace format 'parquet'"):
        open_trace(p, format="parquet")
    junk = write(tmp_path, "j.txt", "hello\n")
    with pytest.raises(TraceFormatError, match=r"j\.txt:1: cannot detect the trace format"):
        open_trace(junk)
    with pytest.raises(TraceFormatError, match="no such file"):
        open_trace(tmp_path / "missing.jsonl")
    assert set(FORMATS) == {"mooncake", "bailian", "weka", "azure", "native"}


# -- malformed inputs: file and line in the message -------------------------------------

GOOD_MC = line(timestamp=0, input_length=600, output_length=1, hash_ids=[0, 1])

MOONCAKE_BAD = [
    ("{not json", "invalid JSON"),
    (line(timestamp=0, input_length=600, output_length=1), "missing required field `hash_ids`"),
    (line(timestamp=0, input_length="600", output_length=1, hash_ids=[0, 1]), "Expected `int`, got `str`"),
    (line(timestamp=0, input_length=600, output_length=-1, hash_ids=[0, 1]), "output_length: expected >= 0"),
    (line(timestamp=0, input_length=0, output_length=1, hash_ids=[]), "input_length: expected >= 1"),
    (line(timestamp=0, input_length=600, output_length=1, hash_ids=[0, 1, 2]), r"expected ceil\(input_length 600"),
    (line(timestamp=0, input_length=600, output_length=1, hash_ids=[0, -1]), r"ids must lie in \[0, 2\^63\)"),
    (line(timestamp=-5, input_length=600, output_length=1, hash_ids=[0, 1]), "goes back in time"),
    (line(timestamp=0, input_length=True, output_length=1, hash_ids=[0, 1]), "Expected `int`, got `bool`"),
]


@pytest.mark.parametrize("bad,what", MOONCAKE_BAD)
def test_mooncake_malformed_line_is_named(tmp_path, bad, what):
    p = write(tmp_path, "t.jsonl", GOOD_MC + "\n\n" + bad + "\n" + GOOD_MC + "\n")
    with pytest.raises(TraceFormatError, match=what) as e:
        read_trace(p, format="mooncake")
    assert e.value.line == 3 and str(e.value).startswith(f"{p}:3: ")


def test_readers_stream_requests_before_a_later_bad_line(tmp_path):
    p = write(tmp_path, "t.jsonl", GOOD_MC + "\n" + GOOD_MC + "\n{broken\n")
    it = iter(open_trace(p))
    assert next(it).request_id == "r0" and next(it).request_id == "r1"  # yielded before line 3 is read
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:3: invalid JSON"):
        next(it)


def test_arrival_going_back_is_refused(tmp_path):
    p = write(tmp_path, "t.jsonl", "\n".join([
        line(timestamp=10, input_length=5, output_length=1, hash_ids=[0]),
        line(timestamp=10, input_length=5, output_length=1, hash_ids=[0]),
        line(timestamp=9, input_length=5, output_length=1, hash_ids=[0]),
    ]))
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:3: timestamp goes back in time"):
        read_trace(p, format="mooncake")
    p = write(tmp_path, "neg.jsonl", line(timestamp=-1.5, input_length=5, output_length=1, hash_ids=[0]))
    with pytest.raises(TraceFormatError, match=r"neg\.jsonl:1: timestamp: expected >= 0, got a negative time"):
        read_trace(p, format="mooncake")


BAILIAN_OK = dict(chat_id=1, parent_chat_id=-1, timestamp=0.0, input_length=17, output_length=1, type="text", turn=1,
                  hash_ids=[0, 1])


@pytest.mark.parametrize("change,what", [
    (dict(chat_id=1), "chat_id: 1 appears twice"),
    (dict(parent_chat_id=-7), "parent_chat_id: expected -1"),
    (dict(hash_ids=[0]), "expected ceil"),
    (dict(timestamp="late"), "Expected `int | float`"),
])
def test_bailian_malformed(tmp_path, change, what):
    p = write(tmp_path, "b.jsonl", json.dumps(BAILIAN_OK) + "\n" + json.dumps({**BAILIAN_OK, "chat_id": 2, **change}))
    with pytest.raises(TraceFormatError, match=what) as e:
        read_trace(p, format="bailian")
    assert e.value.line == 2


NATIVE_HEAD = json.dumps({"kvtrace_trace": 1})


@pytest.mark.parametrize("bad,what", [
    (line(arrival_ns=0, input_length=3, output_length=1), "exactly one of token_ids / hash_ids"),
    (line(arrival_ns=0, input_length=3, output_length=1, token_ids=[1, 2], hash_ids=[1]), "exactly one of"),
    (line(arrival_ns=0, input_length=3, output_length=1, token_ids=[1, 2]), "token_ids: expected input_length 3"),
    (line(arrival_ns=0, input_length=2, output_length=1, token_ids=[1, -2]), r"token_ids: expected ids in \[0,"),
    (line(arrival_ns=0, input_length=3, output_length=1, hash_ids=[1]), "block_size: required with hash_ids"),
    (line(arrival_ns=0, input_length=3, output_length=2, token_ids=[1, 2, 3], expected_output=[1]),
     "expected_output: expected output_length 2"),
    (line(arrival_ns=0, input_length=3, output_length=1, token_ids=[1, 2, 3], colour="red"), "unknown field `colour`"),
    (line(request_id="r0", arrival_ns=0, input_length=1, output_length=1, token_ids=[1]), "'r0' appears twice"),
    (line(arrival_ns=0, input_length=1, output_length=1, hash_ids=[1], block_size=0), "block_size: expected >= 1"),
])
def test_native_malformed(tmp_path, bad, what):
    good = line(arrival_ns=0, input_length=1, output_length=1, token_ids=[5])
    p = write(tmp_path, "n.jsonl", "\n".join([NATIVE_HEAD, good, bad]) + "\n")
    with pytest.raises(TraceFormatError, match=what) as e:
        read_trace(p, format="native")
    assert e.value.line == 3 and str(e.value).startswith(f"{p}:3:")


def test_native_header_problems(tmp_path):
    body = line(arrival_ns=0, input_length=1, output_length=1, token_ids=[5])
    p = write(tmp_path, "a.jsonl", body + "\n")
    with pytest.raises(TraceFormatError, match=r"a\.jsonl:1: expected a header line"):
        read_trace(p, format="native")
    p = write(tmp_path, "b.jsonl", json.dumps({"kvtrace_trace": 2}) + "\n" + body)
    with pytest.raises(TraceFormatError, match="unsupported version 2"):
        read_trace(p)
    p = write(tmp_path, "c.jsonl", "")
    with pytest.raises(TraceFormatError, match="empty file"):
        read_trace(p, format="native")


AZURE_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


@pytest.mark.parametrize("bad,what", [
    ("2023-11-16 18:15:47.1,12,x", "GeneratedTokens: expected an integer, got 'x'"),
    ("2023-11-16 18:15:47.1,-3,4", "ContextTokens: expected >= 1"),
    ("yesterday,12,4", "TIMESTAMP: expected 'YYYY-MM-DD HH:MM:SS.fff'"),
    ("2023-11-16 18:15:45.0,12,4", "TIMESTAMP goes back in time"),
    ("2023-11-16 18:15:47.1,12", "expected 3 columns, got 2"),
    # every block of a length-only prompt is made here: 268M tokens took 5 GB and a minute
    ("2023-11-16 18:15:47.1,268435000,4", "ContextTokens: 268435000 is beyond what kvtrace can replay "
                                          r"\(at most 16,777,216\)"),
])
def test_azure_malformed(tmp_path, bad, what):
    p = write(tmp_path, "a.csv", AZURE_HEAD + "2023-11-16 18:15:46.6805900,374,44\n" + bad + "\n")
    with pytest.raises(TraceFormatError, match=what) as e:
        read_trace(p, format="azure")
    assert e.value.line == 3


def test_azure_missing_column(tmp_path):
    p = write(tmp_path, "a.csv", "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.6,374\n")
    with pytest.raises(TraceFormatError, match=r"a\.csv:1: missing column\(s\) \['GeneratedTokens'\]"):
        read_trace(p, format="azure")


def weka_doc(requests, **top) -> dict:
    return {"id": "c", "block_size": 4, "hash_id_scope": "local", **top, "requests": requests}


def weka_req(**kw) -> dict:
    return {"t": 0.0, "type": "n", "model": "m", "in": 9, "out": 2, "hash_ids": [1, 2], **kw}


@pytest.mark.parametrize("bad,what", [
    (weka_req(t=2.0, hash_ids=[1]), r"requests\[2\]\.hash_ids: expected floor or ceil"),
    (weka_req(t=2.0, out=-1), r"requests\[2\]\.out: expected >= 0"),
    (weka_req(t=0.5), r"requests\[2\]\.t goes back in time"),
    (weka_req(t=2.0, **{"in": "nine"}), r"Expected `int`, got `str` - at `\$\.requests\[2\]\.in`"),
])
def test_weka_malformed_points_at_the_request_line(tmp_path, bad, what):
    # pretty-printed: each request starts on its own line
    doc = weka_doc([weka_req(), weka_req(t=1.0, hash_ids=[1, 2, 3]), bad])
    text = json.dumps(doc, indent=1)
    p = write(tmp_path, "c.json", text)
    assert detect_format(str(p)) == "weka"  # pretty-printed: detected by its suffix
    expected_line = text.splitlines().index(" \"requests\": [") + 1  # the array's line
    with pytest.raises(TraceFormatError, match=what) as e:
        read_trace(p, format="weka")
    # request 2 starts after two requests of 10 lines each (indent=1 layout)
    assert e.value.line is not None and e.value.line > expected_line + 2 * 9
    assert text.splitlines()[e.value.line - 1].strip() == "{"


def test_weka_bad_json_and_scope(tmp_path):
    p = write(tmp_path, "c.json", '{\n "block_size": 4,\n "requests": [\n  {"t": 0,, }\n ]\n}\n')
    with pytest.raises(TraceFormatError, match="invalid JSON") as e:
        read_trace(p, format="weka")
    assert e.value.line == 4
    p = write(tmp_path, "d.json", json.dumps(weka_doc([weka_req()], hash_id_scope="galactic")))
    with pytest.raises(TraceFormatError, match="hash_id_scope: expected 'local' or 'global'"):
        read_trace(p)
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    with pytest.raises(TraceFormatError, match=r"no \*.json conversation files"):
        open_trace(empty)


def test_weka_local_ids_are_namespaced_per_file(tmp_path):
    d = tmp_path / "convs"
    d.mkdir()
    for name, t0 in (("b.json", 0.0), ("a.json", 0.0)):
        (d / name).write_text(json.dumps(weka_doc([weka_req(t=t0), weka_req(t=t0 + 1, **{"in": 8})], id=None)))
    reqs = read_trace(d)
    # ties on arrival: file-name order, then position
    assert [r.request_id for r in reqs] == ["a/0", "b/0", "a/1", "b/1"]
    assert reqs[0].hash_ids[:2] == reqs[1].hash_ids[:2] == (1, 2)
    assert reqs[0].namespace != reqs[1].namespace  # same local ids, different conversations
    assert reqs[0].prompt_token_ids()[:8].tolist() != reqs[1].prompt_token_ids()[:8].tolist()
    assert reqs[2].hash_ids == (1, 2)  # in 8 = exactly two full blocks: no tail id
    # global scope shares ids across files
    g = tmp_path / "g"
    g.mkdir()
    for name in ("x.json", "y.json"):
        (g / name).write_text(json.dumps(weka_doc([weka_req()], hash_id_scope="global")))
    gx, gy = read_trace(g)
    assert gx.namespace == gy.namespace == 0


def test_copy_of_file_has_same_source_id(tmp_path):
    p = write(tmp_path, "m.jsonl", GOOD_MC + "\n")
    q = tmp_path / "copy.jsonl"
    shutil.copy(p, q)
    assert open_trace(p).source_id == open_trace(q).source_id
    q.write_text(GOOD_MC + "\n" + GOOD_MC + "\n")
    assert open_trace(p).source_id != open_trace(q).source_id


@pytest.mark.parametrize("fmt", ["mooncake", "azure", None])
def test_a_line_too_long_is_named_not_read_into_memory(tmp_path, fmt):
    """A file of NUL bytes (a sparse file, a lost newline) was read as one line: 2 GB took
    14 s and 4.3 GB of memory before any error."""
    from kvtrace.workload.lines import MAX_LINE_BYTES

    path = tmp_path / ("t.csv" if fmt == "azure" else "t.jsonl")
    path.write_bytes(b"TIMESTAMP,ContextTokens,GeneratedTokens\n" if fmt == "azure" else b"")
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size + MAX_LINE_BYTES + 10)
    with pytest.raises(TraceFormatError, match=r":[12]: line longer than 64 MiB"):
        read_trace(path, fmt)


def test_a_fifo_among_weka_files_is_refused_before_any_read(tmp_path):
    import os

    shutil.copytree(TRACES / "weka_sample", tmp_path / "weka")
    os.mkfifo(tmp_path / "weka" / "zz.json")
    with pytest.raises(TraceFormatError, match=r"zz\.json: is a FIFO"):
        read_trace(tmp_path / "weka")


def test_a_malformed_start_is_told_before_the_whole_file_is_hashed(tmp_path, capsys, monkeypatch):
    """A 20 GB sparse file whose line 2 is zeros was hashed whole (minutes) before its line
    2 was read; the first requests are now read first."""
    from kvtrace.replay.readers import source
    from tests.cli.support import assert_one_line, run

    def never(*_):  # (the hash of every byte of the file)
        raise AssertionError("hashed before the start was read")

    monkeypatch.setattr(source, "source_sha256", never)
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n')
    with open(trace, "r+b") as f:
        f.truncate(1 << 30)  # sparse: no byte written
    code, _, err = run(["replay", str(trace), "--mode", "cache-only"], capsys)
    assert_one_line(code, err, f"{trace}:2: line longer than 64 MiB")


def test_tails_of_two_global_weka_files_never_meet(tmp_path):
    """Both files share namespace 0; their tails were TAIL_ID_BASE + index, equal for the
    first request of each, so the second request hit its whole prompt, tail included."""
    from kvtrace.replay.cache_only import replay_cache_only

    d = tmp_path / "g"
    d.mkdir()
    for name, t in (("a.json", 0.0), ("b.json", 1.0)):
        (d / name).write_text(json.dumps({"block_size": 64, "hash_id_scope": "global",
                                          "requests": [{"t": t, "in": 100, "out": 1, "hash_ids": [7]}]}))
    reqs = list(read_trace(str(d)))
    assert reqs[0].hash_ids[0] == reqs[1].hash_ids[0] == 7 and reqs[0].hash_ids[1] != reqs[1].hash_ids[1]
    assert replay_cache_only(reqs).summary()["prefix_cache_hits"] == 64  # the shared block, not the tail


def test_a_weka_file_larger_than_is_read_whole_is_refused_unread(tmp_path, monkeypatch):
    """A 10 GB file ended in a MemoryError (it was read whole first)."""
    from kvtrace.errors import TraceFormatError
    from kvtrace.replay.readers import weka

    monkeypatch.setattr(weka, "MAX_FILE_BYTES", 1 << 10)  # (the check, at a size a test can write)
    d = tmp_path / "w"
    d.mkdir()
    with open(d / "a.json", "wb") as f:
        f.truncate(10 << 20)  # sparse: nothing is read past the limit
    with pytest.raises(TraceFormatError, match="more than 1,024 bytes: larger than a WEKA conversation file"):
        list(read_trace(str(d)))


def test_a_store_given_as_the_trace_is_named_as_such(tmp_path, capsys):
    """`kvtrace replay runs.duckdb`: 'runs.duckdb:1: not UTF-8 text (byte 0xa6 at column 3)',
    with no word of what the file is or what to do."""
    from kvtrace.errors import TraceFormatError
    from kvtrace.replay.run import RunSpec, run_replay
    from tests.cli.support import assert_one_line, run

    db = tmp_path / "runs.duckdb"
    run_replay(RunSpec("gen:chat", limit=2, mode="cache-only"), db=db)
    wk = tmp_path / "w"
    wk.mkdir()
    (wk / "a.json").write_bytes(db.read_bytes())
    for path, fmt in ((db, None), (db, "mooncake"), (db, "native"), (wk, "weka"), (wk, None)):
        with pytest.raises(TraceFormatError, match=r"a DuckDB database \(a kvtrace store\?\), not a trace; a store is "
                                                   r"given as --db STORE"):
            list(read_trace(str(path), format=fmt))
    code, _, err = run(["replay", str(db)], capsys)
    assert_one_line(code, err, "runs.duckdb: a DuckDB database", "--db STORE")


def test_an_undetectable_trace_names_the_flag_that_says_its_format(tmp_path):
    from kvtrace.errors import TraceFormatError

    f = tmp_path / "t.jsonl"
    f.write_text('{"hello": 1}\n')
    with pytest.raises(TraceFormatError, match=r"cannot detect the trace format.*; give --format, one of mooncake"):
        open_trace(str(f))


@pytest.mark.parametrize("pack, kind", [("gzip", "gzip"), ("bz2", "bzip2"), ("lzma", "xz")])
def test_a_compressed_trace_is_named_as_such(tmp_path, pack, kind):
    """A gzip trace was 'not UTF-8 text (byte 0x8b at column 2)'; one in a WEKA directory was
    skipped without a word (2 of 3 files replayed)."""
    import importlib

    from kvtrace.errors import TraceFormatError

    line = b'{"timestamp":0,"input_length":40,"output_length":2,"hash_ids":[1]}\n'
    packed = importlib.import_module(pack).compress(line)
    f = tmp_path / "m.jsonl.x"
    f.write_bytes(packed)
    for fmt in (None, "mooncake"):
        with pytest.raises(TraceFormatError, match=f"{kind}-compressed; kvtrace reads traces as plain text"):
            open_trace(str(f), format=fmt)
    d = tmp_path / "w"
    d.mkdir()
    (d / "a.json").write_text('{"block_size": 64, "requests": [{"t": 0, "in": 10, "out": 1, "hash_ids": []}]}')
    (d / "b.json.gz").write_bytes(packed)
    with pytest.raises(TraceFormatError, match=r"b\.json\.gz: compressed \(1 such in"):
        open_trace(str(d))


def test_a_mooncake_trace_of_another_block_size_is_read_from_the_command_line(tmp_path, capsys):
    """--block-size is the cache's; a Mooncake trace hashed at 16 tokens could not be read
    at all (its 3 ids for 40 tokens were refused at the format's 512)."""
    from tests.cli.support import assert_one_line, run

    trace = tmp_path / "m16.jsonl"
    trace.write_text('{"timestamp":0,"input_length":40,"output_length":2,"hash_ids":[1,2,3]}\n'
                     '{"timestamp":5,"input_length":40,"output_length":2,"hash_ids":[1,2,4]}\n')
    code, out, err = run(["replay", str(trace), "--mode", "cache-only", "--trace-block-size", "16", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["prefix_cache_hits"] == 32  # two shared 16-token blocks
    converted = tmp_path / "n.jsonl"
    assert run(["convert", str(trace), "--trace-block-size", "16", "-o", str(converted)], capsys)[0] == 0
    assert [r.hash_block_size for r in read_trace(str(converted))] == [16, 16]
    code, _, err = run(["replay", "gen:chat", "--trace-block-size", "16"], capsys)
    assert_one_line(code, err, "--trace-block-size", "generated workload")
    code, _, err = run(["convert", str(converted), "--trace-block-size", "16", "-o", str(tmp_path / "x.jsonl")],
                       capsys)  # (a native trace says its own)
    assert_one_line(code, err, "block_size (--trace-block-size): the native format carries its own block size")


def test_the_formats_own_block_size_given_is_the_same_trace(tmp_path):
    """``--trace-block-size 512`` on a Mooncake file reads it as without the flag: its runs
    were another trace to ``diff`` (a different trace digest) all the same."""
    from kvtrace.replay.run import RunSpec, open_workload

    trace = tmp_path / "m.jsonl"
    trace.write_text('{"timestamp":0,"input_length":600,"output_length":2,"hash_ids":[1,2]}\n')
    ident = {size: open_workload(RunSpec(str(trace), trace_block_size=size)).source_id for size in (None, 512, 500)}
    assert ident[512] == ident[None] != ident[500]


def test_an_azure_row_is_named_where_it_begins_and_may_carry_a_long_column(tmp_path):
    """An unterminated quote on line 3 was reported at the line where its field passed csv's
    128 KiB limit (and before that, silently took the rest of the file into one field); an
    ignored column over 128 KiB failed the whole trace."""
    from kvtrace.errors import TraceFormatError

    head = "TIMESTAMP,ContextTokens,GeneratedTokens,Note\n"
    rows = [f"2023-11-16 18:15:46.{i:03d},{100 + i},5,x\n" for i in range(20)]
    long_note = tmp_path / "long.csv"
    long_note.write_text(head + rows[0] + rows[1].replace(",x", "," + "y" * 200_000) + "".join(rows[2:]))
    assert len(read_trace(str(long_note))) == 20
    cut = tmp_path / "cut.csv"
    cut.write_text(head + rows[0] + rows[1].replace(",x", ',"never closed') + "".join(rows[2:]))
    with pytest.raises(TraceFormatError, match=r"cut\.csv:3: a quoted field runs on to line 21 \(an unterminated"):
        read_trace(str(cut))


@pytest.mark.parametrize("key", ["block_size", "namespace"])
def test_a_hash_key_on_a_token_id_line_is_refused(tmp_path, key):
    """Unknown keys are errors, but these two on a token_ids line were silently ignored."""
    from kvtrace.errors import TraceFormatError

    f = tmp_path / "n.jsonl"
    f.write_text('{"kvtrace_trace":1}\n'
                 f'{{"arrival_ns":0,"input_length":3,"output_length":1,"token_ids":[1,2,3],"{key}":4}}\n')
    with pytest.raises(TraceFormatError, match=rf"n\.jsonl:2: {key}: only with hash_ids"):
        read_trace(str(f))
    f.write_text('{"kvtrace_trace":1}\n{"arrival_ns":0,"input_length":3,"output_length":1,"hash_ids":[1],'
                 '"block_size":4,"namespace":0}\n')
    assert read_trace(str(f))[0].namespace == 0


def test_converting_a_native_trace_keeps_its_headers_metadata(tmp_path, capsys):
    """generator, seed and the block sizes of a native header were dropped by convert."""
    from kvtrace.replay.readers import native_header
    from tests.cli.support import run

    first, second = tmp_path / "g.jsonl", tmp_path / "g2.jsonl"
    assert run(["generate", "chat", "-o", str(first), "--requests", "3"], capsys)[0] == 0
    assert run(["convert", str(first), "-o", str(second)], capsys)[0] == 0
    before, after = native_header(first), native_header(second)
    assert {k: after[k] for k in before} == before and before["generator"] == "chat"
    assert after["source"].startswith("native:sha256:")
    assert [r.request_id for r in read_trace(str(first))] == [r.request_id for r in read_trace(str(second))]


@pytest.mark.parametrize("fmt", ["mooncake", "bailian", "azure", "native"])
def test_an_empty_file_is_no_trace_whatever_format_is_named(tmp_path, fmt):
    """Named a format, an empty file replayed 0 requests with exit 0 (and Mooncake's block
    size reported as 16); undetected, it was already refused."""
    from kvtrace.errors import TraceFormatError

    p = tmp_path / "e.jsonl"
    p.write_bytes(b"")
    with pytest.raises(TraceFormatError, match=rf"e\.jsonl: empty file; expected a trace in the {fmt} format"):
        open_trace(str(p), format=fmt)


INTEGRAL_FLOATS = {  # one file each, every integer field written as a float that is an integer
    "mooncake": ("t.jsonl", '{"timestamp": 0, "input_length": 6E2, "output_length": 1.0, "hash_ids": [0.0, 1e0]}\n'),
    "bailian": ("t.jsonl", '{"chat_id": 1.0, "parent_chat_id": -1.0, "timestamp": 0, "input_length": 17.0, '
                           '"output_length": 1.0, "hash_ids": [0.0, 1.0], "type": "text", "turn": 1.0}\n'),
    "native": ("t.jsonl", '{"kvtrace_trace": 1, "block_size": 16.0}\n{"arrival_ns": 5.0, "input_length": 17.0, '
                          '"output_length": 1.0, "hash_ids": [0.0, 1.0], "block_size": 16.0, "namespace": 3.0, '
                          '"expected_output": [7.0]}\n'),
    "weka": ("t.json", '{"block_size": 16.0, "requests": [{"t": 0, "in": 17.0, "out": 1e0, "hash_ids": [0.0, 1.0]}]}'),
    "azure": ("t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,17.0,1e0\n"),
}


@pytest.mark.parametrize("fmt", sorted(INTEGRAL_FLOATS))
def test_an_integer_written_as_a_float_is_read_as_that_integer(tmp_path, fmt):
    """17.0 and 1e0 (pandas writes an int column as floats once it held a NaN) were refused
    as "Expected `int`, got `float`"; a float that is no integer, or one past 2^53 (a
    rounded id), still is, at its line."""
    name, text = INTEGRAL_FLOATS[fmt]
    (req,) = read_trace(write(tmp_path, name, text), fmt)
    assert (req.output_length, type(req.input_length)) == (1, int)
    assert req.input_length == (600 if fmt == "mooncake" else 17)
    assert all(type(h) is int for h in req.hash_ids) and (fmt == "azure" or req.hash_ids[:2] == (0, 1))
    for bad in ("17.5", "1.75e1"):
        p = write(tmp_path, "bad" + name, text.replace("17.0", bad).replace("6E2", bad))
        with pytest.raises(TraceFormatError) as e:
            read_trace(p, fmt)
        assert e.value.line in ((2,) if fmt in ("native", "azure") else (1,)), e.value
    if fmt != "azure":  # (a CSV's ids are made, not read)
        p = write(tmp_path, "big" + name, text.replace("[0.0,", "[1.2345678901234567e18,"))
        with pytest.raises(TraceFormatError, match=r"Expected `int`, got `float` - at `\$\.(requests\[0\]\.)?hash_ids"):
            read_trace(p, fmt)


@pytest.mark.parametrize("fmt, text, where", [
    ("mooncake", '{"timestamp": 0, "input_length": 1.0, "output_length": 1e400, "hash_ids": [0]}', "$.output_length"),
    ("weka", '{"block_size": 16,\n "requests": [\n  {"t": 0, "in": 1E2, "out": 1e400, "hash_ids": []}]}',
     "$.requests[0].out"),
    ("native", '{"kvtrace_trace": 1}\n{"arrival_ns": 0, "input_length": 1.0, "output_length": 1, "hash_ids": [0], '
               '"block_size": 1, "colour": 1}', "unknown field `colour`"),
])
def test_a_fault_beside_an_integer_written_as_a_float_is_named_at_its_key(tmp_path, fmt, text, where):
    """Past the float, a line was decoded generically: a number out of range anywhere was
    named "at `$[...][0][...]`" (and a WEKA request at line 1)."""
    p = write(tmp_path, "t.json" if fmt == "weka" else "t.jsonl", text + "\n")
    with pytest.raises(TraceFormatError) as e:
        read_trace(p, fmt)
    assert where in str(e.value) and e.value.line == (1 if fmt == "mooncake" else 2 if fmt == "native" else 3), e.value


def test_blank_lines_before_an_azure_header_are_skipped_as_between_rows(tmp_path):
    """A blank first line was read as the header: "missing column(s)" of all three, at line 1."""
    rows = "2023-11-16 18:15:46.6805900,374,44\r\n\r\n2023-11-16 18:15:47.1,x,4\r\n"
    p = write(tmp_path, "a.csv", "\r\n \r\n" + AZURE_HEAD.replace("\n", "\r\n") + rows)
    with pytest.raises(TraceFormatError, match=r"a\.csv:6: ContextTokens: expected an integer, got 'x'"):
        read_trace(p, "azure")
    assert len(read_trace(write(tmp_path, "b.csv", "\n\n" + AZURE_HEAD + rows.split("\r\n")[0]), "azure")) == 1
    with pytest.raises(TraceFormatError, match=r"c\.csv:3: missing column\(s\) \['GeneratedTokens'\]"):
        read_trace(write(tmp_path, "c.csv", "\n\nTIMESTAMP,ContextTokens\n"), "azure")


def test_the_format_is_detected_from_the_first_lines_keys_whatever_its_values(tmp_path):
    """A first line holding a number past a double (1e400) could not be decoded whole, so
    its format was not detected ("cannot detect the trace format", naming nothing wrong);
    one that is no JSON at all now says why."""
    p = write(tmp_path, "m.jsonl", '{"timestamp": 0, "input_length": 1, "output_length": 1e400, "hash_ids": [0]}\n')
    assert detect_format(str(p)) == "mooncake"
    with pytest.raises(TraceFormatError, match=r"m\.jsonl:1: Number out of range - at `\$\.output_length`"):
        read_trace(p)
    p = write(tmp_path, "n.jsonl", '{"timestamp": NaN, "input_length": 1, "output_length": 1, "hash_ids": [0]}\n')
    with pytest.raises(TraceFormatError, match=r"n\.jsonl:1: cannot detect the trace format \(invalid JSON: "):
        read_trace(p)


@pytest.mark.parametrize("fmt, text", [
    ("mooncake", '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0], "note": "\\ud800"}'),
    ("native", '{"kvtrace_trace": 1}\n{"arrival_ns": 0, "input_length": 1, "output_length": 1, "token_ids": [1], '
               '"session": "\\ud83d"}'),
])
def test_half_a_surrogate_pair_at_a_lines_end_is_named_as_such(tmp_path, fmt, text):
    """msgspec said "Input data was truncated" of a whole line whose last string was one
    lone surrogate escape (it looked six bytes past it for the pair)."""
    p = write(tmp_path, "t.jsonl", text + "\n")
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:\d: invalid JSON: \\ud8[03][0d] is half a UTF-16 surrogate"):
        read_trace(p, fmt)


@pytest.mark.parametrize("pack, kind", [("gzip", "gzip"), ("bz2", "bzip2")])
def test_a_compressed_conversation_named_json_in_a_weka_directory_is_named_as_such(tmp_path, pack, kind):
    """Alone it was named gzip-compressed; in a directory, under a .json name, it was 'not
    UTF-8 text' (a bzip2 one, whose magic is ASCII, 'invalid JSON')."""
    import importlib

    d = tmp_path / "w"
    d.mkdir()
    (d / "a.json").write_text('{"block_size": 64, "requests": [{"t": 0, "in": 10, "out": 1, "hash_ids": []}]}')
    (d / "b.json").write_bytes(importlib.import_module(pack).compress(b'{"block_size": 64, "requests": []}'))
    with pytest.raises(TraceFormatError, match=rf"b\.json: {kind}-compressed; kvtrace reads traces as plain text"):
        read_trace(d)


@pytest.mark.parametrize(("fmt", "line"), [
    ("mooncake", {"timestamp": 0, "input_length": 100, "output_length": 1, "hash_ids": [1, 2]}),
    ("bailian", {"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.0, "input_length": 100, "output_length": 1,
                 "type": "text", "turn": 1, "hash_ids": [1, 2]}),
])
def test_ids_of_another_block_size_name_the_flag_that_gives_it(tmp_path, fmt, line):
    # 64-token ids read at the format's default said only the count: the fix was unsaid
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:1: hash_ids: expected .* give it with --trace-block-size"):
        read_trace(path, format=fmt)
    assert len(read_trace(path, format=fmt, block_size=64)) == 1
