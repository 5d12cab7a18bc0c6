"""docs/trace-format.md against the readers and generators it describes: its example error, its
constants and its table of generated workloads are what the code does."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from kvtrace.errors import KVTraceError

DOC = (Path(__file__).resolve().parents[1] / "docs" / "trace-format.md").read_text(encoding="utf-8")


def test_the_example_error_is_the_readers(tmp_path):
    example = re.search(r"e\.g\. `(trace\.jsonl:42: [^`]+)`", DOC)
    assert example is not None
    m = re.search(r"input_length (\d+) / block_size (\d+)\) = \d+ ids, got (\d+)", example.group(1))
    assert m is not None
    length, block, got = (int(g) for g in m.groups())
    assert block == 512  # the Mooncake default the example names
    trace = tmp_path / "trace.jsonl"
    line = f'{{"timestamp": 0, "input_length": {length}, "output_length": 1, "hash_ids": {list(range(got))}}}\n'
    trace.write_text("".join(
        line if i == 41 else f'{{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [{i}]}}\n'
        for i in range(42)))
    from kvtrace.replay.readers import read_trace

    with pytest.raises(KVTraceError) as err:
        read_trace(trace)
    assert str(err.value).replace(str(tmp_path) + "/", "") == example.group(1)


def test_the_constants_the_page_states():
    from kvtrace.replay.readers import azure, weka
    from kvtrace.workload import lines

    assert "each in `[0, 163840)`" in DOC and lines.VOCAB_SIZE == 163_840
    assert "Ids must lie in `[0, 2^63)`" in DOC and lines.MAX_ID == 2**63 - 1
    assert "`2^62 + index`" in DOC and weka.TAIL_ID_BASE == 2**62
    assert "`(i << 24) + j`" in DOC and azure._BLOCKS_PER_REQUEST == 1 << 24


def test_the_generate_signature_is_the_functions():
    """The page writes the positional parameters without their defaults but num_requests', then
    the keyword-only ones with theirs."""
    from kvtrace.replay.generate import generate

    said = re.search(r"`kvtrace\.replay\.generate\.generate\(([^`]+)\)`", DOC)
    assert said is not None
    parts = []
    for p in inspect.signature(generate).parameters.values():
        if p.kind is p.KEYWORD_ONLY and "*" not in parts:
            parts.append("*")
        shown = p.kind is p.KEYWORD_ONLY or p.default is None
        parts.append(f"{p.name}={p.default!r}".replace("'", '"') if shown else p.name)
    assert " ".join(said.group(1).split()) == ", ".join(parts)


def test_the_generated_workloads_table_is_the_generators():
    from kvtrace.replay.generate import WORKLOADS, generate

    rows = dict(re.findall(r"^\| `([a-z-]+)` \| (\d+) \|", DOC, flags=re.M))
    assert set(rows) == set(WORKLOADS)
    for name, count in rows.items():
        assert len(generate(name)) == int(count), name
    mixed = sum(r.input_length for r in generate("mixed"))
    said = re.search(r"the `kvtrace demo` workload \(~(\d+)k prompt tokens\)", DOC)
    assert said is not None and round(mixed / 1000, -1) == int(said.group(1))


def test_the_format_table_is_the_readers(tmp_path):
    """Each row's block size and time unit are the reader's (a trace of one request at 1 and
    one at 2 of the unit), and README's --trace-block-size defaults are the same sizes."""
    from kvtrace.replay.readers import BLOCK_SIZE_OPTION, read_trace

    table = DOC[DOC.index("| format | detected by |"):]
    table = table[:table.index("\n\n")]
    rows = {m.group(1): [c.strip() for c in m.group(2).split("|")]
            for m in re.finditer(r"^\| `([a-z]+)` \|(.+)\|$", table, flags=re.M)}
    assert set(rows) == {"mooncake", "bailian", "weka", "azure", "native"}
    for fmt, default in BLOCK_SIZE_OPTION.items():
        assert rows[fmt][2].startswith(f"{default} (`--trace-block-size`)"), fmt
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    said = re.search(r"Mooncake, Bailian or Azure trace, which the file does not say: default (\d+), (\d+), (\d+)",
                     readme)
    assert said is not None
    assert [int(g) for g in said.groups()] == [BLOCK_SIZE_OPTION[f] for f in ("mooncake", "bailian", "azure")]

    def mooncake(t: int) -> str:
        return f'{{"timestamp": {t}, "input_length": 4, "output_length": 1, "hash_ids": [{t}]}}'

    def bailian(t: int) -> str:
        return (f'{{"chat_id": {t}, "parent_chat_id": -1, "timestamp": {t}, "input_length": 4, "output_length": 1, '
                f'"hash_ids": [{t}]}}')

    def native(t: int) -> str:
        return f'{{"arrival_ns": {t}, "input_length": 4, "output_length": 1, "token_ids": [1, 2, 3, 4]}}'

    files = {
        "mooncake": "\n".join(mooncake(t) for t in (1, 2)),
        "bailian": "\n".join(bailian(t) for t in (1, 2)),
        "native": '{"kvtrace_trace": 1}\n' + "\n".join(native(t) for t in (1, 2)),
        "azure": "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:45,4,1\n2023-11-16 18:15:46,4,1\n",
        "weka": '{"block_size": 4, "requests": [{"t": 1, "in": 4, "out": 1, "hash_ids": [1]}, '
                '{"t": 2, "in": 4, "out": 1, "hash_ids": [2]}]}',
    }
    unit_ns = {"ms": 1_000_000, "s (float)": 1_000_000_000, "ns": 1}
    for fmt, text in files.items():
        path = tmp_path / f"{fmt}.{'csv' if fmt == 'azure' else 'json' if fmt == 'weka' else 'jsonl'}"
        path.write_text(text + "\n")
        a, b = read_trace(path)  # (detected: the table's second column)
        unit = rows[fmt][3]
        if unit in unit_ns:
            assert (a.arrival_ns, b.arrival_ns) == (unit_ns[unit], 2 * unit_ns[unit]), fmt
        else:  # azure: timestamps, relative to the first row
            assert unit == "timestamp" and (a.arrival_ns, b.arrival_ns) == (0, 1_000_000_000), fmt


def test_line_formats_stream_and_weka_conversations_are_read_whole(tmp_path):
    """The page said every reader streams its file: a WEKA conversation is one JSON document,
    read whole (its fault at the end is told before its first request), and a directory's
    conversations are all read at once; a line format yields its requests before a bad line."""
    import json

    from kvtrace.replay.readers import open_trace

    said = " ".join(DOC.split())
    assert "Every reader streams its file (but WEKA's: a conversation is one JSON document, read whole" in said
    good = {"t": 0.0, "in": 64, "out": 1, "hash_ids": [1]}
    weka = tmp_path / "c.json"
    weka.write_text(json.dumps({"block_size": 64, "requests": [good, {**good, "t": 1.0, "in": 0}]}))
    with pytest.raises(KVTraceError, match=r"requests\[1\]\.in"):
        next(iter(open_trace(weka)))
    folder = tmp_path / "w"
    folder.mkdir()
    (folder / "a.json").write_text(json.dumps({"block_size": 64, "requests": [good]}))
    (folder / "z.json").write_text(json.dumps({"block_size": 64, "requests": [{**good, "t": 5.0, "in": 0}]}))
    with pytest.raises(KVTraceError, match=r"z\.json.*requests\[0\]\.in"):
        next(iter(open_trace(folder)))  # (a.json's request, first by arrival, is not given before z.json is read)
    lines = tmp_path / "m.jsonl"
    lines.write_text('{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [0]}\nnot json\n')
    assert next(iter(open_trace(lines))).request_id == "r0"


def test_mooncake_request_ids_count_requests_not_lines(tmp_path):
    """The page said `r0, r1, ...` 'by line'; a blank line takes no number."""
    from kvtrace.replay.readers import read_trace

    assert "Request ids are `r0, r1, ...` in file order (blank lines not counted)." in " ".join(DOC.split())
    trace = tmp_path / "m.jsonl"
    row = '{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [0]}'
    trace.write_text(f"\n{row}\n\n  \n{row}\n")
    assert [r.request_id for r in read_trace(trace)] == ["r0", "r1"]


def test_a_converted_traces_header_names_its_source_and_the_limit_that_cut_it(tmp_path):
    """The page named the header's `source` only: `kvtrace convert --limit` also writes `source_limit`."""
    import json

    from typer.testing import CliRunner

    from kvtrace.cli import app

    said = " ".join(DOC.split())
    assert ("the header's `source` names the source, and `source_limit` the requests kept of it where `--limit` "
            "cut it.") in said
    trace = tmp_path / "m.jsonl"
    trace.write_text("".join(f'{{"timestamp": {t}, "input_length": 4, "output_length": 1, "hash_ids": [{t}]}}\n'
                             for t in range(3)))
    for limit, kept in ((["--limit", "2"], 2), ([], None)):
        out = tmp_path / f"out{kept}.jsonl"
        result = CliRunner().invoke(app, ["convert", str(trace), "-o", str(out), *limit])
        assert result.exit_code == 0, result.output
        header = json.loads(out.read_text().splitlines()[0])
        assert header["source"].startswith("mooncake:sha256:") and header.get("source_limit") == kept


def test_an_output_length_of_zero_is_run_with_one_token_as_the_doc_says(tmp_path):
    """docs/trace-format.md said only "tokens to generate": engine mode runs 0 as 1 (vLLM's
    max_tokens >= 1), and that token counts in output_tokens."""
    from kvtrace.replay.run import RunSpec, run_replay

    assert "0 is run as 1 in engine mode" in DOC
    trace = tmp_path / "t.jsonl"
    line = '{{"request_id": "{}", "arrival_ns": {}, "input_length": 40, "output_length": {}, "hash_ids": [1, 2, {}]}}\n'
    trace.write_text('{"kvtrace_trace": 1, "block_size": 16}\n' + line.format("a", 0, 0, 3) + line.format("b", 5, 3, 4))
    summary = run_replay(RunSpec(str(trace), content=False)).summary
    assert summary["requests"] == 2 and summary["output_tokens"] == 1 + 3
