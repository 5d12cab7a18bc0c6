"""Generated workloads: seeded, structured as described, and the right geometry for studies."""

from __future__ import annotations

import itertools
import math
import re

import numpy as np
import pytest

from kvtrace.errors import ConfigError
from kvtrace.replay.generate import WORKLOADS, generate, study_workload, write_generated
from kvtrace.replay.readers import native_header, read_trace


def common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    k = 0
    while k < n and a[k] == b[k]:
        k += 1
    return k


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_same_seed_same_workload_other_seed_differs(name, tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_generated(name, a, seed=7)
    write_generated(name, b, seed=7)
    assert a.read_bytes() == b.read_bytes()
    c = tmp_path / "c.jsonl"
    write_generated(name, c, seed=8)
    assert c.read_bytes() != a.read_bytes()
    reqs = read_trace(a)
    assert len(reqs) == WORKLOADS[name].default_requests
    assert [r.arrival_ns for r in reqs] == sorted(r.arrival_ns for r in reqs)
    assert len({r.request_id for r in reqs}) == len(reqs)
    assert all(len(r.hash_ids) == math.ceil(r.input_length / 16) for r in reqs)
    assert native_header(a)["generator"] == name


def test_token_and_hash_prompts_describe_the_same_sharing():
    tok = generate("chat", 3, 40, prompt="tokens")
    hsh = generate("chat", 3, 40)
    assert [r.input_length for r in tok] == [r.input_length for r in hsh]
    for i in range(1, 40):
        shared_tokens = common_prefix(tok[0].token_ids, tok[i].token_ids)
        shared_blocks = common_prefix(hsh[0].hash_ids, hsh[i].hash_ids)
        full = min(tok[0].input_length, tok[i].input_length) // 16
        assert min(shared_blocks, full) == min(shared_tokens // 16, full)


def test_chat_turns_extend_the_conversation():
    reqs = generate("chat", 1)
    by_session: dict[str, list] = {}
    for r in reqs:
        by_session.setdefault(r.session_id, []).append(r)
    multi = [s for s in by_session.values() if len(s) > 2]
    assert len(multi) >= 5
    for turns in multi:
        for prev, nxt in itertools.pairwise(turns):
            assert nxt.input_length > prev.input_length
            assert nxt.arrival_ns > prev.arrival_ns
            # every full block of the previous prompt is a prefix of the next one
            assert nxt.hash_ids[: prev.input_length // 16] == prev.hash_ids[: prev.input_length // 16]
    # a few system prompts are shared across sessions
    firsts = {turns[0].hash_ids[0] for turns in by_session.values()}
    assert 2 <= len(firsts) <= 4 < len(by_session)


def test_agent_contexts_grow_long():
    reqs = generate("agent", 2)
    assert max(r.input_length for r in reqs) > 8000
    sessions = {r.session_id for r in reqs}
    assert len(sessions) >= 5
    assert len({r.hash_ids[0] for r in reqs}) <= 2  # two shared tool preambles


def test_mixed_is_small_enough_for_the_demo():
    reqs = generate("mixed", 0)
    total = sum(r.input_length for r in reqs)
    assert 100 <= len(reqs) <= 200 and total < 600_000
    assert {r.session_id[:4] for r in reqs} == {"chat", "agen"}


def test_shared_prefix_study_junction_is_mid_mamba_block():
    reqs = generate(study_workload("shared-prefix-pinning"), 0)  # kimi-hybrid: H 64, M 512
    junctions = {}
    for a in reqs[:3]:
        for b in reqs[3:]:
            if a.session_id == b.session_id:
                junctions.setdefault(a.session_id, set()).add(common_prefix(a.hash_ids, b.hash_ids) * 16)
    assert len(junctions) == 3
    for found in junctions.values():
        (junction,) = found  # one system prompt per session, always the same length
        assert junction % 64 == 0 and junction % 512 != 0 and 1024 <= junction <= 2560


@pytest.mark.parametrize("hbs,mbs", [(64, 512), (16, 64)])
def test_external_cow_study_geometry(hbs, mbs):
    reqs = generate("study-external-hit-running-cow", 4, hash_block_size=hbs, mamba_block_size=mbs)
    parents = {r.session_id: r for r in reqs if r.request_id.endswith("-parent")}
    children = [r for r in reqs if "-child" in r.request_id]
    assert len(parents) >= 5 and len(children) >= 2 * (len(parents) - 1)
    for c in children:
        p = parents[c.session_id]
        e = p.input_length
        # the parent's tail, where a hit on it ends, is one hash block into a Mamba block
        assert (e - 1) // hbs * hbs % mbs == hbs and e % mbs == hbs + 1
        assert c.hash_ids[: e // 16] == p.hash_ids[: e // 16]  # the child extends the parent's tail
        n = c.input_length
        assert n // mbs == e // mbs  # continues inside the same Mamba block
        assert n % hbs != 0 and (n // hbs) * hbs > e  # a partial tail past the hit, then more tokens
    fillers = [r for r in reqs if "-fill" in r.request_id]
    assert all(r.session_id is None for r in fillers) and len(fillers) >= 3 * (len(parents) - 1)
    retries = [r for r in reqs if "-retry" in r.request_id]
    assert retries and all(
        np.array_equal(r.prompt_token_ids(), next(c for c in children if c.request_id == r.request_id.replace(
            "retry", "child")).prompt_token_ids()) for r in retries)
    # the fillers between parent and child, with a state block each, take most of the
    # hinted pool (shared by both groups: the parent, freed before them, leaves the GPU),
    # yet each fits in it
    usable = WORKLOADS["study-external-hit-running-cow"].hints["capacity_blocks"] - 1  # the null block
    if mbs == 512:
        for k in range(len(parents) - 1):
            sizes = [-(-f.input_length // 512) + 1 for f in fillers[3 * k:3 * k + 3]]
            assert sum(sizes) > usable * 3 // 4 and max(sizes) < usable


def test_transient_checkpoint_study_has_hot_prefixes_and_long_prompts():
    reqs = generate("study-transient-checkpoint-retention", 0)
    hot = {}
    for r in reqs:
        hot.setdefault(r.session_id, []).append(r)
    assert 2 <= len(hot) <= 4
    for group in hot.values():
        if len(group) > 1:
            shared = common_prefix(group[0].hash_ids, group[1].hash_ids) * 16
            assert shared % 512 == 0 and 2048 <= shared <= 4096
    assert all(r.input_length % 64 != 0 for r in reqs)  # a tail hash boundary inside the prompt
    assert min(r.input_length for r in reqs) > 8192 + 2048  # longer than one prefill chunk


def test_bad_arguments():
    with pytest.raises(ConfigError, match="unknown 'nope'"):
        generate("nope")
    with pytest.raises(ConfigError, match="--requests: 0: expected an int from 1"):  # (the flag's name)
        generate("chat", 0, 0)
    with pytest.raises(ConfigError, match="--seed: -1: "):
        generate("chat", -1, 5)
    with pytest.raises(ConfigError, match="mamba_block_size"):
        generate("chat", 0, mamba_block_size=96)
    with pytest.raises(ConfigError, match="hash_block_size"):
        generate("chat", 0, block_size=48)
    with pytest.raises(ConfigError, match="no study workload"):
        study_workload("faster-gpus")


@pytest.mark.parametrize(("workload", "geometry", "key"), [
    ("chat", {"block_size": 0}, "block_size"),  # (was blamed on hash_block_size)
    ("chat", {"block_size": 16.0}, "block_size"),  # (a TypeError from range())
    ("chat", {"block_size": True}, "block_size"),
    ("chat", {"hash_block_size": 0}, "hash_block_size"),  # (ZeroDivisionError)
    ("chat", {"hash_block_size": None}, "hash_block_size"),
    ("chat", {"mamba_block_size": "512"}, "mamba_block_size"),
    ("study-transient-checkpoint-retention", {"block_size": 1, "hash_block_size": 1, "mamba_block_size": 3},
     "hash_block_size"),  # (numpy's "low >= high")
    ("study-external-hit-running-cow", {"block_size": 2, "hash_block_size": 2, "mamba_block_size": 6},
     "hash_block_size"),
    ("study-shared-prefix-pinning", {"block_size": 1, "hash_block_size": 1, "mamba_block_size": 6},
     "mamba_block_size"),
    ("study-shared-prefix-pinning", {"hash_block_size": 1 << 40, "mamba_block_size": 1 << 43},
     "hash_block_size"),  # (a MemoryError: numpy asked for 112 TiB)
])
def test_a_bad_geometry_is_one_error_naming_its_key(workload, geometry, key):
    with pytest.raises(ConfigError, match=re.escape(f"generate: {key}: expected an int from ")):
        generate(workload, 0, 30, **geometry)


def test_the_smallest_geometries_allowed_build_every_study():
    for workload, geometry in [
        ("study-transient-checkpoint-retention", {"block_size": 1, "hash_block_size": 2, "mamba_block_size": 6}),
        ("study-external-hit-running-cow", {"block_size": 1, "hash_block_size": 3, "mamba_block_size": 9}),
        ("study-shared-prefix-pinning", {"block_size": 1, "hash_block_size": 1, "mamba_block_size": 8}),
    ]:
        assert len(generate(workload, 0, 30, **geometry)) == 30


def test_requests_as_a_bool_is_refused():
    with pytest.raises(ConfigError, match=re.escape("--requests: True: expected an int")):
        generate("chat", 0, True)


def test_num_requests_and_token_prompts():
    reqs = generate("agent", 5, 12, prompt="tokens")
    assert len(reqs) == 12 and all(r.hash_ids is None and r.token_ids.dtype == np.int64 for r in reqs)


def test_a_workload_too_large_to_build_in_memory_is_refused_as_it_grows(monkeypatch):
    # a million agent requests (the --requests bound) would have needed ~80 GB of prompt tokens
    import kvtrace.replay.generate as G

    monkeypatch.setattr(G, "MAX_GENERATED_TOKENS", 200_000)
    with pytest.raises(ConfigError, match=r"--requests: 1000000: this workload's prompts pass 200,000 tokens after"):
        generate("agent", 0, 1_000_000)
    assert len(generate("agent", 0, 10)) == 10  # (a small one is built as before)


def test_an_unknown_generated_trace_names_the_trace_argument(capsys):
    """``replay gen:nope`` said "generate: workload: unknown 'nope'", a command and argument
    the user did not type."""
    from tests.cli.support import run

    code, _, err = run(["replay", "gen:nope", "--limit", "1"], capsys)
    assert code == 2 and err.startswith("kvtrace: error: TRACE: gen:nope: no generated workload 'nope'"), err
    assert "generate:" not in err


def test_a_geometry_of_millions_of_ids_a_request_is_refused_before_it_is_built():
    # block_size 1 under a 2^20-token Mamba block: 3.3M ids a request, 45 s and 2.5 GB for three
    with pytest.raises(ConfigError, match=re.escape("or a larger block_size (at most 8,388,608 block ids)")):
        generate("study-shared-prefix-pinning", num_requests=3, block_size=1, hash_block_size=262144,
                 mamba_block_size=1 << 20)
