"""The twenty-fifth probe of trace readers, convert and generate: what a conversion leaves of
its input, and what the numbers read say, against an independent reading of the trace."""

from __future__ import annotations

import fcntl
import os
import select
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvtrace.replay.readers import read_trace
from tests.cli.support import assert_one_line, run

DATA = Path(__file__).resolve().parents[1] / "data"
WEKA = DATA / "formats" / "weka"
MOONCAKE = DATA / "mooncake_synthetic_trace.jsonl"


@pytest.mark.parametrize("name", ["all.json", "ALL.JSON", "all.json.gz"])
def test_a_conversion_of_a_weka_folder_is_never_written_among_its_conversations(tmp_path, capsys, name):
    """`kvtrace convert wk -o wk/all.json` wrote the native JSONL into the folder it read,
    exit 0, and every later read of the folder refused that file (`wk/all.json:1: Object
    missing required field block_size`, or a compressed or upper-case name): the input trace
    broken by its own conversion. Refused before any work; the folder reads as it did."""
    folder = tmp_path / "wk"
    shutil.copytree(WEKA, folder)
    before = sorted(p.name for p in folder.iterdir())
    requests = read_trace(folder)
    code, _, err = run(["convert", str(folder), "-o", str(folder / name)], capsys)
    assert_one_line(code, err, name, "WEKA folder", "write the output elsewhere")
    assert sorted(p.name for p in folder.iterdir()) == before
    assert read_trace(folder) == requests


def test_a_conversion_of_a_weka_folder_may_go_beside_its_conversations(tmp_path, capsys):
    """What the folder's read never takes (a .jsonl, a hidden file) is written there as before,
    and the folder reads the same requests afterwards."""
    folder = tmp_path / "wk"
    shutil.copytree(WEKA, folder)
    requests = read_trace(folder)
    for name in ("all.jsonl", ".all.json"):
        code, _, err = run(["convert", str(folder), "-o", str(folder / name)], capsys)
        assert code == 0, err
        assert read_trace(folder / name) == requests
    assert read_trace(folder) == requests


def test_an_azure_prompt_of_the_largest_context_fits_its_ids_at_one_token_a_block(tmp_path, monkeypatch):
    """ContextTokens runs from 1 to MAX_CONTEXT_TOKENS (2^24, the page says), and request i's
    ids are (i << 24) + j: 2^24 of them fit. At --trace-block-size 1 a row of 2^24 tokens was
    refused as 'too long for block_size 1' (the bound was >=). Shrunk here (a 2^24-id request
    is half a GB of ints): the bound and the ids' room alike, to 16."""
    from kvtrace.replay.readers import azure

    monkeypatch.setattr(azure, "MAX_CONTEXT_TOKENS", 16)
    monkeypatch.setattr(azure, "_BLOCKS_PER_REQUEST", 16)
    trace = tmp_path / "az.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,16,1\n"
                     "2023-11-16 18:15:47.0000000,16,1\n")
    first, second = read_trace(trace, block_size=1)
    assert first.hash_ids is not None and second.hash_ids is not None
    assert len(first.hash_ids) == second.input_length == 16
    assert not set(first.hash_ids) & set(second.hash_ids)


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129)])
def test_a_stop_while_a_fifos_reader_stalls_ends_the_conversion(tmp_path, signum, status):
    """`kvtrace convert TRACE -o FIFO` whose reader stopped reading (a pipe full), then
    SIGTERM (`kill`, `timeout`) or Ctrl-C: the stop raised out of the blocked write, and the
    output's close then flushed the rest of its buffer into the same full pipe, blocked again:
    the command never ended (`timeout` waited on it) until a second signal. It ends at once,
    with the stop's status, what was buffered unwritten."""
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # (a reader there first: the writer's open returns)
    proc = None
    try:
        fcntl.fcntl(reader, fcntl.F_SETPIPE_SZ, 4096)  # one page: the first 8 KiB flush fills it and blocks
        proc = subprocess.Popen([sys.executable, "-m", "kvtrace.cli", "convert", str(MOONCAKE), "-o", str(fifo)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        # (a FIFO no writer opened yet reads as at its end: select waits for the first bytes)
        # (poll, not select: select refuses a descriptor past 1,024, which a worker that ran the
        # chdb tests before this one holds)
        poller = select.poll()
        poller.register(reader, select.POLLIN)
        assert poller.poll(60_000), "the conversion wrote nothing"
        assert os.read(reader, 200)  # it writes: inside the command's stop handling, blocked on the rest
        proc.send_signal(signum)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("the conversion did not end after one stop signal (blocked flushing into the full pipe)")
        assert code == status, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc is not None and proc.stderr is not None:
            proc.stderr.close()
        os.close(reader)


def test_the_agent_workloads_contexts_grow_as_its_descriptions_say():
    """The trace-format page says the agent sessions' contexts grow "up to ~15k tokens", and
    the generator's docstring said ~10k: seeds 0-9 reach 12.3k to 15.7k. Both say ~15k."""
    import kvtrace.replay.generate as gen

    longest = [max(r.input_length for r in gen.generate("agent", seed)) for seed in range(10)]
    assert min(longest) >= 12_000 and max(longest) <= 18_000, longest
    page = (DATA.parents[1] / "docs" / "trace-format.md").read_text()
    assert "up to ~15k tokens" in page
    assert gen.__doc__ is not None and "contexts grow to ~15k tokens" in gen.__doc__


def test_the_trace_format_page_says_where_a_weka_folders_conversion_may_not_go():
    page = (DATA.parents[1] / "docs" / "trace-format.md").read_text()
    assert "`-o DIR/all.json` would make it one of the conversations, and is refused" in page


# --- every format's hits against the raw file, read without kvtrace ---------------------------

def _raw_requests(path: Path) -> list[tuple[int, int, list]]:
    """(block size, prompt tokens, block keys) of each request, from the file with json/csv
    alone, by each format's published definition: a key is the block's whole id chain in its
    scope (a WEKA local file's, an Azure request's own), so sharing needs an equal prefix."""
    import csv
    import json

    if path.is_dir():  # WEKA: files merged by arrival, ties by name then place; a full-block list's tail private
        rows = []
        for rank, file in enumerate(sorted(path.glob("*.json"))):
            doc = json.loads(file.read_text())
            bs, scope = doc["block_size"], file.name if doc.get("hash_id_scope", "local") == "local" else ""
            flat = [(e["t"] + r["t"], r) for e in doc["requests"]  # (in file order: a sub-agent's where it stands)
                    for r in (e["requests"] if e.get("type") == "subagent" else [{**e, "t": 0}])]
            for place, (t, r) in enumerate(flat):
                ids = list(r["hash_ids"]) + ([("tail", file.name, place)] if len(r["hash_ids"]) * bs < r["in"] else [])
                rows.append((t, rank, place, bs, r["in"], scope, ids))
        return [(bs, n, _chain(scope, ids)) for *_, bs, n, scope, ids in sorted(rows, key=lambda x: x[:3])]
    if path.suffix == ".csv":  # Azure: nothing shared, 16 tokens a block
        rows = list(csv.DictReader(path.open()))
        return [(16, int(r["ContextTokens"]), _chain(i, range(-(-int(r["ContextTokens"]) // 16))))
                for i, r in enumerate(rows)]
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    bs = 16 if "chat_id" in lines[0] else 512  # Bailian's 16-token blocks, Mooncake's 512
    return [(bs, o["input_length"], _chain("", o["hash_ids"])) for o in lines]


def _chain(scope, ids) -> list:
    keys, prefix = [], (scope,)
    for h in ids:
        prefix = (*prefix, h)
        keys.append(prefix)
    return keys


def _lru_hit_tokens(requests: list[tuple[int, int, list]], capacity: int | None) -> int:
    """Cache-only mode's rule: one request at a time, its cached prefix blocks hit (the partial
    last one included), then all its blocks go back, tail first (evicted first), into an LRU of
    ``capacity`` blocks; a request larger than the cache hits, and keeps nothing."""
    from collections import OrderedDict

    cache: OrderedDict = OrderedDict()
    hits = 0
    for bs, n, keys in requests:
        hit = 0
        while hit < len(keys) and keys[hit] in cache:
            hit += 1
        hits += min(hit * bs, n)
        if capacity is not None and len(keys) > capacity:
            continue
        for key in reversed(keys):
            cache.pop(key, None)
            cache[key] = None
        while capacity is not None and len(cache) > capacity:
            cache.popitem(last=False)
    return hits


@pytest.mark.parametrize("name", ["mooncake_fast25.jsonl", "mooncake_datagen.jsonl", "bailian_qwen.jsonl",
                                  "azure_2023.csv", "azure_2024.csv", "weka", "weka_subagent"])
@pytest.mark.parametrize("capacity", [None, 3, 6])
def test_each_formats_cache_only_hits_are_an_lru_over_the_files_own_ids(capsys, name, capacity):
    """The hit count a user reads (`kvtrace replay --mode cache-only --json`) against an LRU
    written here over the file itself, parsed without kvtrace's readers: requests, prompt
    tokens and hit tokens agree, unbounded and at a few blocks."""
    import json

    trace = WEKA.parent / name
    raw = _raw_requests(trace)
    argv = ["replay", str(trace), "--mode", "cache-only", "--json"]
    code, out, err = run(argv + ([] if capacity is None else ["--capacity-blocks", str(capacity)]), capsys)
    assert code == 0, err
    summary = json.loads(out)
    assert summary["requests"] == len(raw)
    assert summary["prompt_tokens"] == sum(n for _, n, _ in raw)
    assert summary["prefix_cache_hits"] == _lru_hit_tokens(raw, capacity)
