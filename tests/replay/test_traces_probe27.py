"""The twenty-seventh probe of trace readers, convert and generate: a trace that is not UTF-8
text said as what it is, and the hits a re-blocked or generated trace replays to, against a
reading of the files written here without kvtrace's readers."""

from __future__ import annotations

import csv
import json
from collections import OrderedDict
from pathlib import Path

import pytest

from tests.cli.support import assert_one_line, run

DATA = Path(__file__).resolve().parents[1] / "data"
FORMATS = DATA / "formats"
MOONCAKE_LINES = ['{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}',
                  '{"timestamp": 3, "input_length": 700, "output_length": 5, "hash_ids": [1, 3]}']
AZURE_LINES = ["TIMESTAMP,ContextTokens,GeneratedTokens", "2023-11-16 18:15:46.6805900,374,44",
               "2023-11-16 18:15:47.0000000,37,4"]
WEKA_DOC = '{"block_size": 64, "requests": [{"t": 0, "in": 130, "out": 4, "hash_ids": [1, 2]}]}'


# --- wide text without a byte-order mark, and NUL bytes --------------------------------------

@pytest.mark.parametrize("encoding", ["UTF-16LE", "UTF-16BE", "UTF-32LE", "UTF-32BE"])
@pytest.mark.parametrize("kind", ["mooncake", "mooncake --format", "azure", "azure --format", "weka folder"])
def test_wide_text_without_a_byte_order_mark_is_named_with_how_to_convert_it(tmp_path, capsys, encoding, kind):
    """`iconv -t UTF-16LE` (or a tool saving 'Unicode' without a BOM) writes no byte-order
    mark, and such a trace was 'invalid JSON: JSON is malformed: object keys must be strings
    (byte 1)', or for an Azure CSV 'missing column(s)' naming the three columns its header
    holds: true of the bytes, not what the file is or how to read it. A BOM'd one was named."""
    codec = encoding.replace("UTF-", "utf_").lower()  # (Python's name of each: no BOM written)
    argv = ["replay", "--mode", "cache-only"]
    if kind.startswith("weka"):
        (tmp_path / "wk").mkdir()
        named = path = tmp_path / "wk" / "c.json"
        path.write_bytes(WEKA_DOC.encode(codec))
        argv.append(str(tmp_path / "wk"))
    else:
        lines = AZURE_LINES if kind.startswith("azure") else MOONCAKE_LINES
        named = path = tmp_path / f"t.{'csv' if kind.startswith('azure') else 'jsonl'}"
        path.write_bytes("\n".join(lines + [""]).encode(codec))
        argv.append(str(path))
        if kind.endswith("--format"):
            argv += ["--format", kind.split()[0]]
    code, _, err = run(argv, capsys)
    line = assert_one_line(code, err)
    assert line == (f"kvtrace: error: {named}: {encoding} text without a byte-order mark; kvtrace reads traces as "
                    f"UTF-8: convert it first (iconv -f {encoding} -t UTF-8)"), line


def test_a_trace_of_ascii_text_is_never_taken_for_wide_text(tmp_path, capsys):
    """The wide-text test reads NUL bytes between ASCII characters: a UTF-8 trace, short or
    long, any format's, replays as it did."""
    for name, lines in (("m.jsonl", MOONCAKE_LINES[:1]), ("a.csv", AZURE_LINES)):
        path = tmp_path / name
        path.write_text("\n".join(lines) + "\n")
        code, out, err = run(["replay", str(path), "--mode", "cache-only", "--json"], capsys)
        assert code == 0, err
        assert json.loads(out)["requests"] == len(lines) - (name == "a.csv")


def _padded(path: Path, text: str, zeros: int = 512) -> Path:
    path.write_bytes(text.encode() + b"\0" * zeros)  # (as a crash leaves a preallocated file)
    return path


NUL = "a NUL byte (\\x00)"


@pytest.mark.parametrize("kind", ["mooncake", "native", "azure", "weka", "zeros", "zeros azure", "mid-line"])
def test_a_nul_byte_in_a_trace_is_named_at_its_line(tmp_path, capsys, kind):
    """A trace padded with zero bytes (a writer that crashed after preallocating, a copy cut
    short on some file systems) was 'invalid JSON: JSON is malformed: invalid character (byte
    0)', a WEKA file's 'trailing characters (byte 56)', an Azure row's 'expected 3 columns,
    got 1', and a file of zeros 'cannot detect the trace format' alone."""
    argv = ["replay", "--mode", "cache-only"]
    where = "2"
    if kind == "mooncake":
        path = _padded(tmp_path / "m.jsonl", MOONCAKE_LINES[0] + "\n")
    elif kind == "native":
        path = _padded(tmp_path / "n.jsonl", '{"kvtrace_trace": 1}\n{"arrival_ns": 0, "input_length": 2, '
                                             '"output_length": 1, "token_ids": [1, 2]}\n')
        where = "3"
    elif kind == "azure":
        path = _padded(tmp_path / "a.csv", "\n".join(AZURE_LINES[:2]) + "\n")
        where = "3"
    elif kind == "weka":
        (tmp_path / "wk").mkdir()
        _padded(tmp_path / "wk" / "c.json", WEKA_DOC + "\n")
        path = tmp_path / "wk" / "c.json"
        argv.append(str(tmp_path / "wk"))
    elif kind.startswith("zeros"):
        path = _padded(tmp_path / "z.jsonl", "")
        where = "1"
        if kind.endswith("azure"):
            argv += ["--format", "azure"]
    else:  # a NUL inside a line that is otherwise a request
        path = tmp_path / "m.jsonl"
        path.write_text(MOONCAKE_LINES[0] + "\n" + MOONCAKE_LINES[1][:20] + "\0" + MOONCAKE_LINES[1][20:] + "\n")
    if kind != "weka":
        argv.append(str(path))
    code, _, err = run(argv, capsys)
    assert_one_line(code, err, f"{path}:{where}: ", NUL, "padded with zeros")
    if kind == "mid-line":
        assert "at column 21:" in err


# --- truth: re-blocked and generated traces against an LRU over the files' content --------------

def _lru_hits(requests: list[tuple[int, list]], block_size: int, capacity: int | None) -> int:
    """Cache-only mode's rule, written here: each request's cached prefix blocks hit (the
    partial last one too, its tokens at most the prompt's), then all its blocks go back, the
    tail first, into an LRU of ``capacity`` blocks; a request of more blocks keeps none."""
    cache: OrderedDict = OrderedDict()
    hits = 0
    for n, keys in requests:
        hit = 0
        while hit < len(keys) and keys[hit] in cache:
            hit += 1
        hits += min(hit * block_size, n)
        if capacity is not None and len(keys) > capacity:
            continue
        for key in reversed(keys):
            cache.pop(key, None)
            cache[key] = None
        while capacity is not None and len(cache) > capacity:
            cache.popitem(last=False)
    return hits


def _content_keys(blocks: list, n: int, trace_block: int, block_size: int) -> list:
    """The keys of a prompt of ``n`` tokens made of ``blocks`` (one per trace block, each
    standing for its fixed tokens) cut into blocks of ``block_size``: each key is the whole
    content before it and its own, as (trace block, first token, end) pieces."""
    keys: list = []
    prefix: tuple = ()
    for start in range(0, n, block_size):
        end, pieces, at = min(start + block_size, n), [], start
        while at < end:
            j = at // trace_block
            stop = min(end, (j + 1) * trace_block)
            pieces.append((blocks[j], at - j * trace_block, stop - j * trace_block))
            at = stop
        prefix = (*prefix, tuple(pieces))
        keys.append(prefix)
    return keys


def _jsonl_prompts(path: Path) -> list[tuple[int, list]]:
    """(prompt tokens, trace blocks) of each Mooncake or Bailian line: one id a block."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(o["input_length"], list(o["hash_ids"])) for o in rows]


def _weka_prompts(folder: Path) -> list[tuple[int, list]]:
    """A WEKA folder's requests by arrival (ties: file name, place), their ids scoped to the
    file (local) or shared (global), a full-block list's leftover tail its own block."""
    rows = []
    for rank, file in enumerate(sorted(folder.glob("*.json"))):
        doc = json.loads(file.read_text())
        scope = file.name if doc.get("hash_id_scope", "local") == "local" else ""
        for place, r in enumerate(doc["requests"]):
            blocks = [(scope, h) for h in r["hash_ids"]]
            if len(blocks) * doc["block_size"] < r["in"]:
                blocks.append(("tail", file.name, place))
            rows.append((r["t"], rank, place, r["in"], blocks))
    return [(n, blocks) for *_, n, blocks in sorted(rows, key=lambda x: x[:3])]


def _summary(capsys, trace: Path, *flags: str) -> dict:
    code, out, err = run(["replay", str(trace), "--mode", "cache-only", "--json", *flags], capsys)
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize(("name", "trace_block", "block_size"), [
    ("mooncake_fast25.jsonl", 512, 256), ("mooncake_fast25.jsonl", 512, 1024), ("mooncake_fast25.jsonl", 512, 300),
    ("bailian_qwen.jsonl", 16, 8), ("bailian_qwen.jsonl", 16, 64), ("weka", 64, 16), ("weka", 64, 100)])
@pytest.mark.parametrize("capacity", [None, 4])
def test_a_trace_re_blocked_by_cache_only_mode_hits_what_its_content_shares(capsys, name, trace_block, block_size,
                                                                              capacity):
    """`--block-size` other than the trace's re-blocks it by content (README): the hits a
    user reads equal an LRU written here over blocks cut from the file's own ids at that
    size (a block spanning two trace blocks, a partial one), unbounded and at a few blocks."""
    trace = FORMATS / name
    prompts = _weka_prompts(trace) if trace.is_dir() else _jsonl_prompts(trace)
    requests = [(n, _content_keys(blocks, n, trace_block, block_size)) for n, blocks in prompts]
    flags = ["--block-size", str(block_size)] + ([] if capacity is None else ["--capacity-blocks", str(capacity)])
    summary = _summary(capsys, trace, *flags)
    assert summary["block_size"] == block_size
    assert summary["requests"] == len(requests)
    assert summary["prompt_tokens"] == summary["prefix_cache_queries"] == sum(n for n, _ in requests)
    assert summary["total_blocks"] == sum(len(keys) for _, keys in requests)
    assert summary["prefix_cache_hits"] == _lru_hits(requests, block_size, capacity)


@pytest.mark.parametrize("workload", ["mixed", "study-shared-prefix-pinning"])
def test_a_generated_trace_hits_what_its_tokens_share_in_either_format(tmp_path, capsys, workload):
    """`kvtrace generate` builds prompts as tokens and writes them as ids: the native file
    (16-token ids) replayed at 16 and 64 tokens a block, and the Mooncake file (re-blocked to
    512), hit what an LRU over the workload's own tokens cut at that size predicts."""
    from kvtrace.replay.generate import generate

    prompts = [r.token_ids for r in generate(workload, 3, prompt="tokens")]
    native, mooncake = tmp_path / "g.jsonl", tmp_path / "g.mooncake.jsonl"
    for path, fmt in ((native, "native"), (mooncake, "mooncake")):
        code, _, err = run(["generate", workload, "-o", str(path), "--seed", "3", "--format", fmt], capsys)
        assert code == 0, err
    for trace, block_size, capacity in ((native, 16, None), (native, 16, 300), (native, 64, 100),
                                        (mooncake, 512, None), (mooncake, 512, 20)):
        requests = []
        for tokens in prompts:
            keys, prefix = [], b""
            for start in range(0, len(tokens), block_size):
                prefix += tokens[start:start + block_size].tobytes() + b"|"
                keys.append(prefix)
            requests.append((len(tokens), keys))
        flags = ["--capacity-blocks", str(capacity)] if capacity else []
        if trace == native and block_size != 16:
            flags += ["--block-size", str(block_size)]
        summary = _summary(capsys, trace, *flags)
        assert summary["requests"] == len(prompts)
        assert summary["prefix_cache_hits"] == _lru_hits(requests, block_size, capacity), (trace.name, block_size)


def test_azure_rows_read_as_the_csv_module_reads_them(capsys):
    """The full Azure sample: requests, prompt and output tokens as the csv module reads the
    columns, and no hit (nothing is shared by construction)."""
    trace = DATA / "AzureLLMInferenceTrace_conv.csv"
    with trace.open(newline="") as f:
        rows = list(csv.DictReader(f))
    summary = _summary(capsys, trace)
    assert summary["requests"] == len(rows)
    assert summary["prompt_tokens"] == sum(int(r["ContextTokens"]) for r in rows)
    assert summary["total_blocks"] == sum(-(-int(r["ContextTokens"]) // 16) for r in rows)
    assert summary["prefix_cache_hits"] == 0


# --- a trace that grows while it is read ------------------------------------------------------

def test_a_file_growing_as_fast_as_it_is_hashed_is_hashed_as_it_was_when_opened(tmp_path, monkeypatch):
    """A writer extending a trace faster than its sha256 read it (sparse gigabytes a second:
    `truncate -s +10G` in a loop) kept the hash reading for ever, `kvtrace replay` with it,
    where the change it then finds is refused. The hash is of the bytes the file held when
    opened (the caller's stamps say it changed); here a writer appends a MiB at every read."""
    import hashlib

    from kvtrace.workload import lines

    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(MOONCAKE_LINES) + "\n")
    want = hashlib.sha256(path.read_bytes()).hexdigest()
    real_open = open

    class Growing:
        def __init__(self, f):
            self.f, self.reads = f, 0

        def read(self, size: int = -1) -> bytes:
            self.reads += 1
            assert self.reads < 64, "the hash read on as long as the file grew"
            with real_open(path, "ab") as writer:
                writer.write(b" " * (1 << 20))
            return self.f.read(size)

        def fileno(self) -> int:
            return self.f.fileno()

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.f.close()

    monkeypatch.setattr(lines, "open", lambda p, mode="r": Growing(real_open(p, mode)), raising=False)
    assert lines.file_sha256(str(path)) == want


def test_a_trace_appended_to_faster_than_it_is_read_is_refused_while_read(tmp_path, monkeypatch):
    """Requests appended while a trace was read were refused only at its end: a writer that
    kept ahead of the read (a replay slower than the log it reads) kept it reading for ever.
    The files are looked at every so many requests (here 4) as they are read."""
    from kvtrace.errors import TraceFormatError
    from kvtrace.replay.readers import open_trace, source

    monkeypatch.setattr(source, "CHECKED_EVERY", 4, raising=False)
    path = tmp_path / "m.jsonl"
    line = MOONCAKE_LINES[0] + "\n"  # (one arrival time for all)
    path.write_text(line * 10)
    for limit in (None, 10_000):
        read = 0
        with pytest.raises(TraceFormatError, match=r"m\.jsonl: changed while kvtrace read it"):
            for _ in open_trace(path, limit=limit):
                read += 1
                if read == 1:
                    with path.open("a") as f:
                        f.write(line * 1000)
        assert read == 4, read
        path.write_text(line * 10)
