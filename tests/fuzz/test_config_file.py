"""Fuzz: the TOML run configuration (``kvtrace replay --config``), loaded and built.

Each file goes through ``load_config_file`` and then ``validate(RunSpec(config_file=...))``,
as ``kvtrace replay --config`` does, so the config classes' own checks run too. The
invariant: a one-line KVTraceError naming the file (and the key, when the TOML parsed);
never another exception. A configuration that is accepted also runs: an engine built
from it replays two small requests.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtrace.cache.config import ALL_BEHAVIOURS, HASH_FUNCTIONS
from kvtrace.engine.clock import COEFFICIENTS, COST_MODELS
from kvtrace.engine.presets import PRESETS
from kvtrace.errors import KVTraceError
from kvtrace.replay.config_file import load_config_file
from kvtrace.replay.run import RunSpec, validate
from kvtrace.workload import TraceRequest
from tests.fuzz.support import fuzz, one_line_error

_BARE = re.compile(r"^[A-Za-z0-9_-]+$")


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        # JSON escapes are TOML basic-string escapes (DEL, which JSON leaves bare, TOML refuses bare)
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(v)


def toml_key(k: str) -> str:
    return k if _BARE.match(k) else json.dumps(k)


def toml_text(doc: dict) -> str:
    top = [f"{toml_key(k)} = {toml_value(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    tables = [f"[{toml_key(k)}]\n" + "".join(f"{toml_key(kk)} = {toml_value(vv)}\n" for kk, vv in v.items())
              for k, v in doc.items() if isinstance(v, dict)]
    return "\n".join(top) + "\n" + "\n".join(tables)


TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=8)  # TOML strings are Unicode: no surrogates
NUMBERS = st.one_of(
    st.sampled_from([0, 1, -1, -5, 2, 16, 2**31, 2**62, 2**63 - 1, -(2**63), 10**15, 549_755_813_888]),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e15, 1e300, 0.5, -0.0]),
)
HOSTILE = st.one_of(NUMBERS, TEXT, st.booleans(), st.lists(NUMBERS, max_size=3),
                    st.dictionaries(st.sampled_from(["type", "block_size", "x"]), NUMBERS | TEXT, max_size=2))


@st.composite
def group(draw) -> dict:
    kind = draw(st.sampled_from(["full_attention", "sliding_window", "mamba"]))
    g = {"type": kind, "block_size": draw(st.sampled_from([16, 32, 64, 512]))}
    if kind == "sliding_window":
        g["sliding_window"] = draw(st.sampled_from([1, 128, 4096]))
    if kind == "mamba" and draw(st.booleans()):
        g["num_lanes"] = draw(st.integers(1, 4))
    return g


PLAUSIBLE: dict[str, dict[str, st.SearchStrategy]] = {
    "cache": {
        "num_gpu_blocks": st.integers(2, 4096) | st.lists(st.integers(2, 512), min_size=1, max_size=3),
        "groups": st.lists(group(), min_size=1, max_size=3),
        "hash_block_size": st.sampled_from([16, 32, 64]),
        "prefill_checkpoint_alignment": st.sampled_from([1, 16]),
        "retention_interval": st.sampled_from(["none", 0, 512, 1024]),
        "enable_partial_hits": st.booleans(),
        "num_prefill_checkpoint_blocks": st.integers(0, 1),
        "num_speculative_blocks": st.integers(0, 2),
        "hash_fn": st.sampled_from(HASH_FUNCTIONS),
        "external_capacity_blocks": st.integers(1, 4096),
        "without": st.lists(st.sampled_from(sorted(ALL_BEHAVIOURS)), max_size=2, unique=True),
    },
    "scheduler": {
        "max_num_batched_tokens": st.integers(1, 8192),
        "max_num_seqs": st.integers(1, 256),
        "long_prefill_token_threshold": st.integers(0, 1024),
        "max_model_len": st.integers(1, 1 << 20),
        "enable_chunked_prefill": st.booleans(),
    },
    "cost_model": {
        "name": st.sampled_from([*sorted(COST_MODELS), "fit"]),  # (a built-in's name takes only its own coefficients)
        "source": TEXT,
        **{k: st.integers(0, 10**6) for k in COEFFICIENTS},
    },
}


@st.composite
def config_doc(draw) -> tuple[dict, set[str]]:
    """A TOML document of plausible values with a few made hostile; the keys it holds."""
    doc: dict = {}
    if draw(st.booleans()):
        doc["preset"] = draw(st.sampled_from(sorted(PRESETS)) | HOSTILE)
    for section, keys in PLAUSIBLE.items():
        if not draw(st.booleans()):
            continue
        names = draw(st.lists(st.sampled_from(sorted(keys)), max_size=4, unique=True))
        if section == "cost_model" and names and draw(st.booleans()):
            names = ["name"]  # a built-in model by name
        table = {k: draw(keys[k]) for k in names}
        for k in list(table):
            if draw(st.integers(0, 4)) == 0:
                table[k] = draw(HOSTILE)
        if draw(st.integers(0, 9)) == 0:
            table[draw(TEXT.filter(bool))] = draw(HOSTILE)  # an unknown key
        doc[section] = table
    if draw(st.integers(0, 9)) == 0:
        doc[draw(TEXT.filter(bool))] = draw(HOSTILE)  # an unknown top-level key
    if draw(st.integers(0, 14)) == 0 and doc:
        doc[draw(st.sampled_from(sorted(doc)))] = draw(HOSTILE)  # a section that is no table
    named = set(doc) | {k for v in doc.values() if isinstance(v, dict) for k in v}
    return doc, named


TINY = [TraceRequest(request_id="a", arrival_ns=0, input_length=40, output_length=3, hash_ids=(1, 2, 3),
                     hash_block_size=16),
        TraceRequest(request_id="b", arrival_ns=10, input_length=20, output_length=2, hash_ids=(1, 2),
                     hash_block_size=16)]


def check_config(path: str, *names: str):
    """The preset the file builds, or None after checking the refusal against the invariant."""
    try:
        load_config_file(path)
        _, _, preset = validate(RunSpec("trace.jsonl", config_file=path))
    except Exception as err:  # the invariant is about every exception
        one_line_error(err, path, *names)
        return None
    return preset


@fuzz(200)
@given(doc=config_doc())
def test_hostile_config_is_refused_naming_file_and_key(doc):
    doc, keys = doc
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.toml")
        Path(path).write_text(toml_text(doc), encoding="utf-8")
        try:
            load_config_file(path)
            _, _, preset = validate(RunSpec("trace.jsonl", config_file=path))
        except Exception as err:  # the invariant is about every exception
            text = one_line_error(err, path)
            if "invalid TOML" not in text:  # e.g. a key twice: tomllib names the line
                assert any(k in text if _BARE.match(k) else repr(k) in text for k in keys), \
                    f"no key of the file named: {text!r}"
            return
    from kvtrace.engine import Engine

    try:
        result = Engine(preset, content=False).run(list(TINY))
    except KVTraceError as err:  # a request this configuration cannot hold: a user error too
        one_line_error(err, "request a")
        assert any(k in str(err) for k in ("max_model_len", "max_num_batched_tokens", "num_gpu_blocks")), err
    else:
        assert len(result.requests) == 2


@fuzz(60)
@given(data=st.binary(max_size=200))
def test_arbitrary_bytes_config(data):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.toml")
        Path(path).write_bytes(data)
        check_config(path)


@fuzz(60)
@given(doc=config_doc(), data=st.data())
def test_config_with_bytes_spliced_in(doc, data):
    raw = bytearray(toml_text(doc[0]).encode())
    at = data.draw(st.integers(0, len(raw)))
    raw[at:at] = data.draw(st.binary(min_size=1, max_size=3))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.toml")
        Path(path).write_bytes(bytes(raw))
        check_config(path)


@pytest.mark.parametrize("what", ["directory", "missing", "fifo-like empty", "non-utf8 line 3"])
def test_not_a_config_file(tmp_path: Path, what):
    path = tmp_path / "run.toml"
    if what == "directory":
        path.mkdir()
    elif what == "fifo-like empty":
        path.write_bytes(b"")
    elif what == "non-utf8 line 3":
        path.write_bytes(b'preset = "kimi-hybrid"\n[cache]\nhash_fn = "\xff"\n')
    try:
        load_config_file(path)
        validate(RunSpec("trace.jsonl", config_file=str(path)))
    except KVTraceError as err:
        text = one_line_error(err, str(path))
        if what == "non-utf8 line 3":
            assert "line 3" in text
    else:
        assert what == "fifo-like empty"  # an empty file is a valid, empty configuration


# -- regressions the fuzzer found ------------------------------------------------------------------
def test_prompt_beyond_the_step_budget_without_chunked_prefill_names_the_setting(tmp_path: Path):
    """It was blamed on the KV pool ("needs more KV blocks than the pool holds; raise
    --capacity-blocks"), which no capacity could fix."""
    from kvtrace.engine import Engine

    path = tmp_path / "run.toml"
    path.write_text("[scheduler]\nenable_chunked_prefill = false\nmax_num_batched_tokens = 8\nmax_num_seqs = 8\n")
    _, _, preset = validate(RunSpec("trace.jsonl", config_file=str(path)))
    with pytest.raises(KVTraceError) as info:
        Engine(preset, content=False).run(list(TINY))
    text = one_line_error(info.value, "request a", "max_num_batched_tokens 8", "enable_chunked_prefill")
    assert "capacity-blocks" not in text


def test_checkpoints_switched_off_in_the_file_drop_the_presets_alignment(tmp_path: Path):
    """kimi-hybrid's prefill_checkpoint_alignment 16 outlived num_prefill_checkpoint_blocks = 0
    and was refused as "CacheConfig: prefill_checkpoint_alignment", naming neither file nor key."""
    path = tmp_path / "run.toml"
    path.write_text("[cache]\nnum_prefill_checkpoint_blocks = 0\n")
    config, _, _ = validate(RunSpec("trace.jsonl", config_file=str(path)))
    assert config["cache"]["num_prefill_checkpoint_blocks"] == 0
    assert config["cache"]["prefill_checkpoint_alignment"] is None


def test_a_presets_value_in_conflict_with_the_file_names_the_file_and_its_keys(tmp_path: Path):
    """A preset setting the file left alone (kimi-hybrid's retention_interval 0) that its
    groups make invalid: the error named only "CacheConfig: retention_interval"."""
    path = tmp_path / "run.toml"
    path.write_text('[cache]\ngroups = [{ type = "full_attention", block_size = 64 }]\n')
    with pytest.raises(KVTraceError) as info:
        validate(RunSpec("trace.jsonl", config_file=str(path)))
    one_line_error(info.value, f"{path}: cache.groups: conflicts with the preset's retention_interval")


def test_an_unknown_key_of_blanks_or_line_breaks_is_named_quoted(tmp_path: Path):
    """A key "\\r" was named as blank space (the one-line message turns line breaks into spaces)."""
    path = tmp_path / "run.toml"
    path.write_text('"\\r" = 0\n[cache]\n" " = 1\n')
    with pytest.raises(KVTraceError) as info:
        load_config_file(path)
    one_line_error(info.value, f"{path}: '\\r': unknown key")
    path.write_text('[cache]\n" " = 1\n')
    with pytest.raises(KVTraceError) as info:
        load_config_file(path)
    one_line_error(info.value, f"{path}: cache.' ': unknown key")


def _fitted(name: str, **coefficients: int) -> str:
    """A [cost_model] table of a fitted model: h200-dense-8b's coefficients, some changed."""
    model = COST_MODELS["h200-dense-8b"]
    values = {k: coefficients.get(k, getattr(model, k)) for k in COEFFICIENTS}
    return f"[cost_model]\nname = {json.dumps(name)}\n" + "".join(f"{k} = {v}\n" for k, v in values.items())


@pytest.mark.parametrize("name", ["a\x1b[31mred", "two\nlines", "tab\there", "   ", "\u202eevil"])
def test_a_cost_model_name_that_is_no_printable_text_is_refused(tmp_path: Path, name):
    """Every summary shows the name: an escape sequence in it recoloured the terminal of
    `kvtrace replay` (as `kvtrace calibrate --name` refuses it, the file does too)."""
    path = tmp_path / "run.toml"
    path.write_text(_fitted(name), encoding="utf-8")
    with pytest.raises(KVTraceError) as info:
        load_config_file(path)
    one_line_error(info.value, f"{path}: cost_model.name: expected a name of printable text")
    assert "\x1b" not in str(info.value)


def test_a_built_in_cost_models_name_takes_only_its_own_coefficients(tmp_path: Path):
    """A fitted model named h200-dense-8b ran under that name with other coefficients:
    two runs said one cost model made their times, and the times disagreed."""
    path = tmp_path / "run.toml"
    path.write_text(_fitted("h200-dense-8b", token_ns=1), encoding="utf-8")
    with pytest.raises(KVTraceError) as info:
        load_config_file(path)
    one_line_error(info.value, f"{path}: cost_model.name: h200-dense-8b: is a built-in cost model's name",
                   "token_ns is not 11,675")
    path.write_text(_fitted("h200-dense-8b"), encoding="utf-8")  # its own coefficients: the model itself
    assert load_config_file(path).cost_model == COST_MODELS["h200-dense-8b"]
    path.write_text(_fitted("mine", token_ns=1), encoding="utf-8")  # another name: a model of its own
    model = load_config_file(path).cost_model
    assert model is not None and (model.name, model.token_ns) == ("mine", 1)


# -- grammar-aware: one key of a valid file hostile, named; one file in other TOML spellings ---------------
TOML_HOSTILE = st.one_of(
    st.sampled_from([0, -1, 1, 2**31, 2**53 + 1, 2**63 - 1, -(2**63), math.nan, math.inf, -math.inf, -0.0, 16.0, 0.5,
                     1e300, "", " ", "16", "none", "None", "é", "\u0000", "🙂", "\u202e", True, False, [], [16],
                     [[16]], ["a", 1], [{}], {}, {"a": 1}, {"type": "full_attention"}]),
    st.integers(-(2**63), 2**63 - 1), TEXT,
)
DATES = st.sampled_from(["1979-05-27", "07:32:00", "1979-05-27T07:32:00Z", "1979-05-27 07:32:00.999999"])


@fuzz(120)
@given(data=st.data())
def test_one_key_of_a_valid_file_given_a_hostile_value_is_named(data):
    """A valid file, then one of its keys (a section's, or a group's, or preset) given a
    hostile value (huge, negative, NaN, a string, a date, a table where a scalar goes, and
    the other way round): accepted, or refused in one line naming that very key."""
    section = data.draw(st.sampled_from([*sorted(PLAUSIBLE), "preset"]))
    if section == "preset":
        table, key = {}, "preset"
    elif section == "cost_model":  # a fitted model: every coefficient, valid together (a built-in's)
        model = COST_MODELS[data.draw(st.sampled_from(sorted(COST_MODELS)))]
        table = {"name": "fit", **{k: getattr(model, k) for k in COEFFICIENTS}}
        key = data.draw(st.sampled_from(sorted(table)))
    else:
        keys = PLAUSIBLE[section]
        table = {k: data.draw(keys[k]) for k in data.draw(st.lists(st.sampled_from(sorted(keys)), max_size=3,
                                                                  unique=True))}
        key = data.draw(st.sampled_from(sorted(keys)))
    value = data.draw(TOML_HOSTILE)
    named = key if section == "preset" else f"{section}.{key}"
    date = data.draw(DATES) if data.draw(st.integers(0, 5)) == 0 else None  # (a TOML date: no JSON twin)
    if key == "groups" and not date and data.draw(st.booleans()):  # one key of one group instead
        groups = data.draw(PLAUSIBLE["cache"]["groups"])
        i = data.draw(st.integers(0, len(groups) - 1))
        groups[i][data.draw(st.sampled_from([*sorted(groups[i]), "sliding_window", "num_lanes"]))] = value
        value, named = groups, f"cache.groups[{i}]"
    written = date or toml_value(value)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.toml")
        table.pop(key, None)
        Path(path).write_text(toml_text({section: table}) if table else "", encoding="utf-8")
        if table and section != "cost_model" and check_config(path) is None:  # (at odds with each other or the preset)
            table = {}
        head = "" if section == "preset" else f"[{section}]\n"
        Path(path).write_text(head + "".join(f"{toml_key(k)} = {toml_value(v)}\n" for k, v in table.items())
                              + f"{toml_key(key)} = {written}\n", encoding="utf-8")
        try:
            load_config_file(path)
            validate(RunSpec("trace.jsonl", config_file=path))
        except Exception as err:  # the invariant is about every exception
            text = one_line_error(err, path)
            # (a rule of two keys names the other, and this one by its bare name: moe_expert_ns without num_experts)
            assert named in text or re.search(rf"\b{re.escape(key)}\b", text), f"{named} not named in {text!r}"


@fuzz(60)
@given(doc=config_doc(), data=st.data())
def test_one_file_in_other_toml_spellings_loads_the_same(doc, data):
    """A file and the same file spelled otherwise (dotted keys for tables, comments, a BOM,
    CRLF, literal strings, spaces, a last newline or none) load the same, or are refused
    alike."""
    doc, _ = doc

    def spelled(d: dict) -> str:
        top, tables = [], []  # (a key after a table header is that table's: top-level and dotted keys first)
        for k, v in d.items():
            if isinstance(v, dict) and v and data.draw(st.booleans()):  # dotted keys, no table header
                top += [f"{toml_key(k)}.{toml_key(kk)} = {toml_value(vv)}" for kk, vv in v.items()]
            elif isinstance(v, dict):
                tables.append(f"[ {toml_key(k)} ]  # a comment")
                tables += [f"{toml_key(kk)}\t=  {toml_value(vv)}   # {kk}" for kk, vv in v.items()]
            else:
                string = isinstance(v, str) and "'" not in v and v.isprintable()
                top.append(f"{toml_key(k)} = " + (f"'{v}'" if string and data.draw(st.booleans()) else toml_value(v)))
        eol = data.draw(st.sampled_from(["\n", "\r\n"]))
        return eol.join(top + tables) + (eol if data.draw(st.booleans()) else "")

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, text in enumerate([toml_text(doc), spelled(doc)]):
            path = os.path.join(tmp, f"run{i}.toml")
            raw = text.encode("utf-8")
            Path(path).write_bytes(b"\xef\xbb\xbf" + raw if i and data.draw(st.booleans()) else raw)
            try:
                results.append(load_config_file(path))
            except Exception as err:  # the invariant is about every exception
                one_line_error(err, path)
                results.append(None)
    assert results[0] == results[1]
