"""Fuzz: every trace reader (mooncake, bailian, weka, azure, native) on hostile files.

The invariant: a file is either read whole or refused with one one-line KVTraceError
naming the file (and, where the fault is on one line of a line-oriented file, that line
and the key at fault); never another exception. What is accepted also survives the
native writer and reads back the same.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtrace.errors import KVTraceError
from kvtrace.replay.readers import FORMATS, read_trace
from kvtrace.workload.native import native_record, write_native
from tests.fuzz.support import Raw, dump, fuzz, one_line_error

EDGE_INTS = st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64,
                             2**70, -(2**63), -(2**63) - 1, 10**19, 10**12, 10**15])
NUMBERS = st.one_of(
    EDGE_INTS, st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e300, -1e300, 1.7e308, 1e19, 1e12, 1e15, 0.5, -0.0, 5e-324]),
    st.sampled_from([Raw("1e400"), Raw("-1e400"), Raw("1" + "0" * 400), Raw("-0"), Raw("1E2")]),
)
SCALARS = st.one_of(NUMBERS, st.text(max_size=8), st.booleans(), st.none())
HOSTILE = st.one_of(
    SCALARS,
    st.lists(SCALARS, max_size=4),
    st.dictionaries(st.text(max_size=4), SCALARS, max_size=3),
    st.lists(EDGE_INTS, min_size=1, max_size=3),
)
MISSING = object()  # a key deleted from the record


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# -- valid records, one format each ----------------------------------------------------------
@st.composite
def valid_lines(draw, fmt: str) -> list[dict]:
    n = draw(st.integers(0, 4))
    out, t = [], 0
    for i in range(n):
        t += draw(st.integers(0, 10))
        length = draw(st.integers(1, 1100))
        if fmt == "mooncake":
            out.append({"timestamp": t, "input_length": length, "output_length": draw(st.integers(0, 50)),
                        "hash_ids": list(range(i * 10, i * 10 + cdiv(length, 512)))})
        elif fmt == "bailian":
            out.append({"chat_id": i, "parent_chat_id": draw(st.sampled_from([-1, i - 1])) if i else -1,
                        "timestamp": t / 10, "input_length": length, "output_length": draw(st.integers(0, 50)),
                        "hash_ids": list(range(cdiv(length, 16))), "type": "text", "turn": 1})
        elif fmt == "native":
            if draw(st.booleans()):
                ids = {"token_ids": draw(st.lists(st.integers(0, 1000), min_size=length % 20 + 1,
                                                  max_size=length % 20 + 1))}
                length = len(ids["token_ids"])
            else:
                ids = {"hash_ids": list(range(cdiv(length, 16))), "block_size": 16}
            out.append({"request_id": f"q{i}", "arrival_ns": t * 1000, "input_length": length,
                        "output_length": draw(st.integers(0, 50)), **ids})
        elif fmt == "weka":
            out.append({"t": t / 10, "in": length, "out": draw(st.integers(0, 50)),
                        "hash_ids": list(range(length // 16)), "type": "n", "model": "m"})
        else:  # azure: the cells of a CSV row
            out.append({"TIMESTAMP": f"2023-11-16 18:15:{t % 60:02d}.{i:07d}", "ContextTokens": str(length),
                        "GeneratedTokens": str(draw(st.integers(0, 50)))})
    return out


HEADER = {"kvtrace_trace": 1, "block_size": 16}
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
LINE_FORMATS = ("mooncake", "bailian", "native")  # one JSON object per line


def csv_cell(v) -> str:
    text = v if isinstance(v, str) else dump(v)
    if any(c in text for c in ',"\r\n'):
        return '"' + text.replace('"', '""') + '"'
    return text


def render(fmt: str, records: list[dict]) -> bytes:
    """The file for ``records`` (a WEKA file is pretty-printed, one request per few lines)."""
    if fmt == "weka":
        body = ",\n".join("  " + dump(r) for r in records)
        return ('{\n "block_size": 16,\n "hash_id_scope": "local",\n "requests": [\n' + body + "\n ]\n}\n").encode()
    if fmt == "azure":
        rows = [",".join(AZURE_COLUMNS)] + [",".join(csv_cell(r.get(c, "")) for c in AZURE_COLUMNS) for r in records]
        return ("\n".join(rows) + "\n").encode()
    lines = ([dump(HEADER)] if fmt == "native" else []) + [dump(r) for r in records]
    return ("\n".join(lines) + "\n").encode()


def header_lines(fmt: str) -> int:
    return 1 if fmt in ("native", "azure") else 0


def check_read(path: str, fmt: str | None, *names: str) -> list | None:
    """read_trace's requests, or None after checking its refusal against the invariant;
    what is read is written natively and must read back the same."""
    try:
        reqs = read_trace(path, fmt)
    except Exception as err:  # the invariant is about every exception
        one_line_error(err, path, *names)
        return None
    out = path + ".native.jsonl"
    write_native(reqs, out)
    assert [native_record(r) for r in read_trace(out, "native")] == [native_record(r) for r in reqs]
    return reqs


def written(data: bytes, name: str, tmp: str) -> str:
    path = os.path.join(tmp, name)
    with open(path, "wb") as f:
        f.write(data)
    return path


SUFFIX = {"azure": ".csv", "weka": ".json"}


# -- arbitrary bytes -----------------------------------------------------------------------------
@fuzz(60)
@given(fmt=st.sampled_from((*FORMATS, None)), data=st.binary(max_size=300))
def test_arbitrary_bytes(fmt, data):
    with tempfile.TemporaryDirectory() as tmp:
        check_read(written(data, "t" + SUFFIX.get(fmt, ".jsonl"), tmp), fmt)


@fuzz(60)
@given(fmt=st.sampled_from(FORMATS), data=st.data())
def test_valid_file_with_random_bytes_spliced_in(fmt, data):
    """A readable file with a few bytes overwritten, inserted or cut off: near-valid input."""
    raw = bytearray(render(fmt, data.draw(valid_lines(fmt))))
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(raw)))
        op = data.draw(st.sampled_from(["set", "insert", "cut"]))
        chunk = data.draw(st.binary(min_size=1, max_size=4))
        if op == "set":
            raw[at:at + len(chunk)] = chunk
        elif op == "insert":
            raw[at:at] = chunk
        else:
            del raw[at:]
    with tempfile.TemporaryDirectory() as tmp:
        check_read(written(bytes(raw), "t" + SUFFIX.get(fmt, ".jsonl"), tmp), data.draw(st.sampled_from([fmt, None])))


# -- structured but hostile values -------------------------------------------------------------
@st.composite
def one_hostile_field(draw, fmt: str) -> tuple[list[dict], int, str]:
    """Valid records, then one whose key ``key`` is hostile (replaced, deleted or added)."""
    records = draw(valid_lines(fmt))
    base = draw(valid_lines(fmt).filter(bool))[0]
    if fmt == "bailian":
        base["chat_id"], base["parent_chat_id"] = 1000, -1
    if fmt == "native":
        base["request_id"] = "hostile"
    if records:  # after the earlier records in time
        later = {"mooncake": ("timestamp", 100), "bailian": ("timestamp", 100.0), "native": ("arrival_ns", 10**9),
                 "weka": ("t", 100.0), "azure": ("TIMESTAMP", "2023-11-16 18:16:00.0")}[fmt]
        base[later[0]] = later[1]
    key = draw(st.sampled_from([*base, "unknown_key"]))
    value = draw(st.one_of(HOSTILE, st.just(MISSING)))
    if value is MISSING:
        base.pop(key, None)
    elif fmt == "azure":
        base[key] = value if isinstance(value, str) else dump(value)
    else:
        base[key] = value
    return [*records, base], len(records), key


@fuzz(150)
@given(data=st.data())
def test_one_hostile_field_is_named_at_its_line(data):
    fmt = data.draw(st.sampled_from(FORMATS))
    records, index, key = data.draw(one_hostile_field(fmt))
    with tempfile.TemporaryDirectory() as tmp:
        path = written(render(fmt, records), "t" + SUFFIX.get(fmt, ".jsonl"), tmp)
        try:
            read_trace(path, fmt)
        except Exception as err:
            names = [path]
            if fmt in LINE_FORMATS:
                names.append(f"{path}:{index + 1 + header_lines(fmt)}:")
            text = one_line_error(err, *names)
            if fmt == "weka":  # the request by index, or its line (render: request i on line 5 + i)
                assert f"requests[{index}]" in text or f"{path}:{5 + index}:" in text, text
            if "invalid JSON" in text:  # a token that is not JSON (NaN): the line is named, no key parsed
                return
            if fmt != "azure" and key != "unknown_key":  # an azure row's cells have no key of their own
                related = {"hash_ids", "input_length", "in", "token_ids", "block_size"}  # checked together
                assert key in text or (key in related and related & set(text.replace("`", " ").split())), text


@fuzz(80)
@given(data=st.data())
def test_many_hostile_fields(data):
    """Several records, any key of any of them hostile: refused or read, never a crash."""
    fmt = data.draw(st.sampled_from(FORMATS))
    records = data.draw(valid_lines(fmt))
    for r in records:
        for key in list(r):
            if data.draw(st.integers(0, 3)) == 0:
                v = data.draw(HOSTILE)
                r[key] = v if fmt != "azure" or isinstance(v, str) else dump(v)
    if fmt == "native" and data.draw(st.booleans()):  # the header too
        hostile_header = dict(HEADER, block_size=data.draw(HOSTILE))
        raw = render(fmt, records).split(b"\n", 1)[1]
        raw = (dump(hostile_header) + "\n").encode() + raw
    else:
        raw = render(fmt, records)
    with tempfile.TemporaryDirectory() as tmp:
        check_read(written(raw, "t" + SUFFIX.get(fmt, ".jsonl"), tmp), fmt)


@fuzz(60)
@given(data=st.data())
def test_what_is_read_replays_in_cache_only_mode(data):
    """Accepted traces, ids anywhere in [0, 2^63) and repeated under other parents, replay
    through the cache-only LRU and Belady (and their digest) at a tiny capacity."""
    from kvtrace.replay.run import RunSpec, run_replay

    fmt = data.draw(st.sampled_from(["mooncake", "bailian", "native", "weka"]))
    records = data.draw(valid_lines(fmt).filter(bool))
    ids = st.one_of(st.integers(0, 3), st.sampled_from([2**63 - 1, 2**62, 2**32]))
    for r in records:
        if "hash_ids" in r:
            r["hash_ids"] = [data.draw(ids) for _ in r["hash_ids"]]
    with tempfile.TemporaryDirectory() as tmp:
        path = written(render(fmt, records), "t" + SUFFIX.get(fmt, ".jsonl"), tmp)
        if check_read(path, fmt) is None:
            return
        for policy in ("lru", "belady"):
            spec = RunSpec(path, mode="cache-only", policy=policy, trace_format=fmt,
                           capacity_blocks=data.draw(st.sampled_from([2, 3, math.inf])))
            try:
                run_replay(spec)
            except Exception as err:  # the invariant is about every exception
                one_line_error(err, "request")  # e.g. a request larger than the whole cache


@fuzz(60)
@given(data=st.data())
def test_non_utf8_byte_is_named_at_its_line(data):
    fmt = data.draw(st.sampled_from(FORMATS))
    raw = render(fmt, data.draw(valid_lines(fmt)))
    lines = raw.split(b"\n")[:-1]
    k = data.draw(st.integers(0, len(lines) - 1)) if lines else 0
    bad = data.draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80", b"\xf8\x88\x80\x80\x80"]))
    if lines:
        at = data.draw(st.integers(0, len(lines[k])))
        lines[k] = lines[k][:at] + bad + lines[k][at:]
    else:
        lines = [bad]
    with tempfile.TemporaryDirectory() as tmp:
        path = written(b"\n".join(lines) + b"\n", "t" + SUFFIX.get(fmt, ".jsonl"), tmp)
        with pytest.raises(KVTraceError) as info:
            read_trace(path, fmt)
        one_line_error(info.value, f"{path}:{k + 1}:")


# -- files that are not files ------------------------------------------------------------------
@pytest.mark.parametrize("fmt", (*FORMATS, None))
@pytest.mark.parametrize("what", ["empty", "blank", "directory", "empty directory", "missing"])
def test_not_a_trace_file(tmp_path: Path, fmt, what):
    path = tmp_path / "t.json"
    if what == "empty":
        path.write_bytes(b"")
    elif what == "blank":
        path.write_bytes(b"\n  \n\t\n")
    elif what == "directory":
        path.mkdir()
        (path / "a.txt").write_text("x")
        (path / "b.json").mkdir()  # a directory named like a conversation file
    elif what == "empty directory":
        path.mkdir()
    try:
        reqs = read_trace(path, fmt)
    except Exception as err:
        one_line_error(err, str(path))
    else:  # a blank file given a format replayed 0 requests, exit 0: it is as empty as an empty one
        raise AssertionError(f"{what} {path} read as {reqs!r}")


# -- regressions the fuzzer found ------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("blank", [b"\xef\xbb\xbf", b"\xef\xbb\xbf\r\n \r\n", b"\n" * 3 + b"\t \n"])
def test_a_file_of_blanks_given_its_format_is_an_empty_file(tmp_path: Path, fmt, blank):
    """A byte-order mark or blank lines alone, given --format mooncake: 0 requests replayed and
    exit 0 (only a file of 0 bytes was refused), where detection said "empty file"."""
    path = tmp_path / ("t.csv" if fmt == "azure" else "t.json")
    path.write_bytes(blank)
    with pytest.raises(KVTraceError) as info:
        read_trace(path, fmt)
    one_line_error(info.value, f"{path}: empty file")


@pytest.mark.parametrize("line,told", [
    ('{"timestamp": 0, "input_length": 1, "output_length": 0, "hash_ids": [0], "x": "\\ud800"}',
     "invalid JSON: \\ud800 is half a UTF-16 surrogate pair"),
    ('{"timestamp": 0, "x": ' + "[" * 5000 + "]" * 5000 + "}", "invalid JSON: nested too deeply"),
])
def test_detection_tells_a_lines_json_fault_as_the_reader_does(tmp_path: Path, line, told):
    """Detection quoted msgspec's own words: "Input data was truncated" of a whole line ending
    in a lone surrogate, "maximum recursion depth exceeded" of deep nesting."""
    path = tmp_path / "t.jsonl"
    path.write_text(line + "\n")
    for fmt in (None, "mooncake"):
        with pytest.raises(KVTraceError) as info:
            read_trace(path, fmt)
        text = one_line_error(info.value, f"{path}:1:", told)
        assert "truncated" not in text and "recursion" not in text


@pytest.mark.parametrize("blank", [b"", b"\xef\xbb\xbf \r\n"])
def test_an_empty_conversation_in_a_weka_directory_is_an_empty_file(tmp_path: Path, blank):
    """msgspec said "Input data was truncated" of a file holding nothing."""
    (tmp_path / "a.json").write_text(json.dumps({"block_size": 16,
                                                 "requests": [{"t": 0, "in": 5, "out": 1, "hash_ids": [1]}]}))
    (tmp_path / "b.json").write_bytes(blank)
    with pytest.raises(KVTraceError) as info:
        read_trace(tmp_path)
    text = one_line_error(info.value, f"{tmp_path / 'b.json'}: empty file; expected a WEKA conversation")
    assert "truncated" not in text


def test_a_weka_block_size_beyond_any_replay_is_named_in_the_file(tmp_path: Path):
    """2^62 tokens a block was read, then refused by cache-only mode as "cache-only: block_size",
    naming no file."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"block_size": 2**62, "requests": [{"t": 0, "in": 5, "out": 1, "hash_ids": [7]}]}))
    with pytest.raises(KVTraceError) as info:
        read_trace(path, "weka")
    one_line_error(info.value, f"{path}:1: block_size: {2**62} is beyond what kvtrace can replay")


@pytest.mark.parametrize("fmt,line", [
    ("bailian", '{"chat_id": 1, "parent_chat_id": -1, "timestamp": 1e300, "input_length": 1, "output_length": 0, '
                '"hash_ids": [0]}'),
    ("mooncake", '{"timestamp": 1.7e308, "input_length": 1, "output_length": 0, "hash_ids": [0]}'),
    ("weka", '{"block_size": 16, "requests": [{"t": 1.7e300, "in": 1, "out": 0, "hash_ids": []}]}'),
])
def test_float_time_beyond_a_double_once_in_ns_is_refused_naming_the_key(tmp_path: Path, fmt, line):
    """A finite time whose ns are beyond any double (1e300 s) was an OverflowError in round()."""
    path = tmp_path / ("t.json" if fmt == "weka" else "t.jsonl")
    path.write_text(line + "\n")
    with pytest.raises(KVTraceError) as info:
        read_trace(path, fmt)
    one_line_error(info.value, str(path), "is not a time kvtrace can replay")


def test_weka_invalid_json_names_the_line_of_the_bad_token(tmp_path: Path):
    """json.loads accepts NaN, so a NaN in a WEKA file was reported with no line at all."""
    path = tmp_path / "conv.json"
    path.write_text('{\n "block_size": 16,\n "requests": [\n  {"t": 0, "in": 1},\n  {"t": NaN, "in": 1}\n ]\n}\n')
    with pytest.raises(KVTraceError) as info:
        read_trace(path, "weka")
    one_line_error(info.value, f"{path}:5: invalid JSON")
    path.write_text('{\n "block_size": 16,\n "requests": [\n  {"t": 0, "in": 1},\n')  # cut short
    with pytest.raises(KVTraceError) as info:
        read_trace(path, "weka")
    one_line_error(info.value, f"{path}:4: invalid JSON")


# -- grammar-aware: valid files, one field hostile or one layout changed -----------------------------
# A hostile value for each kind of field: the type the format expects, at and past its bounds,
# or another JSON type in its place (nested where a scalar goes, and the other way round).
HOSTILE_INT = st.one_of(
    EDGE_INTS, st.sampled_from([2**31 - 1, 2**31 + 1, 1 << 24, (1 << 24) + 1, 2**53, 2**53 + 1]),
    st.sampled_from([Raw("1e400"), Raw("-1e400"), Raw("1" + "0" * 400), Raw("NaN"), Raw("Infinity"), Raw("-0"),
                     Raw("1E2"), Raw("1.0"), Raw("-1.0"), Raw("0.5"), Raw("1e-400"), Raw("9007199254740993.0"),
                     Raw("1.2345678901234567e18"), Raw("0e0"), Raw("-0.0")]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(["1", "", "0x10", " 1", "١"]),
    st.sampled_from([True, False, None, [], [1], {}, {"a": 1}, [[1]]]),
)
HOSTILE_IDS = st.one_of(
    st.lists(st.one_of(EDGE_INTS, st.sampled_from([2**63 - 1, 2**63, -1, Raw("1e19"), Raw("1.0"), Raw("NaN"),
                                                  None, "1", [1], True])), max_size=5),
    st.sampled_from([[], None, 5, "0,1", {"0": 1}, [[0, 1]], Raw("[" + ",".join(["0"] * 3000) + "]")]),
)
HOSTILE_TEXT = st.one_of(
    st.text(max_size=6), st.sampled_from(["", " ", "\u0000", "\n", "\r\n", "\u2028", "\ufeff", "é" * 3, "🙂",
                                          Raw('"\\ud800"'), Raw('"\\udfff\\ud800"'), Raw('"\\u0000"')]),
    st.sampled_from([0, -1, 1.5, True, None, [], {}, ["a"], {"a": "b"}]),
)
AZURE_CELL = st.one_of(
    st.sampled_from(["", " ", "-1", "0", "1.5", "1e400", "nan", "inf", "0x10", "1_000", "١٢", "+5", "-0", "1e5",
                     "16777217", "2147483648", "99999999999999999999999999999999999999999", '"', "a,b", "\u2028",
                     "2023-11-16", "12:00:00"]),
    st.integers().map(str), st.text(max_size=6),
)
AZURE_TIME = st.one_of(
    st.sampled_from(["2023-11-16 18:15:46", "2023-11-16 18:15:46.6805900", "2024-05-10 00:00:00.009930+00:00",
                     "2023-02-29 00:00:00", "2023-11-16 24:00:00", "2023-11-16 18:60:00", "2023-11-16 18:15:61",
                     "0000-01-01 00:00:00", "9999-12-31 23:59:59.999999999", "2023-11-16 18:15:46.1234567890",
                     "2023-11-16 18:15:46-07:00", "2023-11-16", "1700000000", "", " ", "２０２３-11-16 18:15:46"]),
    st.text(max_size=12),
)
FIELD_KIND = {"hash_ids": HOSTILE_IDS, "token_ids": HOSTILE_IDS, "expected_output": HOSTILE_IDS,
              "type": HOSTILE_TEXT, "model": HOSTILE_TEXT, "request_id": HOSTILE_TEXT, "session": HOSTILE_TEXT,
              "cache_salt": HOSTILE_TEXT, "TIMESTAMP": AZURE_TIME, "ContextTokens": AZURE_CELL,
              "GeneratedTokens": AZURE_CELL}


@st.composite
def layout(draw, lines: list[str], header: int) -> tuple[bytes, list[int]]:
    """``lines`` (after ``header`` lines that are not records) written with blank lines
    between them, CRLF or LF, a UTF-8 BOM or none, a last newline or none; and the 1-based
    line each record is on."""
    eol = draw(st.sampled_from(["\n", "\r\n"]))
    out: list[str] = []
    where = []
    for i, text in enumerate(lines):
        if i >= header or draw(st.booleans()):  # (blank lines before a native header too)
            out.extend(draw(st.sampled_from(["", " ", "\t", "  \t "])) for _ in range(draw(st.integers(0, 2))))
        if i >= header:
            where.append(len(out) + 1)
        out.append(text)
    raw = eol.join(out) + (eol if draw(st.booleans()) else "")
    return (b"\xef\xbb\xbf" if draw(st.booleans()) else b"") + raw.encode("utf-8", "surrogatepass"), where


def record_lines(fmt: str, records: list[dict]) -> tuple[list[str], int]:
    """The lines of a line-oriented format's file, and how many come before the records."""
    if fmt == "azure":
        return [",".join(AZURE_COLUMNS)] + [",".join(csv_cell(r.get(c, "")) for c in AZURE_COLUMNS)
                                            for r in records], 1
    return ([dump(HEADER)] if fmt == "native" else []) + [dump(r) for r in records], header_lines(fmt)


@fuzz(150)
@given(data=st.data())
def test_typed_hostile_value_in_a_valid_file_is_named_at_its_line(data):
    """Valid records, then one whose one field holds a hostile value of a kind chosen for
    that field, in a file laid out with blank lines, CRLF, a BOM: refused naming that
    record's line (WEKA: its request), or read whole and the same once written natively."""
    fmt = data.draw(st.sampled_from(FORMATS))
    records, index, _ = data.draw(one_hostile_field(fmt))  # (its own hostile field, then one typed)
    record = records[-1]
    key = data.draw(st.sampled_from(sorted(record)))
    record[key] = data.draw(FIELD_KIND.get(key, HOSTILE_INT))
    if fmt == "azure" and not isinstance(record[key], str):
        record[key] = str(record[key])
    with tempfile.TemporaryDirectory() as tmp:
        if fmt == "weka":
            raw, where = render(fmt, records), [5 + i for i in range(len(records))]
            if data.draw(st.booleans()):
                raw = raw.replace(b"\n", b"\r\n")
            if data.draw(st.booleans()):
                raw = b"\xef\xbb\xbf" + raw
        else:
            raw, where = data.draw(layout(*record_lines(fmt, records)))
        path = written(raw, "t" + SUFFIX.get(fmt, ".jsonl"), tmp)
        try:  # (detected too: from the first line's keys, which no value here takes away)
            reqs = read_trace(path, data.draw(st.sampled_from([fmt, None])))
        except Exception as err:
            text = one_line_error(err, path)
            at = f"{path}:{where[index]}:"
            assert at in text or (fmt == "weka" and f"requests[{index}]" in text) or \
                (fmt == "weka" and "invalid JSON" in text and f"{path}:" in text), f"{at} not in {text!r}"
            return
        assert len(reqs) == len(records)
        check_read(path, fmt)


def json_variant(v, draw) -> str:
    """JSON of ``v`` written another way that means the same: an int as an integer-valued
    float or in exponent form, spaces around tokens, keys in another order or \\u-escaped,
    strings with escaped characters."""
    space = draw(st.sampled_from(["", " ", "\t", "  "]))
    if isinstance(v, (Raw, bool)) or v is None:
        return dump(v)
    if isinstance(v, int):
        if abs(v) > 2**53 or draw(st.integers(0, 2)) != 0:
            return str(v)
        return draw(st.sampled_from([f"{v}.0", f"{v}e0", f"{v}E+0", f"{v * 10}e-1", f"{v}.000"]))
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=draw(st.booleans()))
    if isinstance(v, list):
        return "[" + space + ("," + space).join(json_variant(x, draw) for x in v) + space + "]"
    if isinstance(v, dict):
        items = draw(st.permutations(list(v.items())))
        def key(k: str) -> str:  # (an escaped key is the same key)
            return json.dumps(k) if draw(st.integers(0, 3)) else '"' + "".join(f"\\u{ord(c):04x}" for c in k) + '"'
        return "{" + space + ("," + space).join(f"{key(k)}{space}:{space}{json_variant(x, draw)}"
                                                for k, x in items) + space + "}"
    return json.dumps(v)  # a float: as it is


# Values of a key the format ignores: any JSON, numbers past a double or an int64 too.
EXTRA = st.one_of(st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=6), st.booleans(),
                  st.none(), st.sampled_from([Raw("1e400"), Raw("-1e400"), Raw("1" + "0" * 400), [], {}, [[{}]],
                                              {"a": [1, "b", None]}]))
AZURE_SAME_TIME = [  # (the 2023 and 2024 shapes of one instant, UTC)
    lambda t: t, lambda t: t.replace(" ", "T"), lambda t: t + "+00:00", lambda t: t + "Z", lambda t: t + "+0000",
    lambda t: t.rstrip("0").rstrip("."), lambda t: t + "00", lambda t: f" {t} ",
]


@fuzz(100)
@given(data=st.data())
def test_a_valid_file_written_another_way_is_read_the_same(data):
    """What the formats allow must not be refused, nor change what is read: the same
    records with ints as 17.0 or 1.7e1, keys reordered or escaped, extra keys where the
    format ignores them, blank lines, CRLF, a BOM, no last newline; an Azure CSV with
    either year's timestamp shape, quoted or padded cells, its columns in another order
    and one more."""
    fmt = data.draw(st.sampled_from(FORMATS))
    records = data.draw(valid_lines(fmt).filter(bool))
    with tempfile.TemporaryDirectory() as tmp:
        plain = check_read(written(render(fmt, records), "t" + SUFFIX.get(fmt, ".jsonl"), tmp), fmt)
        assert plain is not None, "a valid file refused"
        if fmt == "azure":
            columns = data.draw(st.permutations([*AZURE_COLUMNS, "Extra"]))
            rows = []
            for r in records:
                r = dict(r, Extra=data.draw(st.sampled_from(["", "x", "a,b", '"q"', "1.5"])))
                r["TIMESTAMP"] = data.draw(st.sampled_from(AZURE_SAME_TIME))(r["TIMESTAMP"])
                for c in ("ContextTokens", "GeneratedTokens"):
                    r[c] = data.draw(st.sampled_from([r[c], f" {r[c]} ", f"{r[c]}.0", f"{r[c]}e0", f"+{r[c]}"]))
                cells = [csv_cell(r[c]) for c in columns]
                rows.append(",".join(f'"{c}"' if data.draw(st.integers(0, 4)) == 0 and '"' not in c else c
                                     for c in cells))
            lines, header = [",".join(columns), *rows], 1
        elif fmt == "weka":
            extra = {"extra": data.draw(EXTRA)} if data.draw(st.booleans()) else {}
            doc = {"block_size": 16, "hash_id_scope": "local", **extra, "requests": records}
            text = json_variant(doc, data.draw)
            eol = data.draw(st.sampled_from(["\n", "\r\n"]))
            lines, header = [text.replace("\n", eol)], 1
        else:
            if fmt != "native" and data.draw(st.booleans()):  # (a native line's unknown key is refused: a typo)
                records = [dict(r, extra_key=data.draw(EXTRA)) for r in records]
            # (the header's version stays an int: 1.0 is no version, kvtrace_trace an identifier)
            head = '{"kvtrace_trace": 1, "block_size": ' + json_variant(16, data.draw) + "}"
            lines = ([head] if fmt == "native" else []) + \
                [json_variant(r, data.draw) for r in records]
            header = header_lines(fmt)
        raw, _ = data.draw(layout(lines, header))
        path = written(raw, "t" + SUFFIX.get(fmt, ".jsonl"), tmp)
        try:
            again = read_trace(path, fmt)
        except KVTraceError as err:
            raise AssertionError(f"a valid file refused: {err}\n{raw!r}") from None
        assert [native_record(r) for r in again] == [native_record(r) for r in plain]
