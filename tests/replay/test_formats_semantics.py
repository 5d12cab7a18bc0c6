"""Each public trace format read as its publisher defines it, on small samples in each exact
public shape (tests/data/formats/), and `kvtrace convert` round trips.

The definitions checked (time unit and origin, block size, partial last block, what shares
a prefix with what, sessions):

- Mooncake FAST'25 (kvcache-ai/Mooncake, FAST25-release/README.md): `timestamp` is the
  arrival in ms relative to the trace start; `hash_ids` are remapped prefix block hashes of
  512 tokens, one per started block (the published traces: len == ceil(input_length / 512));
  identical ids are reusable prefix blocks ("share the first 12 hash IDs ... the first
  12 * 512 tokens"). Dynamo's datagen synthesizer writes the same, plus two keys of its own.
- Alibaba Bailian (alibaba-edu/qwen-bailian-usagetraces-anon, README.md): `timestamp` in
  seconds from the trace start, `parent_chat_id` -1 for a root, `hash_ids` of 16-token blocks
  (ceil), `type` text/search/image/file (thinking in the newer files) and `turn` describe
  the request without changing its prompt.
- Azure LLM inference (Azure/AzurePublicDataset, AzureLLMInferenceDataset2023/2024.md):
  `TIMESTAMP` is the invocation time (2023: 7 fractional digits, no zone; 2024: up to 6
  digits or none, `+00:00`), `ContextTokens` the prompt, `GeneratedTokens` the output; no
  prompt content, so nothing is shared.
- WEKA kv-cache-tester (callanjfox/kv-cache-tester, docs/trace_replay_tester.md): one
  conversation per file, `t` in seconds from the conversation start, `hash_ids` of the
  file's `block_size` over full blocks only, ids local to the file unless
  `hash_id_scope` is "global".
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kvtrace.errors import TraceFormatError
from kvtrace.replay.readers import detect_format, native_header, open_trace, read_trace
from kvtrace.replay.readers.azure import AZURE_NAMESPACE
from kvtrace.replay.readers.weka import TAIL_ID_BASE, namespace_for
from kvtrace.replay.run import RunSpec, run_replay
from kvtrace.workload.tokens import block_tokens
from tests.cli.support import run
from tests.conftest import TRACES
from tests.replay.test_generate import common_prefix
from tests.replay.test_writers import same

FORMATS_DIR = TRACES / "formats"
MOONCAKE = FORMATS_DIR / "mooncake_fast25.jsonl"
DATAGEN = FORMATS_DIR / "mooncake_datagen.jsonl"
BAILIAN = FORMATS_DIR / "bailian_qwen.jsonl"
AZURE_2023 = FORMATS_DIR / "azure_2023.csv"
AZURE_2024 = FORMATS_DIR / "azure_2024.csv"
WEKA = FORMATS_DIR / "weka"
WEKA_SUBAGENT = FORMATS_DIR / "weka_subagent" / "s.json"
SAMPLES = [(MOONCAKE, "mooncake"), (DATAGEN, "mooncake"), (BAILIAN, "bailian"), (AZURE_2023, "azure"),
           (AZURE_2024, "azure"), (WEKA, "weka"), (WEKA_SUBAGENT, "weka")]


def prompts(path) -> list[np.ndarray]:
    return [r.prompt_token_ids() for r in read_trace(path)]


def hit_tokens(path) -> dict[str, int]:
    """Each request's hit tokens in an unbounded cache-only replay (the Mooncake paper's
    infinite-cache reading: a block hits when its id chain was seen before)."""
    result = run_replay(RunSpec(str(path), mode="cache-only"))
    return {r["request_id"]: r["hit_tokens"] for r in result.per_request}


# -- Mooncake ----------------------------------------------------------------------------

def test_mooncake_times_are_ms_from_the_trace_start_in_file_order():
    reqs = read_trace(MOONCAKE)
    assert detect_format(str(MOONCAKE)) == "mooncake"
    assert [r.arrival_ns for r in reqs] == [0, 0, 3_000_000_000, 5_999_000_000, 6_000_000_000]
    assert [r.request_id for r in reqs] == ["r0", "r1", "r2", "r3", "r4"]  # a tie keeps file order
    assert [(r.input_length, r.output_length) for r in reqs] == [(1200, 10), (1100, 52), (512, 26), (1200, 3),
                                                                 (300, 1)]
    assert all(r.hash_block_size == 512 and len(r.hash_ids) == math.ceil(r.input_length / 512) for r in reqs)


def test_mooncake_equal_ids_are_equal_prefix_blocks_and_the_last_block_is_partial():
    p = prompts(MOONCAKE)
    assert [len(x) for x in p] == [1200, 1100, 512, 1200, 300]
    assert common_prefix(p[0], p[1]) == 2 * 512  # ids [0, 1] shared, then 2 vs 3
    assert np.array_equal(p[2], p[0][:512])  # a whole-block prompt: its one id, no partial block
    assert np.array_equal(p[3], p[0])  # the same ids and length: the same prompt, partial tail too
    assert common_prefix(p[4], p[0]) == 0
    assert np.array_equal(p[0][1024:], block_tokens(2, 512)[:176])  # 1200 = 2 x 512 + the first 176 of id 2
    assert hit_tokens(MOONCAKE) == {"r0": 0, "r1": 1024, "r2": 512, "r3": 1200, "r4": 0}


def test_dynamo_datagen_lines_read_as_mooncake_with_their_extra_keys_ignored():
    a, b = read_trace(DATAGEN)
    assert (a.input_length, a.output_length, a.hash_ids, b.arrival_ns) == (1100, 40, (0, 1, 2), 12_000_000)
    assert np.array_equal(b.prompt_token_ids(), a.prompt_token_ids()[:1024])


def test_a_floor_length_id_list_is_refused_naming_the_line(tmp_path):
    # Dynamo's datagen README says len(hash_ids) == input_length // block_size; the published
    # traces and its synthesizer have one id per started block (6755 tokens: 14 ids)
    good = '{"timestamp": 0, "input_length": 6755, "output_length": 500, "hash_ids": %s}\n'
    p = tmp_path / "floor.jsonl"
    p.write_text(good % list(range(14)) + good % list(range(13)))
    with pytest.raises(TraceFormatError, match=r"floor\.jsonl:2: hash_ids: expected ceil\(input_length 6755 / "
                                               r"block_size 512\) = 14 ids, got 13"):
        read_trace(p)


# -- Bailian -----------------------------------------------------------------------------

def test_bailian_times_are_seconds_and_sessions_follow_parent_chat_ids():
    reqs = read_trace(BAILIAN)
    assert detect_format(str(BAILIAN)) == "bailian"
    assert [r.request_id for r in reqs] == ["chat-0", "chat-1", "chat-2", "chat-3", "chat-5", "chat-6"]
    assert [r.arrival_ns for r in reqs] == [0, 513_000_000, 61_114_000_000, 62_500_000_000, 62_500_000_000,
                                            7_199_999_000_000]
    # chats 2 and 3 continue root 0; chat 5's parent 4 is before the window, so 4 stands for its root
    assert [r.session_id for r in reqs] == ["0", "1", "0", "0", "4", "4"]
    assert all(r.hash_block_size == 16 and len(r.hash_ids) == math.ceil(r.input_length / 16) for r in reqs)
    assert len(reqs[1].hash_ids) == 32  # the thinking trace's first line: 502 tokens, 32 ids


def test_bailian_turns_share_the_blocks_their_ids_share():
    p = prompts(BAILIAN)
    # turn 2 keeps turn 1's two full blocks; turn 1's partial third block (id 2, hashed with
    # padding: the dataset's Q&A) is not among turn 2's ids, so it is not shared
    assert common_prefix(p[2], p[0]) == 32
    assert common_prefix(p[3], p[2]) == 64
    assert np.array_equal(p[5][:16], p[4]) and common_prefix(p[1], p[0]) == 0
    assert hit_tokens(BAILIAN) == {"chat-0": 0, "chat-1": 0, "chat-2": 32, "chat-3": 64, "chat-5": 0, "chat-6": 16}


def test_bailian_type_and_turn_do_not_change_the_requests(tmp_path):
    rows = [json.loads(line) for line in BAILIAN.read_text().splitlines()]
    for row in rows:
        row["type"], row["turn"] = "text", 1
    other = tmp_path / "retyped.jsonl"
    other.write_text("".join(json.dumps(r) + "\n" for r in rows))
    a, b = read_trace(BAILIAN), read_trace(other)
    assert len(a) == len(b) == 6 and all(same(x, y) for x, y in zip(a, b))


# -- Azure -------------------------------------------------------------------------------

@pytest.mark.parametrize("path,arrivals", [
    # 2023: 7 fractional digits (100 ns), no zone; a tie keeps file order
    (AZURE_2023, [0, 4_314_579_000, 4_314_579_000, 77_299_370_000]),
    # 2024: "+00:00", 6 digits or none; across midnight
    (AZURE_2024, [0, 4_540_000, 5_703_000, 1_046_223_000]),
])
def test_azure_timestamps_are_exact_and_relative_to_the_first_row(path, arrivals):
    reqs = read_trace(path)
    assert detect_format(str(path)) == "azure"
    assert [r.arrival_ns for r in reqs] == arrivals


def test_azure_context_tokens_are_the_prompt_and_nothing_is_shared():
    reqs = read_trace(AZURE_2024)
    assert [(r.input_length, r.output_length) for r in reqs] == [(2688, 366), (1452, 3), (584, 3), (16, 1)]
    ids = [h for r in reqs for h in r.hash_ids]
    assert len(ids) == len(set(ids)) and {r.namespace for r in reqs} == {AZURE_NAMESPACE}
    p = prompts(AZURE_2024)
    assert all(common_prefix(p[i], p[j]) < 16 for i in range(4) for j in range(i))
    assert set(hit_tokens(AZURE_2023).values()) == {0}


# -- WEKA kv-cache-tester ----------------------------------------------------------------

def test_weka_conversations_merge_by_arrival_with_full_block_ids_and_a_private_tail():
    reqs = read_trace(WEKA)
    assert detect_format(str(WEKA)) == "weka"
    assert [r.request_id for r in reqs] == ["a/0", "b/0", "g1/0", "b/1", "g2/0", "a/1", "a/2"]  # ties: by file
    assert [r.arrival_ns for r in reqs] == [0, 0, 1_000_000_000, 3_250_000_000, 3_250_000_000, 4_000_000_000,
                                            12_500_000_000]
    assert [r.session_id for r in reqs] == ["conv-a", "conv-b", "conv-g1", "conv-b", "conv-g2", "conv-a", "conv-a"]
    by_id = {r.request_id: r for r in reqs}
    # floor(150 / 64) = 2 hashed blocks; the 22 tokens left get an id of their own, never seen again
    assert by_id["a/0"].hash_ids == (1, 2, TAIL_ID_BASE + 0) and by_id["a/2"].hash_ids == (1, 2, 3, 4)
    assert by_id["a/0"].namespace == namespace_for("a.json") != by_id["b/0"].namespace
    assert by_id["g1/0"].namespace == by_id["g2/0"].namespace == 0


def test_weka_local_ids_share_within_a_file_and_global_ids_across_files():
    p = {r.request_id: r.prompt_token_ids() for r in read_trace(WEKA)}
    assert common_prefix(p["a/1"], p["a/0"]) == 128  # the two hashed blocks, not a/0's tail
    assert common_prefix(p["a/2"], p["a/1"]) == 192
    assert common_prefix(p["b/0"], p["a/0"]) == 0  # ids 1, 2 of another file are other blocks
    assert common_prefix(p["g2/0"], p["g1/0"]) == 128  # global: the same blocks in both files
    assert hit_tokens(WEKA) == {"a/0": 0, "b/0": 0, "g1/0": 0, "b/1": 128, "g2/0": 128, "a/1": 128, "a/2": 192}


def test_weka_subagent_requests_join_the_timeline_at_their_start():
    """A ``type: "subagent"`` entry (17 of the 710 public conversations hold one) was refused
    as a request missing ``in``. The tester's flatten_requests times a sub-agent's requests
    from its start (parent base + entry t + request t) and replays it as another user."""
    reqs = read_trace(WEKA_SUBAGENT)
    assert [r.arrival_ns for r in reqs] == [0, 10_000_000_000, 12_000_000_000, 16_000_000_000]
    assert [r.input_length for r in reqs] == [150, 130, 256, 200]
    assert [r.request_id for r in reqs] == ["s/0", "s/1/0", "s/2", "s/1/1"]
    assert [r.session_id for r in reqs] == ["conv-s", "conv-s:agent_001", "conv-s", "conv-s:agent_001"]
    assert {r.namespace for r in reqs} == {namespace_for("s.json")}  # one file, one id space
    p = {r.request_id: r.prompt_token_ids() for r in reqs}
    assert common_prefix(p["s/1/1"], p["s/1/0"]) == 128  # the sub-agent's own two blocks
    assert common_prefix(p["s/2"], p["s/0"]) == 128 and common_prefix(p["s/1/0"], p["s/0"]) == 0
    tails = [r.hash_ids[-1] for r in reqs if r.input_length % 64]
    assert len(set(tails)) == len(tails) == 3 and min(tails) >= TAIL_ID_BASE  # each tail its own block


def test_weka_requests_arriving_together_keep_their_file_order_inside_a_subagent_too(tmp_path):
    """Ties broke by a numbering that put every top-level request before any sub-agent's,
    though the docs say file order: a sub-agent's request at 12 s came after entry 2's."""
    import json

    doc = json.loads(WEKA_SUBAGENT.read_text())
    doc["requests"][1]["requests"][0]["t"] = 2.0  # (the sub-agent starts at 10 s: 12 s, as entry 2)
    tie = tmp_path / "tie.json"
    tie.write_text(json.dumps(doc))
    reqs = read_trace(tie)
    assert [(r.request_id, r.arrival_ns) for r in reqs][1:3] == [("tie/1/0", 12_000_000_000),
                                                                  ("tie/2", 12_000_000_000)]


@pytest.mark.parametrize("edit,line,what", [
    (lambda d: d["requests"][1]["requests"][1].pop("in"), 1, "requests[1].requests[1].in: missing"),
    (lambda d: d["requests"][1]["requests"][1].update(t=-1.0), 1, "requests[1].requests[1].t"),
    (lambda d: d["requests"][1]["requests"][0].update(type="subagent"), 1, "a sub-agent inside a sub-agent"),
    (lambda d: d["requests"][1].update(t=1e300), 1, "requests[1].t"),
])
def test_a_bad_subagent_request_is_one_line_naming_its_place(edit, line, what, tmp_path):
    import json

    from kvtrace.errors import TraceFormatError

    doc = json.loads(WEKA_SUBAGENT.read_text())
    edit(doc)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(TraceFormatError) as err:
        read_trace(bad)
    assert str(err.value).startswith(f"{bad}:{line}: ") and what in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


# -- convert -----------------------------------------------------------------------------

@pytest.mark.parametrize("path,fmt", SAMPLES, ids=lambda v: getattr(v, "name", v))
def test_convert_gives_the_same_requests_and_the_same_replay(path, fmt, tmp_path, capsys):
    out = tmp_path / "native.jsonl"
    code, _, err = run(["convert", str(path), "-o", str(out)], capsys)
    assert code == 0, err
    source = open_trace(path)
    assert native_header(out)["source"] == f"{fmt}:sha256:{source.source_id}"
    a, b = list(source), read_trace(out)
    assert len(a) == len(b) > 0 and all(same(x, y) for x, y in zip(a, b))
    assert all(np.array_equal(x.prompt_token_ids(), y.prompt_token_ids()) for x, y in zip(a, b))
    for mode in ("cache-only", "engine"):
        want = run_replay(RunSpec(str(path), mode=mode)).summary
        got = run_replay(RunSpec(str(out), mode=mode)).summary
        assert got["digest"] == want["digest"] and got["prefix_cache_hits"] == want["prefix_cache_hits"], mode
