"""Fuzz: every trace reader (mooncake, bailian, weka, azure, native) on hostile files.

The invariant: a file is either read whole or refused with one one-line KVTraceError
naming the file (and, where the fault is on one line of a line-oriented file, that line
and the key at fault); never another exception. What is accepted also survives the
native writer and reads back the same.
"""

from __future__ import annotations

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
    else:  # an empty file holds no requests; a format that cannot say so must be refused above
        assert reqs == [] and what in ("empty", "blank") and fmt in ("mooncake", "bailian")


# -- regressions the fuzzer found ------------------------------------------------------------------
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
